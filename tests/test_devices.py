"""Which device a launch runs on, without a GPU: the launch helpers of both kernel backends with the
driver calls replaced by recorders. The kernels themselves on two GPUs: ``test_multi_gpu.py``."""

import contextlib

import pytest
import torch

cutile_launch = pytest.importorskip("tilegym_rms.cutile.launch", reason="cuda.tile is not installed")


@pytest.fixture
def events(monkeypatch):
    """What happens around a launch, in order: ``("enter", device)``, ``("launch", stream or device)``,
    ``("exit", device)``; device 0 is the current one."""
    log = []

    @contextlib.contextmanager
    def device(index):
        index = torch.device(index).index if not isinstance(index, int) else index
        log.append(("enter", index))
        yield
        log.append(("exit", index))

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return log


class _Kernel:
    """Stands in for a kernel object: notify_launch only looks it up in the experimental registry."""


@pytest.mark.parametrize("device_index, expected", [
    (0, [("launch", "stream of 0")]),
    (1, [("enter", 1), ("launch", "stream of 1"), ("exit", 1)]),
])  # fmt: skip
def test_cutile_launch_runs_on_the_tensors_device_and_its_stream(monkeypatch, events, device_index, expected):
    monkeypatch.setattr(cutile_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(cutile_launch, "_current_stream", lambda index: f"stream of {index}")
    monkeypatch.setattr(cutile_launch.ct, "launch", lambda stream, grid, built, args: events.append(("launch", stream)))
    kernel = _Kernel()
    cutile_launch.launch(kernel, (1,), (), device_index, built=kernel)
    assert events == expected


@pytest.mark.parametrize("device, expected", [
    ("cuda:0", [("launch", "cuda:0")]),
    ("cuda:1", [("enter", 1), ("launch", "cuda:1"), ("exit", 1)]),
    ("cpu", [("launch", "cpu")]),  # the Triton interpreter: no device to make current
])  # fmt: skip
def test_triton_launch_runs_on_the_tensors_device(monkeypatch, events, device, expected):
    from tilegym_rms.triton import launch as triton_launch

    monkeypatch.setattr(triton_launch, "_device_of", lambda args: torch.device(device))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **constexprs: events.append(("launch", device))

    triton_launch.launch(Kernel(), (1,), "an argument")
    assert events == expected


def test_triton_launch_reads_the_device_of_the_first_tensor_argument():
    from tilegym_rms.triton import launch as triton_launch

    assert triton_launch._device_of((3, torch.empty(1, device="meta"), torch.empty(1))) == torch.device("meta")
    assert triton_launch._device_of((3, 4.0)) is None
