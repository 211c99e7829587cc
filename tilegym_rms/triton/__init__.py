"""RMSNorm backend in Triton for Huawei Ascend NPUs (triton-ascend).

The same kernels run on NVIDIA GPUs under standard Triton and on the CPU under the Triton
interpreter (``TRITON_INTERPRET=1``). Semantics are those of :mod:`tilegym_rms.reference`.

Importing this package never imports triton, torch_npu or triton-ascend: the kernels module is
imported on first use, so :func:`available` can report what is missing instead of failing.

This module is the backend contract of :mod:`tilegym_rms.dispatch` (:class:`~tilegym_rms.dispatch.Backend`,
:class:`~tilegym_rms.dispatch.FusedAddBackend`, :class:`~tilegym_rms.dispatch.GatedBackend`,
:class:`~tilegym_rms.dispatch.WorkspaceBackend`) and says
where the kernels can run. The host modules of :mod:`.host` launch the kernels of :mod:`.kernels` through
:mod:`.launch`, with the paths and tiles that :mod:`.config` chooses.
"""

from __future__ import annotations

import torch

from tilegym_rms._checks import KERNEL_DTYPES
from tilegym_rms.triton import config
from tilegym_rms.triton.config import choose_path, choose_tiles
from tilegym_rms.triton.host.backward import backward, backward_workspace_bytes
from tilegym_rms.triton.host.forward import FUSED_ADD_MIXED_DTYPES as FUSED_ADD_MIXED_DTYPES
from tilegym_rms.triton.host.forward import forward, fused_add_forward
from tilegym_rms.triton.host.gated import gated_backward, gated_forward

__all__ = [
    "FORWARD_KERNELS",
    "SUPPORTED_DTYPES",
    "backward_workspace_bytes",
    "available",
    "backward",
    "choose_path",
    "choose_tiles",
    "forward",
    "fused_add_forward",
    "gated_backward",
    "gated_forward",
]

SUPPORTED_DTYPES = KERNEL_DTYPES
FORWARD_KERNELS = config.PATHS
_TRITON_INSTALL_HINT = "triton is not installed: pip install 'tilegym_rms[triton]' (NVIDIA GPUs, CPU interpreter)"
_NPU_INSTALL_HINT = "torch_npu / triton-ascend not installed: pip install 'tilegym_rms[ascend]'"


def available(device) -> tuple[bool, str]:
    """Whether this backend can run on ``device``, and if not, why."""
    device = torch.device(device)
    try:
        import triton
    except ImportError:
        return False, _TRITON_INSTALL_HINT
    if device.type == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return False, _NPU_INSTALL_HINT
        try:
            backend = triton.runtime.driver.active.get_current_target().backend
        except (
            AttributeError,
            RuntimeError,
        ) as exc:  # no active driver, or not the Ascend backend's
            return False, f"{_NPU_INSTALL_HINT} (no active Triton NPU driver: {exc})"
        if backend != "npu":
            return (
                False,
                f"{_NPU_INSTALL_HINT} (active Triton backend is {backend!r}, not 'npu')",
            )
        return True, ""
    if config.interpreter_enabled():
        if device.type not in ("cpu", "cuda"):
            return (
                False,
                f"the Triton interpreter does not support device type {device.type!r}",
            )
        try:
            import numpy  # noqa: F401
        except ImportError:
            return (
                False,
                "the Triton interpreter (TRITON_INTERPRET=1) needs numpy: pip install numpy",
            )
        return True, ""
    if device.type == "cpu":
        return False, "CPU needs TRITON_INTERPRET=1"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        return True, ""
    return False, f"unsupported device type {device.type!r}"
