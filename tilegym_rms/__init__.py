"""tilegym_rms: RMSNorm kernels for PyTorch training and inference.

cuTile kernels on NVIDIA GPUs, Triton kernels for Ascend NPUs (also run on NVIDIA under standard
Triton), and a pure-torch reference on the CPU, all behind :func:`rms_norm`.
"""

from .batch_invariance import BatchInvarianceWarning, batch_invariant, is_batch_invariant, set_batch_invariant
from .dispatch import BACKENDS, available_backends
from .experimental import ExperimentalKernelWarning, experimental_kernel
from .module import GatedRMSNorm, RMSNorm
from .ops import (
    QKRMSNormFunction,
    RMSNormFunction,
    backward_workspace_bytes,
    fused_add_rms_norm,
    fused_add_rms_norm_,
    fused_add_rms_norm_fp8,
    gated_rms_norm,
    qk_rms_norm,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_fp8,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BatchInvarianceWarning",
    "ExperimentalKernelWarning",
    "GatedRMSNorm",
    "QKRMSNormFunction",
    "RMSNorm",
    "RMSNormFunction",
    "available_backends",
    "backward_workspace_bytes",
    "batch_invariant",
    "experimental_kernel",
    "fused_add_rms_norm",
    "fused_add_rms_norm_",
    "gated_rms_norm",
    "fused_add_rms_norm_fp8",
    "is_batch_invariant",
    "qk_rms_norm",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "rms_norm_fp8",
    "set_batch_invariant",
    "__version__",
]
