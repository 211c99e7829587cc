"""Hugging Face transformers: run the RMSNorm modules of HF models on tilegym_rms kernels.

Three ways in:

* :func:`apply_to_model` patches a built model in place: every RMSNorm module of a supported kind is
  replaced by a :class:`TilegymHFRMSNorm` that holds the *same* ``weight`` Parameter, so
  ``state_dict()`` keys and values, optimizer state, tied weights and PEFT wrappers are unchanged.
* :func:`patch_transformers` (or the :func:`patched_transformers` context manager) replaces the
  ``forward`` of the families' RMSNorm classes, so that models built afterwards (``from_pretrained``,
  ``from_config``) and existing instances run the kernels; :func:`unpatch_transformers` undoes it.
* :func:`kernelize_model` goes through the HF ``kernels`` package (``kernels.kernelize``) with a layer
  from this package (:class:`TilegymKernelsRepository`): nothing is fetched from the Hub. It needs
  ``pip install kernels``; :func:`kernels_mapping` gives the mapping for callers of ``kernelize``.

What a norm computes is recognised from its code, not its name. Three HF formulas are known, each
mapped onto a :func:`tilegym_rms.rms_norm` configuration:

=========  ===================================================  ======  ============  ================
kind       HF forward (x: input, w: weight, r: fp32 rstd)       offset  casting_mode  output dtype
=========  ===================================================  ======  ============  ================
llama      ``w * (x.float() * r).to(x.dtype)``                 0       ``"llama"``   promote(w, x)
gemma      ``((x.float() * r) * (1 + w.float())).to(x.dtype)``  1       ``"gemma"``   x's
olmo2      ``(w * (x.float() * r)).to(x.dtype)``                0       ``"gemma"``   x's
=========  ===================================================  ======  ============  ================

llama: Llama, Mistral, Qwen2, Qwen3 (also its ``q_norm``/``k_norm`` over ``head_dim``), Phi3.
gemma: Gemma, Gemma2, Gemma3 (weight initialised to zeros). olmo2: Olmo2.

A class is of a kind when the code of its ``forward`` (and Gemma's ``_norm``) is the same bytecode as
the reference class's (LlamaRMSNorm, GemmaRMSNorm, Olmo2RMSNorm): subclasses that do not override
them qualify, and so do the many generated copies in transformers (``# Copied from``, modular). With
``match_copies=False`` only the listed families and their subclasses do. Each reference is checked
once per process against :mod:`tilegym_rms.reference` on a small CPU probe, so a transformers release
that changes a formula turns the kind off rather than computing something else (with transformers
4.51, Olmo2RMSNorm still computes the llama formula: it is then recognised as llama).

dtype handling (llama kind): HF multiplies by the weight *after* rounding to the input dtype, so the
result has the promoted dtype of weight and input. When that is the input dtype (the usual case: a
bf16 model, or an fp32 model) one fused kernel call gives it. When it is not (fp32 weights with bf16
activations, as under autocast or with an fp32 master copy), the kernel normalizes without weight
(``x * rstd`` rounded to the input dtype, as HF rounds it) and the weight product is one torch
multiply in the promoted dtype, exactly HF's expression. The gemma and olmo2 kinds always return the
input dtype, as HF does, whatever the weight dtype.

Known differences: float64 inputs are computed in float64 (HF computes in float32 and casts back);
fp64 needs ``backend="torch"``.

Apply :func:`apply_to_model` before wrapping the model in FSDP / DeepSpeed (they keep references to
the modules they own; it raises on an FSDP-wrapped model) and before ``torch.compile``. Forward and
backward hooks of a replaced module and an accelerate ``_hf_hook`` (``device_map`` dispatch) move to
the new module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import numbers
import warnings

import torch

from .. import reference
from ..module import RMSNorm as _TilegymRMSNorm
from ..ops import rms_norm

INSTALL_HINT = "pip install 'tilegym_rms[hf]'"

__all__ = [
    "FAMILIES",
    "TilegymKernelsRMSNorm",
    "TilegymKernelsRepository",
    "kernelize_model",
    "kernels_mapping",
    "TilegymHFRMSNorm",
    "apply_to_model",
    "patch_transformers",
    "patched_transformers",
    "unpatch_transformers",
]


def _require_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"tilegym_rms.integrations.hf needs Hugging Face transformers: {INSTALL_HINT}") from e
    return transformers


# ----------------------------------------------------------------------------------------------
# The known formulas
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NormKind:
    """One HF RMSNorm formula and the tilegym_rms configuration that computes it."""

    name: str
    offset: float
    casting_mode: str
    eps_attr: str  # where HF keeps eps on the module
    # The weight multiplies after the cast to the input dtype, so the output takes the promoted dtype.
    weight_promotes: bool
    methods: tuple[str, ...]  # the methods whose code defines the formula
    reference_module: str  # transformers.models.<this>.modeling_<this>
    reference_class: str


LLAMA = NormKind("llama", 0.0, "llama", "variance_epsilon", True, ("forward",), "llama", "LlamaRMSNorm")
GEMMA = NormKind("gemma", 1.0, "gemma", "eps", False, ("forward", "_norm"), "gemma", "GemmaRMSNorm")
OLMO2 = NormKind("olmo2", 0.0, "gemma", "variance_epsilon", False, ("forward",), "olmo2", "Olmo2RMSNorm")
KINDS = (LLAMA, GEMMA, OLMO2)

# family -> (module under transformers.models, its RMSNorm class): what patch_transformers patches and
# what match_copies=False accepts. The kind is read from each class's code (in transformers 5: llama for
# the first five, gemma for the Gemmas, olmo2 for Olmo2, which in 4.51 still had Llama's formula).
FAMILIES = {
    "llama": ("llama", "LlamaRMSNorm"),
    "mistral": ("mistral", "MistralRMSNorm"),
    "qwen2": ("qwen2", "Qwen2RMSNorm"),
    "qwen3": ("qwen3", "Qwen3RMSNorm"),
    "phi3": ("phi3", "Phi3RMSNorm"),
    "gemma": ("gemma", "GemmaRMSNorm"),
    "gemma2": ("gemma2", "Gemma2RMSNorm"),
    "gemma3": ("gemma3", "Gemma3RMSNorm"),
    "olmo2": ("olmo2", "Olmo2RMSNorm"),
}


def _load_class(module: str, name: str):
    _require_transformers()
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(mod, name)


def _family_class(family: str):
    """The family's RMSNorm class, or None when this transformers does not have the family."""
    module, name = FAMILIES[family]
    try:
        return _load_class(module, name)
    except (ImportError, AttributeError):
        return None


