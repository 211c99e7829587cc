""":func:`apply_to_model`: the RMSNorm modules of a built model, swapped for :class:`TilegymHFRMSNorm`.

The replacement holds the *same* ``weight`` Parameter, so ``state_dict()`` keys and values, optimizer
state, tied weights and PEFT wrappers are unchanged. Apply it before wrapping the model in FSDP /
DeepSpeed (they keep references to the modules they own; it raises on an FSDP-wrapped model) and before
``torch.compile``. Forward and backward hooks of a replaced module and an accelerate ``_hf_hook``
(``device_map`` dispatch) move to the new module.
"""

from __future__ import annotations

import functools
import numbers
import warnings

import torch

from ...module import RMSNorm as _TilegymRMSNorm
from .kinds import KINDS, KINDS_BY_NAME, NormKind, hf_rms_norm
from .recognize import kind_of, require_transformers


class TilegymHFRMSNorm(torch.nn.Module):
    """An HF RMSNorm module on tilegym_rms kernels; holds the original module's ``weight`` Parameter.

    ``kind`` is ``"llama"``, ``"gemma"`` or ``"olmo2"`` (see :mod:`.kinds`). ``eps`` is also readable
    as ``variance_epsilon``, the name the llama kind uses in HF.
    """

    def __init__(self, weight: torch.nn.Parameter, eps: float, kind: str = "llama", backend=None, source=None):
        super().__init__()
        spec = KINDS_BY_NAME.get(kind)
        if spec is None:
            raise ValueError(f"kind must be one of {[k.name for k in KINDS]}, got {kind!r}")
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise ValueError(f"weight must be a 1-D tensor, got {type(weight).__name__}")
        self.weight = weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight)
        self.eps = float(eps)
        self.kind = spec.name
        self.backend = backend
        self.source = source  # the replaced class's name, for repr

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    # The kind's configuration, read from the table so that ``kind`` stays its one source.
    offset = property(lambda self: KINDS_BY_NAME[self.kind].offset)
    casting_mode = property(lambda self: KINDS_BY_NAME[self.kind].casting_mode)
    weight_promotes = property(lambda self: KINDS_BY_NAME[self.kind].weight_promotes)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hf_rms_norm(hidden_states, self.weight, self.eps, KINDS_BY_NAME[self.kind], self.backend)

    def extra_repr(self) -> str:
        src = f", replaces={self.source}" if self.source else ""
        return f"{tuple(self.weight.shape)}, eps={self.eps}, kind={self.kind!r}{src}"


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
        match_copies: also replace classes whose code is a copy of a known kind's (see
            :mod:`.recognize`); False limits it to the classes in ``FAMILIES`` and their subclasses.

    Modules whose class name ends in ``RMSNorm`` but whose code is not a known kind's are left alone and
    named in one warning. Calling it again replaces nothing more and returns 0.
    """
    require_transformers()
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
                kinds[cls] = kind_of(cls, match_copies)
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
