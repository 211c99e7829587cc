"""The ``"torch"`` backend: :mod:`tilegym_rms.reference` behind the backend contract."""

from __future__ import annotations

import torch

from . import reference
from ._checks import KERNEL_DTYPES

SUPPORTED_DTYPES = (*KERNEL_DTYPES, torch.float64)
FORWARD_KERNELS = ()  # one code path: no kernel to choose


def available(device: torch.device) -> tuple[bool, str]:
    return True, ""


def forward(x, weight, eps, offset, casting_mode, *, store_rstd=True, kernel=None):
    del store_rstd, kernel  # the reference always returns rstd and has one code path
    return reference.rms_norm_forward(x, weight, eps, offset, casting_mode)


def backward(x, dy, weight, rstd, offset, casting_mode):
    return reference.rms_norm_backward(x, dy, weight, rstd, offset, casting_mode)


FUSED_ADD_MIXED_DTYPES = True  # the reference's rule (fused_add_sum)


def fused_add_forward(x, residual, weight, eps, offset, casting_mode, *, mode, store_rstd=True, residual_out=None,
                      kernel=None):  # fmt: skip
    del store_rstd, kernel  # as in forward
    y, s, rstd = reference.fused_add_rms_norm_forward(x, residual, weight, eps, mode, offset, casting_mode)
    if mode == "pre" and residual_out is not None:
        s = residual_out.copy_(s)
    return y, s, rstd


def fused_add_backward(s, dy, dres, weight, rstd, offset, casting_mode):
    ds, dw = reference.rms_norm_backward(s, dy, weight, rstd, offset, casting_mode)
    return ds + dres, dw


def backward_workspace_bytes(m, n, dtype, device):
    return 0