# ----------------------------------------------------------------------------------------------
# The computation
# ----------------------------------------------------------------------------------------------


def _hf_rms_norm(x, weight, eps, offset, casting_mode, weight_promotes, backend):
    """What the HF module computes, through :func:`tilegym_rms.rms_norm`."""
    if weight_promotes and torch.promote_types(weight.dtype, x.dtype) != x.dtype:
        # HF rounds x * rstd to x's dtype and then multiplies by a wider weight: the kernel does the
        # first part, the multiply stays HF's own expression so that dtype and values are HF's.
        return weight * rms_norm(x, None, eps, casting_mode="llama", backend=backend)
    return rms_norm(x, weight, eps, offset=offset, casting_mode=casting_mode, backend=backend)


class TilegymHFRMSNorm(torch.nn.Module):
    """An HF RMSNorm module on tilegym_rms kernels; holds the original module's ``weight`` Parameter.

    ``kind`` is ``"llama"``, ``"gemma"`` or ``"olmo2"`` (see the module doc). ``eps`` is also readable
    as ``variance_epsilon``, the name the llama kind uses in HF.
    """

    def __init__(self, weight: torch.nn.Parameter, eps: float, kind: str = "llama", backend=None, source=None):
        super().__init__()
        spec = {k.name: k for k in KINDS}.get(kind)
        if spec is None:
            raise ValueError(f"kind must be one of {[k.name for k in KINDS]}, got {kind!r}")
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise ValueError(f"weight must be a 1-D tensor, got {type(weight).__name__}")
        self.weight = weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight)
        self.eps = float(eps)
        self.kind = spec.name
        self.offset = spec.offset
        self.casting_mode = spec.casting_mode
        self.weight_promotes = spec.weight_promotes
        self.backend = backend
        self.source = source  # the replaced class's name, for repr

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _hf_rms_norm(
            hidden_states,
            self.weight,
            self.eps,
            self.offset,
            self.casting_mode,
            self.weight_promotes,
            self.backend,
        )

    def extra_repr(self) -> str:
        src = f", replaces={self.source}" if self.source else ""
        return f"{tuple(self.weight.shape)}, eps={self.eps}, kind={self.kind!r}{src}"


