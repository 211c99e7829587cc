"""What the host modules share: the kernels module (imported on first use: it needs triton) and the input
checks."""

from __future__ import annotations

from tilegym_rms._checks import KERNEL_DTYPES
from tilegym_rms.reference import CASTING_MODES


def load_kernels():
    # Deferred: importing triton (and jitting the kernels) only when a kernel is about to run.
    from tilegym_rms.triton import kernels

    return kernels


def dense_rows(t) -> bool:
    """Unit column stride, or a single column (whose stride is never used, and which torch calls
    contiguous whatever it is)."""
    return t.stride(1) == 1 or t.shape[1] <= 1


def check_inputs(x, weight, casting_mode) -> None:
    if x.dim() != 2 or not dense_rows(x):
        raise ValueError(f"x must be 2-D with unit column stride, got shape {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"x dtype must be one of {KERNEL_DTYPES}, got {x.dtype}")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
    if weight is not None and (weight.shape != (x.shape[1],) or not weight.is_contiguous()):
        raise ValueError(f"weight must be a contiguous ({x.shape[1]},) tensor, got shape {tuple(weight.shape)}")
