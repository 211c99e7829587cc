"""The single launch helper of the Ascend backend.

Every kernel launch of :mod:`tilegym_rms.triton` goes through :func:`launch`, so that the
experimental-kernel notice (:func:`tilegym_rms.experimental.notify_launch`) can never be bypassed.
"""

from __future__ import annotations

import torch

from tilegym_rms.experimental import notify_launch


def _device_type(args) -> str | None:
    """The device type of the first tensor argument (the kernels never mix devices)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
    return None


def launch(kernel, grid, *args, **constexprs):
    """Launch ``kernel[grid](*args, **constexprs)`` after notifying the experimental-kernel registry.

    ``grid`` is a tuple of program counts; ``constexprs`` are the kernel's compile-time arguments.
    Only kernel arguments are accepted: no ``num_warps``/``num_stages`` (triton-ascend rejects them).
    """
    notify_launch(kernel, _device_type(args))
    return kernel[grid](*args, **constexprs)