# ----------------------------------------------------------------------------------------------
# Recognising a class's formula
# ----------------------------------------------------------------------------------------------

_ORIGINAL = "__tilegym_original__"  # on a class-patched forward: the function it replaced


def _method_code(cls, name):
    """The code object behind ``cls.<name>`` (what it was before patch_transformers), or None."""
    try:
        fn = getattr(cls, name)
    except AttributeError:
        return None
    fn = getattr(fn, _ORIGINAL, fn)
    return getattr(fn, "__code__", None)


def _code_key(code):
    return (
        code.co_code,
        code.co_consts,
        code.co_names,
        code.co_varnames,
        code.co_argcount,
        code.co_kwonlyargcount,
        code.co_flags,
    )


@functools.cache
def _reference_keys(kind: NormKind):
    """Code keys of the kind's reference methods, or None when it is absent or fails the probe."""
    try:
        cls = _load_class(kind.reference_module, kind.reference_class)
    except (ImportError, AttributeError):
        return None
    codes = [_method_code(cls, m) for m in kind.methods]
    if any(c is None for c in codes):
        return None
    if not _probe(kind, cls):
        # This transformers computes another formula there (Olmo2 had Llama's before): the kind is off,
        # and classes that match no other kind are reported by apply_to_model like any unknown class.
        return None
    return tuple(_code_key(c) for c in codes)


def _probe(kind: NormKind, cls) -> bool:
    """Runs the reference class's original forward on inputs whose rounding tells the formulas apart
    and compares with :mod:`tilegym_rms.reference` exactly (values and dtype).

    Rows of +-1 have a mean square of exactly 1, so every formula computes the same ``rstd`` bit for
    bit; an eps of 0.21 makes ``x * rstd`` inexact in bf16, so rounding before or after the weight
    multiply changes many outputs, and the offset changes all of them."""
    n, eps = 256, 0.21
    # Explicit device and dtype: a torch.device(...) context or another default dtype must not move it.
    gen = torch.Generator().manual_seed(0)
    x = (torch.randint(0, 2, (4, n), generator=gen, device="cpu") * 2 - 1).to(torch.bfloat16)
    w32 = torch.randn(n, generator=gen, device="cpu", dtype=torch.float32) * 0.5
    forward = getattr(cls.forward, _ORIGINAL, cls.forward)
    with torch.no_grad():
        for w in (w32.to(torch.bfloat16), w32):
            module = cls.__new__(cls)
            torch.nn.Module.__init__(module)
            module.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
            setattr(module, kind.eps_attr, eps)
            try:
                got = forward(module, x)
            except Exception:
                return False
            if kind.weight_promotes and torch.promote_types(w.dtype, x.dtype) != x.dtype:
                want = w * reference.rms_norm_forward(x, None, eps, 0.0, "llama")[0]
            else:
                want = reference.rms_norm_forward(x, w, eps, kind.offset, kind.casting_mode)[0]
            if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
                return False
    return True


def _kind_of(cls, match_copies: bool = True):
    """The :class:`NormKind` that ``cls`` computes, or None."""
    if not match_copies and not _is_family_subclass(cls):
        return None
    for kind in KINDS:
        keys = _reference_keys(kind)
        if keys is None:
            continue
        codes = [_method_code(cls, m) for m in kind.methods]
        if all(c is not None for c in codes) and tuple(_code_key(c) for c in codes) == keys:
            return kind
    return None


