"""The single launch helper of the Ascend backend.

Every kernel launch of :mod:`tilegym_rms.triton` goes through :func:`launch`, so that the
experimental-kernel notice (:func:`tilegym_rms.experimental.notify_launch`) can never be bypassed, and
every launch runs on the device of its tensors.
"""

from __future__ import annotations

import torch

from tilegym_rms.experimental import notify_launch

# Device types whose torch module has current_device() and a device() context (Triton launches on the current one).
_ACCELERATORS = ("cuda", "npu")


def _device_of(args) -> torch.device | None:
    """The device of the first tensor argument (the kernels never mix devices: the public API checks it)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return None


def launch(kernel, grid, *args, **constexprs):
    """Launch ``kernel[grid](*args, **constexprs)`` after notifying the experimental-kernel registry.

    ``grid`` is a tuple of program counts; ``constexprs`` are the kernel's compile-time arguments.
    Only kernel arguments are accepted: no ``num_warps``/``num_stages`` (triton-ascend rejects them).

    Triton launches on the current device and its current stream: a CUDA tensor on another device is
    launched with its device made current (what a model spread over GPUs needs); likewise an NPU tensor.
    """
    device = _device_of(args)
    notify_launch(kernel, device.type if device is not None else None)
    if device is not None and device.type in _ACCELERATORS:
        accelerator = getattr(torch, device.type)  # torch.cuda, or torch.npu (torch_npu)
        if device.index != accelerator.current_device():
            with accelerator.device(device):
                return kernel[grid](*args, **constexprs)
    return kernel[grid](*args, **constexprs)
