import contextlib
import faulthandler
import os
import sys

import pytest
import torch

from tilegym_rms import dispatch
from tilegym_rms.testing import chunked_errors, rel_err, strided  # noqa: F401  (the tests import them from here)


def pytest_collection_modifyitems(config, items):
    # The exhaustive compile check (every cuTile variant for every arch, about 20 minutes on two cores) runs
    # only when asked for by its marker, so that a plain `pytest` finishes in minutes; CI runs it apart.
    if "exhaustive" not in (config.getoption("markexpr") or ""):
        skip = pytest.mark.skip(reason="the exhaustive compile check: pytest -m exhaustive")
        for item in items:
            if "exhaustive" in item.keywords:
                item.add_marker(skip)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    """Each test sees the environment it sets: no backend choice cached from an earlier test."""
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    dispatch._clear_cache()
    yield
    dispatch._clear_cache()


# ------------------------------------------------------------------------------------------------
# GPU memory when several pytest processes share a GPU (pytest-xdist: ``pytest -m gpu -n 4``)
# ------------------------------------------------------------------------------------------------

try:
    import fcntl
except ImportError:  # not POSIX: no turns, the big tests simply run
    fcntl = None

# Shapes of at least this many elements are "big" in the GPU tests: their tensors (input, output,
# gradients and the float64 reference) need a few GB or more.
BIG_GPU_ELEMS = 1 << 27


# A GPU test that hangs (a kernel that never finishes) would stall the whole run. After this many seconds in one
# test (waiting for a big test's turn excluded) its process prints every thread's stack and exits: pytest-xdist then
# reports that test as failed ("worker crashed") and goes on with a fresh worker; a run without -n stops there.
HANG_SECONDS_ENV = "TILEGYM_RMS_TEST_HANG_SECONDS"
HANG_SECONDS_DEFAULT = 900.0
_stderr_fd = None  # the terminal's stderr, taken before pytest captures the tests' output


@contextlib.contextmanager
def hang_guard(seconds: float, fd=None):
    """Inside the block, a thread that still runs after ``seconds`` dumps every thread's stack to ``fd`` (stderr
    by default) and ends the process."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=fd if fd is not None else sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_configure(config):
    global _stderr_fd
    config.addinivalue_line(
        "markers",
        "big_gpu_memory: needs many GB of GPU memory; such tests take turns across the processes on one "
        "machine (a file lock), and hand their memory back before the next one starts",
    )
    try:
        _stderr_fd = os.dup(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # a stderr without a descriptor: the guard falls back
        _stderr_fd = None


def _gpu_hang_guard():
    return hang_guard(float(os.environ.get(HANG_SECONDS_ENV, HANG_SECONDS_DEFAULT)), _stderr_fd)


def big_gpu_memory_if(big: bool) -> tuple:
    """Marks for ``pytest.param(..., marks=...)``: ``big_gpu_memory`` where ``big``."""
    return (pytest.mark.big_gpu_memory,) if big else ()


def _release_gpu_memory() -> None:
    # A failed test's frames (kept for post-mortem debugging in sys.last_traceback) hold its tensors.
    import gc
    import traceback

    if getattr(sys, "last_traceback", None) is not None:
        traceback.clear_frames(sys.last_traceback)
    gc.collect()
    torch.cuda.empty_cache()


def _gpu_lock_path() -> str:
    import tempfile

    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", "gpu")
    return os.path.join(tempfile.gettempdir(), f"tilegym_rms-tests-{uuid}.lock")


@pytest.fixture(autouse=True)
def _gpu_memory_turns(request):
    """``big_gpu_memory`` tests hold an exclusive lock on a file (one per GPU) for their whole run, so that
    at most one of them runs on a GPU at a time, whatever the number of xdist workers; each hands its
    memory back (frames, Python garbage, the caching allocator) before letting the next one in. Every GPU
    test returns the allocator's cached blocks afterwards, so that a big test finds the memory free, and runs
    under :func:`hang_guard` once it has its turn."""
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    if request.node.get_closest_marker("big_gpu_memory") is None or fcntl is None:
        with _gpu_hang_guard():
            yield
        torch.cuda.empty_cache()
        return
    with open(_gpu_lock_path(), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            with _gpu_hang_guard():
                yield
        finally:
            _release_gpu_memory()
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


# The split forward's blocks wait for each other: a fault there hangs the launch instead of failing it. A fresh
# process runs it first, on more rows than fit the GPU at once and on 16 chunks, within this many seconds
# (its compiles included), so that such a fault fails these tests rather than stalling the suite.
SPLIT_PROBE_SECONDS = 240
SPLIT_PROBE = """
import torch, tilegym_rms
for m, n in ((20000, 32768), (300, 262144)):
    x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    tilegym_rms.rms_norm_forward(x, torch.ones(n, dtype=x.dtype, device="cuda"), backend="cutile", kernel="split")
torch.cuda.synchronize()
print("finished")
"""


@pytest.fixture(scope="module")
def split_forward_finishes():
    import subprocess
    import sys

    try:
        done = subprocess.run(
            [sys.executable, "-c", SPLIT_PROBE], capture_output=True, text=True, timeout=SPLIT_PROBE_SECONDS
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the split forward did not finish in {SPLIT_PROBE_SECONDS} s: its blocks wait on each other")
    assert done.returncode == 0 and "finished" in done.stdout, done.stderr[-2000:]
