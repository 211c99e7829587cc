"""The one place that launches cuTile kernels, and the per-device facts launches need."""

from __future__ import annotations

import functools

import torch

from ..experimental import notify_launch


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """SM count of a CUDA device, queried once per process."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(kernel, grid: tuple[int, ...], args: tuple, device: torch.device) -> None:
    """Launches ``kernel`` on the current stream of ``device``; warns once if it is experimental."""
    import cuda.tile as ct

    notify_launch(kernel, "cuda")
    ct.launch(torch.cuda.current_stream(device), grid, kernel, args)