def _is_family_subclass(cls) -> bool:
    for family in FAMILIES:
        base = _family_class(family)
        if base is not None and issubclass(cls, base):
            return True
    return False


# ----------------------------------------------------------------------------------------------
# apply_to_model
# ----------------------------------------------------------------------------------------------

# Module state that belongs to whoever registered it, not to the computation: handed to the new module
# as the same objects, so that RemovableHandles still remove.
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _move_hooks(old: torch.nn.Module, new: torch.nn.Module) -> None:
    for attr in _HOOK_DICTS:
        if attr in old.__dict__:
            new.__dict__[attr] = old.__dict__[attr]
    if "_is_full_backward_hook" in old.__dict__:
        new._is_full_backward_hook = old._is_full_backward_hook
    hook = getattr(old, "_hf_hook", None)
    if hook is not None:
        # accelerate's add_hook_to_module would call hook.init_hook, which moves (or offloads) the
        # weights again; the hook was initialised on the old module already, so only the wrapper moves.
        new._hf_hook = hook
        new._old_forward = new.forward
        new.forward = functools.update_wrapper(functools.partial(_accelerate_forward, new), new._old_forward)


def _accelerate_forward(module, *args, **kwargs):
    """accelerate's hooked forward (accelerate.hooks.add_hook_to_module)."""
    args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
    if module._hf_hook.no_grad:
        with torch.no_grad():
            output = module._old_forward(*args, **kwargs)
    else:
        output = module._old_forward(*args, **kwargs)
    return module._hf_hook.post_forward(module, output)


def _check_not_sharded(model: torch.nn.Module) -> None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        sharded = (FullyShardedDataParallel,)
        from torch.distributed.fsdp import FSDPModule

        sharded += (FSDPModule,)
    except ImportError:
        pass
    else:
        if any(isinstance(m, sharded) for m in model.modules()):
            raise RuntimeError(
                "apply_to_model must run before FSDP wraps the model: FSDP keeps references to the modules it "
                "shards, and replaced modules would not get their parameters gathered"
            )


