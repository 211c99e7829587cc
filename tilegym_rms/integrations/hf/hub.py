"""The HF ``kernels`` package: :func:`kernelize_model` with a layer it loads from this package, not the Hub.

``kernels.kernelize`` gets :class:`TilegymKernelsRepository`, a local layer repository: nothing is
fetched or built. It needs ``pip install kernels``; :func:`kernels_mapping` gives the mapping for callers
of ``kernelize``.
"""

from __future__ import annotations

import dataclasses

import torch

from .kinds import NormKind, hf_rms_norm
from .recognize import kind_of, require_transformers

KERNELS_LAYER_NAME = "RMSNorm"  # the name transformers gives its RMSNorm classes (use_kernel_forward_from_hub)
_KERNELS_KINDS: dict[type, NormKind | None] = {}  # filled eagerly, read under torch.compile


def _kernels_kind(cls):
    if cls not in _KERNELS_KINDS:
        _KERNELS_KINDS[cls] = kind_of(cls)
    return _KERNELS_KINDS[cls]


def _kernels_layer_forward(module, hidden_states):
    cls = type(module)
    kind = _kernels_kind(cls)
    if kind is None:
        # "RMSNorm" also tags classes of formulas we do not know: their own forward is still the class's
        # (kernelize replaces the instance's).
        return cls.forward(module, hidden_states)
    return hf_rms_norm(hidden_states, module.weight, getattr(module, kind.eps_attr), kind, None)


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
    require_transformers()
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
