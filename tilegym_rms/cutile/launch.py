"""The one place that launches cuTile kernels, and the per-device facts launches need."""

from __future__ import annotations

import functools

import cuda.tile as ct
import torch

from ..experimental import notify_launch


@functools.cache
def num_sms(device_index: int) -> int:
    """SM count of a CUDA device, queried once per process."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _raw_stream(device_index: int):
    """The current stream of a device as the raw handle ``ct.launch`` accepts: a C-level lookup, a
    few microseconds cheaper per launch than building a ``torch.cuda.Stream`` object (PERFORMANCE.md, "Host path")."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def _stream_object(device_index: int):
    return torch.cuda.current_stream(device_index)


_current_stream = _raw_stream if hasattr(torch._C, "_cuda_getCurrentRawStream") else _stream_object
# The calling thread's current CUDA device, as a C-level lookup (torch.cuda.current_device() adds Python work).
_current_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else torch.cuda.current_device


@functools.cache
def with_hints(kernel, hints: tuple[tuple[str, int], ...]):
    """``kernel`` built with compiler ``hints`` (``(name, value)`` pairs such as ``("occupancy", 2)``:
    a separate cuTile variant with its own JIT cache); no hints: the kernel itself."""
    return kernel.replace_hints(**dict(hints)) if hints else kernel


def launch(kernel, grid: tuple[int, ...], args: tuple, device_index: int, hints: tuple = (), built=None) -> None:
    """Launches ``kernel`` (built with ``hints``, see :func:`with_hints`; or ``built``, that variant
    already looked up, as the host's cached launches hold it) on CUDA device ``device_index``, the
    device of its tensors whatever device is current, on that device's current stream; warns once if the
    kernel is experimental. Tensor arguments must not require grad (cuTile exports them through DLPack,
    which refuses such tensors and falls back to a slow path): callers detach them once."""
    notify_launch(kernel, "cuda")
    built = built if built is not None else with_hints(kernel, hints)
    if device_index == _current_device():  # the common case costs one C call and a compare
        ct.launch(_current_stream(device_index), grid, built, args)
        return
    # cuTile launches in the thread's current CUDA context: tensors on another device (layers spread over
    # GPUs in one process, a second model on another card) are launched with their device made current, or
    # the kernel reads their memory from the wrong context (an illegal memory access).
    with torch.cuda.device(device_index):
        ct.launch(_current_stream(device_index), grid, built, args)
