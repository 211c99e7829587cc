"""Which :class:`~.kinds.NormKind` an HF RMSNorm computes, read from its code and its behaviour, not its name.

By code: a class is of a kind when the code of its ``forward`` (and Gemma's ``_norm``) is the same bytecode as
the kind's reference class's (LlamaRMSNorm, GemmaRMSNorm, ...): subclasses that do not override them qualify,
and so do the many generated copies in transformers (``# Copied from``, modular). With ``match_copies=False``
only the classes of :data:`FAMILIES` and their subclasses do. Each reference is checked once per process on
the probe below, so a transformers release that changes a formula turns the kind off rather than computing
something else (with transformers 4.51, Olmo2RMSNorm still computes the llama formula: it is then
recognised as llama).

By behaviour (``match_copies=True``), for code that matches no reference (Llama4's, Gemma4's, NemotronH's,
the weightless and the gated norms): a blank instance of the class gets the module's own settings (its plain
attributes: eps, ``with_scale``, ``group_size``, ``norm_before_gate``, ...) and a probe weight, runs its
forward on inputs whose roundings tell the formulas apart, and takes the first formula of :data:`KINDS`
(over the row or the groups its settings give; for a forward that takes a gate, with a silu or sigmoid gate
before or after the norm) that gives the same bits and dtype on :mod:`tilegym_rms.reference` for 16-bit and fp32
inputs and weights. A module whose forward reads anything else (a submodule, a tensor other than its
weight, a setting the probe lacks) fails the probe and is left alone; so does one holding state a
replacement would drop (:func:`why_not_plain`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import itertools
import numbers

import torch

from ... import reference
from .kinds import KINDS, NormKind, hf_gated_rms_norm, hf_rms_norm

INSTALL_HINT = "pip install 'tilegym_rms[hf]'"

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

# On a forward that patch_transformers put on a class: the function it replaced, whose code is what
# recognition reads.
ORIGINAL_ATTR = "__tilegym_original__"


def require_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"tilegym_rms.integrations.hf needs Hugging Face transformers: {INSTALL_HINT}") from e
    return transformers


def _load_class(module: str, name: str):
    require_transformers()
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(mod, name)


def family_class(family: str):
    """The family's RMSNorm class, or None when this transformers does not have the family."""
    module, name = FAMILIES[family]
    try:
        return _load_class(module, name)
    except (ImportError, AttributeError):
        return None


def _method_code(cls, name):
    """The code object behind ``cls.<name>`` (what it was before patch_transformers), or None."""
    try:
        fn = getattr(cls, name)
    except AttributeError:
        return None
    fn = getattr(fn, ORIGINAL_ATTR, fn)
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


@dataclasses.dataclass(frozen=True)
class Match:
    """What a module computes: ``kind`` (its ``eps_attr`` names where the module keeps eps), with or without
    its weight, over groups of ``group_size`` columns (None: the row), and for a gated norm where its gate
    applies (``norm_before_gate`` None for a plain norm) and its ``activation``."""

    kind: NormKind
    weighted: bool
    group_size: int | None = None
    norm_before_gate: bool | None = None
    activation: str = "silu"


# Where HF modules keep eps; the probe finds which one a forward reads.
EPS_ATTRS = ("variance_epsilon", "eps")
_PROBE_EPS = 0.21
_DECOY_EPS = 10.0  # given to the other eps attribute: a forward that reads it fails the probe
_PROBE_N = 256  # the width of a probe without a weight to take it from


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


def _reference_norm(x, weight, eps, *, offset=0.0, casting_mode, backend):
    """:func:`tilegym_rms.rms_norm`'s signature, on :mod:`tilegym_rms.reference` (no backend)."""
    del backend
    return reference.rms_norm_forward(x, weight, eps, offset, casting_mode)[0]


def _reference_gated_norm(x, z, weight, eps, *, group_size, norm_before_gate, casting_mode, activation, backend):
    """:func:`tilegym_rms.gated_rms_norm`'s signature, on :mod:`tilegym_rms.reference`."""
    del backend
    args = (group_size, norm_before_gate, 0.0, casting_mode, activation)
    return reference.gated_rms_norm_forward(x, z, weight, eps, *args)[0]


def _probe_tensors(n: int):
    """``x``, a gate and a weight of width ``n``. The entries of ``x`` are +-{0.5, 1, 1.5, 2}: every partial
    sum of their squares is a multiple of 1/4 that fp32 holds exactly, so every formula computes the same
    rstd bit for bit whatever its order of summation; the eps of 0.21 makes ``x * rstd`` inexact in 16 bits,
    so rounding before or after the weight multiply changes many outputs, and an offset changes all."""
    gen = torch.Generator().manual_seed(0)
    # Explicit device and dtype: a torch.device(...) context or another default dtype must not move them.
    magnitude = torch.randint(1, 5, (4, n), generator=gen, device="cpu").to(torch.float32) / 2
    x = magnitude * (torch.randint(0, 2, (4, n), generator=gen, device="cpu") * 2 - 1)
    gate = torch.randn(4, n, generator=gen, device="cpu", dtype=torch.float32) * 2
    weight = torch.randn(n, generator=gen, device="cpu", dtype=torch.float32) * 0.5
    return x, gate, weight


