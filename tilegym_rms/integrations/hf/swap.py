""":func:`apply_to_model`: the RMSNorm modules of a built model, swapped for :class:`TilegymHFRMSNorm` (gated
ones for :class:`TilegymHFGatedRMSNorm`).

The replacement holds the *same* ``weight`` Parameter (none for a weightless norm), so ``state_dict()``
keys and values, optimizer state, tied weights and PEFT wrappers are unchanged. Apply it before wrapping
the model in FSDP / DeepSpeed (they keep references to the modules they own; it raises on an FSDP-wrapped
model) and before ``torch.compile``. Forward and backward hooks of a replaced module and an accelerate ``_hf_hook``
(``device_map`` dispatch) move to the new module.
"""

from __future__ import annotations

import functools
import numbers
import warnings

import torch

from ... import _checks
from ...module import RMSNorm as _TilegymRMSNorm
from .kinds import KINDS, KINDS_BY_NAME, hf_gated_rms_norm, hf_rms_norm
from .recognize import Match, match_module, require_transformers, why_left_alone


def _kind(kind: str):
    spec = KINDS_BY_NAME.get(kind)
    if spec is None:
        raise ValueError(f"kind must be one of {[k.name for k in KINDS]}, got {kind!r}")
    return spec


def _weight(weight):
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise ValueError(f"weight must be a 1-D tensor or None, got {type(weight).__name__}")
    return weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight)


class TilegymHFRMSNorm(torch.nn.Module):
    """An HF RMSNorm module on tilegym_rms kernels; holds the original module's ``weight`` Parameter (None for a
    norm without weight).

    ``kind`` is one of :data:`~.kinds.KINDS` (``"llama"``, ``"gemma"``, ``"olmo2"``, ...). ``eps`` is also
    readable as ``variance_epsilon``, the name the llama kind uses in HF. ``group_size``: each group of that
    many columns is normalized apart (None: the whole row).
    """

    def __init__(self, weight, eps: float, kind: str = "llama", backend=None, source=None, *, group_size=None):
        super().__init__()
        self.kind = _kind(kind).name
        self.register_parameter("weight", _weight(weight))
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0
            or (self.weight is not None and self.weight.shape[0] % group_size)
        ):  # fmt: skip
            raise ValueError(
                f"group_size must be None or a positive int dividing the weight's length, got {group_size!r}"
            )
        self.group_size = group_size
        self.eps = float(eps)
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
        kind = KINDS_BY_NAME[self.kind]
        return hf_rms_norm(hidden_states, self.weight, self.eps, kind, self.backend, group_size=self.group_size)

    def extra_repr(self) -> str:
        shape = tuple(self.weight.shape) if self.weight is not None else "no weight"
        groups = f", group_size={self.group_size}" if self.group_size is not None else ""
        src = f", replaces={self.source}" if self.source else ""
        return f"{shape}, eps={self.eps}, kind={self.kind!r}{groups}{src}"


class TilegymHFGatedRMSNorm(TilegymHFRMSNorm):
    """An HF gated RMSNorm (Qwen3-Next, Mamba2, FalconH1, Kimi-Linear, ...) on :func:`tilegym_rms.gated_rms_norm`:
    ``forward(hidden_states, gate=None)``, the gate of ``activation`` (``"silu"``, or ``"sigmoid"`` as
    Kimi-Linear's, Bailing-hybrid's and GLM-5-Next's) after the norm (``norm_before_gate``) or before it; without
    a gate, the class's plain norm. ``kind`` gives the roundings (``"llama"``: Qwen3-Next's and Mamba2's;
    ``"olmo2"``: FalconH1's and the sigmoid-gated ones', fp32 throughout)."""

    def __init__(self, weight, eps: float, kind: str, *, norm_before_gate: bool, group_size=None, backend=None,
                 source=None, activation="silu"):  # fmt: skip
        if weight is None:
            raise ValueError("a gated norm needs its weight")
        _checks.check_activation(activation)
        super().__init__(weight, eps, kind, backend, source, group_size=group_size)
        self.norm_before_gate = bool(norm_before_gate)
        self.activation = activation

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        return hf_gated_rms_norm(
            hidden_states, gate, self.weight, self.eps, KINDS_BY_NAME[self.kind], self.backend,
            norm_before_gate=self.norm_before_gate, group_size=self.group_size, activation=self.activation,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, norm_before_gate={self.norm_before_gate}, activation={self.activation!r}"


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


def replacement(module, match: Match, backend=None):
    """The tilegym module that computes what ``module`` does (as ``match`` says), or None when its eps is not a
    real number."""
    eps = getattr(module, match.kind.eps_attr, None)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        return None
    weight = module.weight if match.weighted else None
    source = type(module).__name__
    if match.norm_before_gate is None:
        new = TilegymHFRMSNorm(weight, eps, match.kind.name, backend, source, group_size=match.group_size)
    else:
        new = TilegymHFGatedRMSNorm(
            weight, eps, match.kind.name, norm_before_gate=match.norm_before_gate, group_size=match.group_size,
            backend=backend, source=source, activation=match.activation,
        )  # fmt: skip
    new.train(module.training)
    _move_hooks(module, new)
    return new


def apply_to_model(model: torch.nn.Module, *, backend=None, match_copies: bool = True) -> int:
    """Replaces every RMSNorm module of a known kind in ``model`` (in place) by a
    :class:`TilegymHFRMSNorm` (a :class:`TilegymHFGatedRMSNorm` for a gated one) that holds the same
    ``weight`` Parameter. Returns how many modules it replaced (a module reachable from several parents
    counts once).

    Args:
        model: any ``torch.nn.Module``: a transformers model, a PEFT model, a submodule.
        backend: passed to :func:`tilegym_rms.rms_norm` (None chooses per device).
        match_copies: also replace classes whose code is a copy of a known kind's, and ``*Norm*`` classes
            whose forward computes one on the probe (see :mod:`.recognize`); False limits it to the classes
            in ``FAMILIES`` and their subclasses.

    Modules whose class name contains ``RMSNorm`` but that compute no known formula (or hold state a
    replacement would lose) are left alone and named, with the reason, in one warning. Calling it again
    replaces nothing more and returns 0.
    """
    require_transformers()
    _check_not_sharded(model)
    replaced: dict[int, torch.nn.Module | None] = {}
    unknown: set[str] = set()
    edits = []
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is None or isinstance(child, (TilegymHFRMSNorm, _TilegymRMSNorm)):
                continue
            if id(child) not in replaced:
                match = match_module(child, match_copies)
                replaced[id(child)] = match and replacement(child, match, backend)
                if replaced[id(child)] is None and "RMSNorm" in type(child).__name__:
                    reason = why_left_alone(child) if match is None else "its eps is not a real number"
                    unknown.add(f"{type(child).__name__} ({reason})")
            if replaced[id(child)] is not None:
                edits.append((parent, name, replaced[id(child)]))
    for parent, name, new in edits:
        parent._modules[name] = new
    if unknown:
        warnings.warn(
            f"tilegym_rms.apply_to_model left these RMSNorm classes alone: {', '.join(sorted(unknown))}",
            stacklevel=2,
        )
    return len({id(new) for _, _, new in edits})
