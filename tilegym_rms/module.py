"""``RMSNorm``: a drop-in ``torch.nn.RMSNorm`` whose forward runs :func:`tilegym_rms.rms_norm`; ``GatedRMSNorm``,
the gated norm of hybrid models, whose forward runs :func:`tilegym_rms.gated_rms_norm`."""

from __future__ import annotations

import math

import torch

from . import _checks
from .dispatch import check_backend_name
from .ops import gated_rms_norm, rms_norm
from .reference import DEFAULT_CASTING_MODE


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with tilegym_rms kernels.

    Same constructor as ``torch.nn.RMSNorm`` plus ``offset`` (added to the weight: Gemma uses 1.0),
    ``casting_mode`` (``"torch"``, the default, rounds as ``torch.nn.RMSNorm`` does; ``"llama"``,
    ``"gemma"``, ``"none"``) and ``backend`` (None chooses). A multi-dim ``normalized_shape``
    normalizes over the trailing dims together, as torch does.

    ``eps=None`` means the machine epsilon of the dtype torch computes in: fp32's for fp32, fp16 and
    bf16 inputs, fp64's for fp64 (what ``torch.nn.RMSNorm`` does, whatever its docstring says).

    The weight starts at ``1 - offset``, so that a fresh norm scales by ``offset + weight = 1``
    (zeros for Gemma's ``offset=1``, as Hugging Face's Gemma initializes it).
    """

    def __init__(
        self,
        normalized_shape,
        eps=None,
        elementwise_affine=True,
        device=None,
        dtype=None,
        *,
        offset=0.0,
        casting_mode=DEFAULT_CASTING_MODE,
        backend=None,
    ):
        # Checked here, not at the first call: a norm built wrong fails where it is built.
        offset = _checks.check_offset(offset)
        if offset != 0 and not elementwise_affine:
            raise ValueError("offset is added to the weight: it needs elementwise_affine=True")
        eps = None if eps is None else _checks.check_eps(eps)
        _checks.check_casting_mode(casting_mode)
        if backend is not None:
            check_backend_name(backend)
        self.offset = offset  # before super().__init__, which calls reset_parameters
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype)
        self.casting_mode = casting_mode
        self.backend = backend

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - dims :]) != tuple(self.normalized_shape):
            raise ValueError(f"expected input with trailing shape {tuple(self.normalized_shape)}, got {tuple(x.shape)}")
        weight = self.weight.reshape(-1) if self.weight is not None else None
        flat = x.reshape(*x.shape[: x.dim() - dims], math.prod(self.normalized_shape)) if dims > 1 else x
        y = rms_norm(flat, weight, self.eps, offset=self.offset, casting_mode=self.casting_mode, backend=self.backend)
        return y.view(x.shape) if dims > 1 else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, offset={self.offset}, casting_mode={self.casting_mode!r}"


class GatedRMSNorm(torch.nn.Module):
    """The gated RMSNorm of hybrid models as a module: ``forward(x, z)`` runs :func:`tilegym_rms.gated_rms_norm`.

    ``hidden_size`` is the normalized last dim; ``group_size``, ``norm_before_gate``, ``offset``,
    ``casting_mode``, ``activation`` and ``backend`` as in that function; ``eps=None`` is torch's default, as in
    :class:`RMSNorm`. The weight (``(hidden_size,)``, without
    it when ``elementwise_affine=False``) starts at ``1 - offset``, so that a fresh norm scales by 1.
    """

    def __init__(
        self,
        hidden_size,
        eps=1e-6,
        *,
        group_size=None,
        norm_before_gate=True,
        elementwise_affine=True,
        offset=0.0,
        casting_mode=DEFAULT_CASTING_MODE,
        activation="silu",
        backend=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 0:
            raise ValueError(f"hidden_size must be a non-negative int, got {hidden_size!r}")
        _checks.check_group_size(group_size, hidden_size)
        if not isinstance(norm_before_gate, bool):
            raise TypeError(f"norm_before_gate must be True or False, got {type(norm_before_gate).__name__}")
        offset = _checks.check_offset(offset)
        if offset != 0 and not elementwise_affine:
            raise ValueError("offset is added to the weight: it needs elementwise_affine=True")
        _checks.check_casting_mode(casting_mode)
        _checks.check_activation(activation)
        if backend is not None:
            check_backend_name(backend)
        eps = None if eps is None else _checks.check_eps(eps)  # None: torch's default, as in RMSNorm
        self.hidden_size, self.eps, self.group_size = hidden_size, eps, group_size
        self.norm_before_gate, self.offset = norm_before_gate, offset
        self.casting_mode, self.activation, self.backend = casting_mode, activation, backend
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(
            x, z, self.weight, self.eps, group_size=self.group_size, norm_before_gate=self.norm_before_gate,
            offset=self.offset, casting_mode=self.casting_mode, activation=self.activation, backend=self.backend,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
            f"norm_before_gate={self.norm_before_gate}, offset={self.offset}, casting_mode={self.casting_mode!r}, "
            f"activation={self.activation!r}"
        )