def _replacement(module, kind: NormKind, backend):
    weight = getattr(module, "weight", None)
    eps = getattr(module, kind.eps_attr, None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
        return None
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        return None
    new = TilegymHFRMSNorm(weight, eps, kind.name, backend=backend, source=type(module).__name__)
    new.train(module.training)
    _move_hooks(module, new)
    return new


def apply_to_model(model: torch.nn.Module, *, backend=None, match_copies: bool = True) -> int:
    """Replaces every RMSNorm module of a known kind in ``model`` (in place) by a
    :class:`TilegymHFRMSNorm` that holds the same ``weight`` Parameter. Returns how many modules it
    replaced (a module reachable from several parents counts once).

    Args:
        model: any ``torch.nn.Module``: a transformers model, a PEFT model, a submodule.
        backend: passed to :func:`tilegym_rms.rms_norm` (None chooses per device).
        match_copies: also replace classes whose code is a copy of a known kind's (see the module doc);
            False limits it to the classes in :data:`FAMILIES` and their subclasses.

    Modules whose class name ends in ``RMSNorm`` but whose code is not a known kind's are left alone and
    named in one warning. Calling it again replaces nothing more and returns 0.
    """
    _require_transformers()
    _check_not_sharded(model)
    kinds: dict[type, NormKind | None] = {}
    replaced: dict[int, torch.nn.Module] = {}
    unknown: set[str] = set()
    edits = []
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is None or isinstance(child, TilegymHFRMSNorm):
                continue
            cls = type(child)
            if cls not in kinds:
                kinds[cls] = _kind_of(cls, match_copies)
            kind = kinds[cls]
            if kind is None:
                if cls.__name__.endswith("RMSNorm") and not isinstance(child, _TilegymRMSNorm):
                    unknown.add(cls.__name__)
                continue
            edits.append((parent, name, child, kind))
    for parent, name, child, kind in edits:
        new = replaced.get(id(child))
        if new is None:
            new = _replacement(child, kind, backend)
            if new is None:
                unknown.add(f"{type(child).__name__} (weight or eps of an unexpected type)")
                continue
            replaced[id(child)] = new
        parent._modules[name] = new
    if unknown:
        warnings.warn(
            "tilegym_rms.apply_to_model left these RMSNorm classes alone (their code is not a known HF RMSNorm "
            f"formula): {', '.join(sorted(unknown))}",
            stacklevel=2,
        )
    return len(replaced)


# ----------------------------------------------------------------------------------------------
# patch_transformers: class-level
# ----------------------------------------------------------------------------------------------

_MISSING = object()
_CLASS_PATCHES: dict[type, object] = {}  # patched class -> its own forward before (or _MISSING)


def _class_forward(kind: NormKind, backend, original):
    eps_attr, offset, casting_mode, promotes = kind.eps_attr, kind.offset, kind.casting_mode, kind.weight_promotes

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _hf_rms_norm(
            hidden_states, self.weight, getattr(self, eps_attr), offset, casting_mode, promotes, backend
        )

    setattr(forward, _ORIGINAL, original)
    forward.__doc__ = f"tilegym_rms kernels, {kind.name!r} kind (patched by tilegym_rms.patch_transformers)"
    return forward


def _resolve_families(families) -> list[type]:
    """Classes named by ``families``: None (every family this transformers has), family names, classes."""
    _require_transformers()
    if families is None:
        return [c for c in (_family_class(f) for f in FAMILIES) if c is not None]
    if isinstance(families, (str, type)):
        families = [families]
    classes = []
    for fam in families:
        if isinstance(fam, type):
            classes.append(fam)
            continue
        if fam not in FAMILIES:
            raise ValueError(f"unknown family {fam!r}; known: {', '.join(FAMILIES)} (or pass an RMSNorm class)")
        cls = _family_class(fam)
        if cls is None:
            raise ValueError(
                f"transformers {_require_transformers().__version__} has no {FAMILIES[fam][1]} (family {fam!r})"
            )
        classes.append(cls)
    return classes


def patch_transformers(families=None, *, backend=None) -> list[str]:
    """Makes the RMSNorm classes of ``families`` run tilegym_rms kernels by replacing their ``forward``.

    Models built afterwards (``from_pretrained``, ``from_config``) and existing instances of those classes
    (and of subclasses that do not override ``forward``) use the kernels; modules and parameters stay
    HF's. ``families``: None for all of :data:`FAMILIES` that this transformers has, or names from it,
    or RMSNorm classes (a class must compute a known kind). Idempotent; calling it again with another
    ``backend`` switches the backend. Returns the names of the patched classes.
    """
    classes = _resolve_families(families)
    patched = []
    for cls in classes:
        kind = _kind_of(cls)
        if kind is None:
            raise ValueError(f"{cls.__qualname__} does not compute a known RMSNorm kind; it cannot be patched")
        original = _CLASS_PATCHES.get(cls, cls.__dict__.get("forward", _MISSING))
        if cls not in _CLASS_PATCHES:
            _CLASS_PATCHES[cls] = original
        inherited = original if original is not _MISSING else cls.forward
        cls.forward = _class_forward(kind, backend, getattr(inherited, _ORIGINAL, inherited))
        patched.append(cls.__name__)
    return patched


def unpatch_transformers(families=None) -> list[str]:
    """Restores the ``forward`` of classes patched by :func:`patch_transformers` (all of them for None).
    Returns the names of the classes restored."""
    classes = list(_CLASS_PATCHES) if families is None else _resolve_families(families)
    restored = []
    for cls in classes:
        original = _CLASS_PATCHES.pop(cls, None)
        if original is None:
            continue
        if original is _MISSING:
            del cls.forward
        else:
            cls.forward = original
        restored.append(cls.__name__)
    return restored


@contextlib.contextmanager
def patched_transformers(families=None, *, backend=None):
    """:func:`patch_transformers` for the duration of a ``with`` block; restores only the classes that
    were not patched before it. Yields the names of the patched classes."""
    before = set(_CLASS_PATCHES)
    names = patch_transformers(families, backend=backend)
    try:
        yield names
    finally:
        unpatch_transformers([c for c in list(_CLASS_PATCHES) if c not in before])


# ----------------------------------------------------------------------------------------------
# The HF `kernels` package: a layer it can load without the Hub
# ----------------------------------------------------------------------------------------------

KERNELS_LAYER_NAME = "RMSNorm"  # the name transformers gives its RMSNorm classes (use_kernel_forward_from_hub)
_KERNELS_KINDS: dict[type, NormKind | None] = {}  # filled eagerly, read under torch.compile


def _kernels_kind(cls):
    if cls not in _KERNELS_KINDS:
        _KERNELS_KINDS[cls] = _kind_of(cls)
    return _KERNELS_KINDS[cls]


def _kernels_layer_forward(module, hidden_states):
    cls = type(module)
    kind = _kernels_kind(cls)
    if kind is None:
        # "RMSNorm" also tags classes of formulas we do not know: their own forward is still the class's
        # (kernelize replaces the instance's).
        return cls.forward(module, hidden_states)
    return _hf_rms_norm(
        hidden_states,
        module.weight,
        getattr(module, kind.eps_attr),
        kind.offset,
        kind.casting_mode,
        kind.weight_promotes,
        None,
    )


class TilegymKernelsRMSNorm(torch.nn.Module):
    """The layer that ``kernels.kernelize`` puts in place of an HF RMSNorm's forward (it runs with the
    HF module as ``self``). kernels requires a layer without state or other methods: the formula is
    looked up from the module's class."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states):
        return _kernels_layer_forward(self, hidden_states)


@dataclasses.dataclass(frozen=True)
class TilegymKernelsRepository:
    """A ``kernels`` layer repository (``layer_name`` and ``load()``, the protocol that ``LayerRepository``
    and ``LocalLayerRepository`` implement) that hands out :class:`TilegymKernelsRMSNorm` from this
    package: nothing is downloaded or built."""

    layer_name: str = KERNELS_LAYER_NAME

    def load(self):
        return TilegymKernelsRMSNorm

    def __str__(self) -> str:
        return "tilegym_rms (local layer)"


def kernels_mapping(device_types=("cuda", "cpu")) -> dict:
    """The mapping for ``kernels.use_kernel_mapping`` / ``register_kernel_mapping``: the ``"RMSNorm"``
    layer on each of ``device_types`` comes from this package."""
    repo = TilegymKernelsRepository()
    return {KERNELS_LAYER_NAME: {d: repo for d in device_types}}


def kernelize_model(model: torch.nn.Module, *, mode=None, device=None) -> torch.nn.Module:
    """``kernels.kernelize`` with :func:`kernels_mapping`, offline.

    Classes of a known kind in ``model`` that transformers did not tag for kernels (the Gemma family
    always; every family when transformers' kernels integration is off, as it is when the installed
    ``kernels`` is outside the versions that transformers accepts) are tagged first. Their kinds are
    looked up here, eagerly, so that the kernelized model compiles without graph breaks.
    ``mode`` defaults to ``Mode.TRAINING | Mode.TORCH_COMPILE``; ``device`` to the model's.
    """
    _require_transformers()
    try:
        import kernels
    except ImportError as e:
        raise ImportError("kernelize_model needs the Hugging Face kernels package: pip install kernels") from e
    for cls in {type(m) for m in model.modules()}:
        if _kernels_kind(cls) is not None and getattr(cls, "kernel_layer_name", None) is None:
            kernels.replace_kernel_forward_from_hub(cls, KERNELS_LAYER_NAME)
    if mode is None:
        mode = kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE
    device_types = (torch.device(device).type,) if device is not None else ("cuda", "cpu")
    with kernels.use_kernel_mapping(kernels_mapping(device_types)):
        return kernels.kernelize(model, mode=mode, device=device)
