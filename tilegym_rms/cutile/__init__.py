"""cuTile backend: the kernels of :mod:`.kernels`, tuned by :mod:`.config` and :mod:`.tuning`, launched by the
host modules of :mod:`.host` through :mod:`.launch`.

This module is the backend contract of :mod:`tilegym_rms.dispatch` (with the fused residual add, its one-pass
backward, QK-norm, the gated norm, the FP8 output and the workspace size) and says where the kernels can run.
``cuda.tile`` is imported
lazily so that this package imports anywhere.
"""

from __future__ import annotations

import functools

import torch

from .._checks import KERNEL_DTYPES
from . import config
from .host import backward as _backward_host
from .host import forward as _forward_host
from .host import fp8 as _fp8_host
from .host import gated as _gated_host
from .host import qk as _qk_host
from .host.backward import backward, backward_workspace_bytes, fused_add_backward
from .host.common import device_index as _device_index
from .host.forward import forward, forward_config, fused_add_forward
from .host.fp8 import FP8_MAX_N, fp8_forward
from .host.gated import gated_backward, gated_forward
from .host.qk import qk_backward, qk_forward

# Compute capabilities that tileiras targets: 8.x, 9.0, 10.x and 12.x.
SUPPORTED_CC_MAJORS = (8, 10, 12)
SUPPORTED_CC_EXACT = ((9, 0),)
SUPPORTED_DTYPES = KERNEL_DTYPES
FORWARD_KERNELS = config.FORWARD_KERNELS
# The kernels add in fp32 and round to the residual's dtype, whatever x's (an fp32 residual stream).
FUSED_ADD_MIXED_DTYPES = True


@functools.cache
def _toolchain_status() -> tuple[bool, str]:
    try:
        import cuda.tile  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return False, f"cuda.tile is not importable ({exc}); pip install 'tilegym_rms[cuda]'"
    try:
        from cuda.tile._compile import _find_compiler_bin

        _find_compiler_bin()
    except Exception as exc:
        return False, f"the tileiras compiler was not found ({exc})"
    return True, ""


def cc_supported(cc: tuple[int, int]) -> bool:
    return cc[0] in SUPPORTED_CC_MAJORS or tuple(cc) in SUPPORTED_CC_EXACT


# The first compute capability with fp8 types: tileiras refuses float8 on sm_80 ("float8_e4m3fn is not supported
# on sm_80"), so Ampere cards quantize after the norm (ops/fp8.py's unfused path).
FP8_MIN_CC = (8, 9)


def fp8_cc_supported(cc: tuple[int, int]) -> bool:
    return tuple(cc) >= FP8_MIN_CC


def fp8_runs_on(device: torch.device) -> bool:
    """Whether the one-pass FP8 kernel compiles for ``device`` (:data:`FP8_MIN_CC`)."""
    return _fp8_device_ok(_device_index(device))


@functools.cache
def _fp8_device_ok(device_index: int) -> bool:  # once per device: a call's host time is its latency at small M
    return fp8_cc_supported(torch.cuda.get_device_capability(device_index))


@functools.cache
def _device_status(device_index: int) -> tuple[bool, str]:
    cc = torch.cuda.get_device_capability(device_index)
    if not cc_supported(cc):
        return False, f"compute capability {cc[0]}.{cc[1]} is not a tileiras target (8.x, 9.0, 10.x, 12.x)"
    return _toolchain_status()


def available(device: torch.device) -> tuple[bool, str]:
    """Whether the cuTile kernels can run on ``device``, and if not, why."""
    if device.type != "cuda":
        return False, f"cuTile runs on CUDA devices, not {device.type}"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is available"
    return _device_status(_device_index(device))


def clear_caches() -> None:
    """Forget the cached configurations and launches (after a tuning script changed :mod:`.config`)."""
    for cache in (*_forward_host.CACHES, *_backward_host.CACHES, *_qk_host.CACHES, *_gated_host.CACHES,
                  *_fp8_host.CACHES):  # fmt: skip
        cache.cache_clear()


__all__ = [
    "FORWARD_KERNELS",
    "FP8_MAX_N",
    "FUSED_ADD_MIXED_DTYPES",
    "SUPPORTED_DTYPES",
    "available",
    "backward",
    "backward_workspace_bytes",
    "cc_supported",
    "clear_caches",
    "forward",
    "forward_config",
    "fp8_cc_supported",
    "fp8_forward",
    "fp8_runs_on",
    "fused_add_backward",
    "fused_add_forward",
    "gated_backward",
    "gated_forward",
    "qk_backward",
    "qk_forward",
]