# (x dtype, weight dtype) of the probes: the weight's rounding, promotion and the output dtype all show.
_PROBE_DTYPES = (
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
)
_WEIGHTLESS_DTYPES = ((torch.bfloat16, None), (torch.float16, None), (torch.float32, None))
# Gated: (x dtype, gate dtype), fp32 included: the reference takes silu and sigmoid as torch writes them.
_GATED_DTYPES = (
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
)


def _same(got, want) -> bool:
    return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)


def _blank(cls, attrs: dict, weight):
    """An instance of ``cls`` without its ``__init__``: ``attrs`` set; ``weight`` a Parameter, a plain tensor (a
    buffer, not saved) or None (no weight)."""
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    for name, value in attrs.items():
        setattr(module, name, value)
    if isinstance(weight, torch.Tensor):
        if isinstance(weight, torch.nn.Parameter):
            module.weight = weight
        else:
            module.register_buffer("weight", weight, persistent=False)
    return module


def _original_forward(cls):
    return getattr(cls.forward, ORIGINAL_ATTR, cls.forward)


def takes_gate(cls) -> bool:
    """Whether ``forward`` takes a second positional argument (the gate of a gated norm)."""
    try:
        params = list(inspect.signature(_original_forward(cls)).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3  # self, hidden_states, gate


def _group_sizes(attrs: dict, n: int) -> list:
    """The group sizes to try: the row, and the module's own groups (``group_size``, or ``n_groups`` of the
    width)."""
    sizes = [None]
    size = attrs.get("group_size")
    if isinstance(size, int) and not isinstance(size, bool) and 0 < size < n and n % size == 0:
        sizes.append(size)
    groups = attrs.get("n_groups")
    if isinstance(groups, int) and not isinstance(groups, bool) and 1 < groups <= n and n % groups == 0:
        sizes.append(n // groups)
    return sizes


def _recognise(cls, attrs: dict, weight: str, n: int) -> Match | None:
    """The :class:`Match` of an instance of ``cls`` with plain attributes ``attrs`` and ``weight`` (``"parameter"``,
    ``"buffer"``: one its forward must ignore, or ``"none"``) of width ``n``, by behaviour; None when no kind fits."""
    forward = _original_forward(cls)
    gated = takes_gate(cls)
    if gated and weight != "parameter":
        return None
    x32, gate32, w32 = _probe_tensors(n)
    for eps_attr in [a for a in EPS_ATTRS if a in attrs]:
        probe_attrs = {**attrs, **{a: _DECOY_EPS for a in EPS_ATTRS if a in attrs}, eps_attr: _PROBE_EPS}
        cases = []  # (x, gate, weight given to the formula, HF's output)
        with torch.no_grad():
            dtypes = _GATED_DTYPES if gated else _PROBE_DTYPES if weight == "parameter" else _WEIGHTLESS_DTYPES
            for x_dtype, w_dtype in dtypes:
                x, gate, w = x32.to(x_dtype), gate32.to(x_dtype), w32.to(w_dtype or x_dtype)
                if weight == "parameter":
                    probe_weight = torch.nn.Parameter(w.clone(), requires_grad=False)
                else:
                    probe_weight = w.clone() if weight == "buffer" else None
                module = _blank(cls, probe_attrs, probe_weight)
                try:
                    got = forward(module, x, gate) if gated else forward(module, x)
                except Exception:
                    break
                cases.append((x, gate, w if weight == "parameter" else None, got))
            else:
                match = _first_match(cases, gated, attrs, n)
                if match is not None:
                    return dataclasses.replace(match, kind=dataclasses.replace(match.kind, eps_attr=eps_attr))
    return None


def _first_match(cases, gated: bool, attrs: dict, n: int) -> Match | None:
    """The first kind (group size, and gate placement) whose formula on :mod:`tilegym_rms.reference` gives each
    case's output."""
    norms = {"norm": _reference_norm}
    for kind in KINDS:
        for size in _group_sizes(attrs, n):
            if not gated:
                if all(_same(got, hf_rms_norm(x, w, _PROBE_EPS, kind, None, group_size=size, **norms))
                       for x, _, w, got in cases):  # fmt: skip
                    return Match(kind, cases[0][2] is not None, size)
                continue
            if kind.offset != 0 or kind.casting_mode not in ("llama", "gemma"):
                break  # HF's gated norms: Qwen3-Next's and Mamba2's roundings (llama), FalconH1's (fp32)
            for activation, before in itertools.product(reference.GATE_ACTIVATIONS, (True, False)):
                formula = functools.partial(
                    hf_gated_rms_norm, kind=kind, backend=None, norm_before_gate=before, group_size=size,
                    activation=activation, gated_norm=_reference_gated_norm, **norms,
                )  # fmt: skip
                if all(_same(got, formula(x, g, w, _PROBE_EPS)) for x, g, w, got in cases):
                    return Match(kind, True, size, before, activation)
    return None


def _probe(kind: NormKind, cls) -> bool:
    """Whether a blank instance of ``cls`` (a kind's reference class), with its eps in ``kind.eps_attr`` and a
    weight unless the class has none, computes ``kind`` on the probe."""
    weight = "parameter" if "weight" in _method_names(cls, kind.methods) else "none"
    match = _recognise(cls, {kind.eps_attr: 1.0}, weight, _PROBE_N)
    return match is not None and match.kind.name == kind.name and match.kind.eps_attr == kind.eps_attr


def _method_names(cls, methods) -> set[str]:
    """The attribute names that the code of ``methods`` reads."""
    return {name for m in methods if (c := _method_code(cls, m)) is not None for name in c.co_names}


def _code_kind(cls, match_copies: bool) -> NormKind | None:
    """The kind whose reference code ``cls`` has, or None."""
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


def kind_of(cls, match_copies: bool = True) -> NormKind | None:
    """The :class:`~.kinds.NormKind` that ``cls`` computes with a ``weight`` Parameter and no other setting
    (what the class patch and the kernels layer compute), or None. Its ``eps_attr`` is where ``cls`` keeps eps."""
    kind = _code_kind(cls, match_copies)
    if kind is not None or not match_copies or takes_gate(cls):
        return kind
    return _class_kind(cls)


@functools.cache
def _class_kind(cls) -> NormKind | None:
    for eps_attr in EPS_ATTRS:
        match = _recognise(cls, {eps_attr: 1.0}, "parameter", _PROBE_N)
        if match is not None:
            return match.kind
    return None


def _plain_attrs(module) -> dict:
    """The module's settings: public attributes of plain types (numbers, strings, None and tuples of them)."""

    def plain(v):
        return v is None or isinstance(v, (numbers.Number, str)) or (
            isinstance(v, tuple) and all(plain(e) for e in v)
        )  # fmt: skip

    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training" and plain(v)}


def why_not_plain(module) -> str | None:
    """Why ``module`` cannot be replaced whatever it computes (state a replacement would not hold), or None."""
    if module._modules:
        return "it has submodules"
    if any(p is not None for name, p in module._parameters.items() if name != "weight"):
        return "it has parameters besides its weight"
    weight = getattr(module, "weight", None)
    if "weight" in module._buffers and "weight" not in module._non_persistent_buffers_set:
        return "its weight is a saved buffer"
    if any(name != "weight" for name in module._buffers):
        return "it has buffers"
    if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() != 1):
        return "its weight is not a 1-D tensor"
    return None


def why_left_alone(module) -> str:
    """Why :func:`match_module` finds no formula for ``module`` (the reason apply_to_model's warning gives)."""
    reason = why_not_plain(module)
    if reason is not None:
        return reason
    activation = getattr(module, "activation", None)
    if isinstance(activation, str) and activation not in reference.GATE_ACTIVATIONS:
        return f"its gate is {activation}; gated_rms_norm gates with {' or '.join(reference.GATE_ACTIVATIONS)}"
    return "it computes no formula this integration knows"


_MATCHES: dict = {}  # (class, settings without eps, weight state, width) -> Match or None


def match_module(module: torch.nn.Module, match_copies: bool = True) -> Match | None:
    """What ``module`` computes (see the module doc), or None when it is none of the known formulas. The probe
    runs only for classes named ``*Norm*``: it calls the class's forward, which other layers have no reason
    to share."""
    if why_not_plain(module) is not None:
        return None
    cls = type(module)
    weight = module._parameters.get("weight")
    if isinstance(weight, torch.nn.Parameter):
        kind = _code_kind(cls, match_copies)
        if kind is not None:
            return Match(kind, True)
        state, n = "parameter", weight.shape[0]
    elif "weight" in module._buffers:
        state, n = "buffer", module._buffers["weight"].shape[0]
    else:
        state, n = "none", _PROBE_N
    if not match_copies or n == 0 or "Norm" not in cls.__name__:
        return None
    attrs = _plain_attrs(module)
    if not any(isinstance(attrs.get(a), numbers.Real) and not isinstance(attrs.get(a), bool) for a in EPS_ATTRS):
        return None
    settings = tuple(sorted((k, v) for k, v in attrs.items() if k not in EPS_ATTRS))
    key = (cls, settings, state, n)
    if key not in _MATCHES:
        _MATCHES[key] = _recognise(cls, attrs, state, n)
    return _MATCHES[key]


def _is_family_subclass(cls) -> bool:
    for family in FAMILIES:
        base = family_class(family)
        if base is not None and issubclass(cls, base):
            return True
    return False
