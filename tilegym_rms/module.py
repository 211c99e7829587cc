"""``RMSNorm``: a drop-in ``torch.nn.RMSNorm`` whose forward runs :func:`tilegym_rms.rms_norm`."""

from __future__ import annotations

import math

import torch

from . import _checks
from .dispatch import check_backend_name
from .ops import rms_norm
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
