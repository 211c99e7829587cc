"""How GPU time is measured.

Primary method (``--timing profiler``): GPU time per call is the sum of the device durations of the kernel,
memcpy and memset activities that ``torch.profiler`` (CUPTI) records, divided by the number of timed calls.
All repetitions of one configuration run inside one profiler session, separated by a tiny marker kernel
(``torch.cuda._sleep``) whose name is calibrated at start-up; the markers themselves are not counted. If the
markers cannot be used, every repetition gets its own profiler session. ``--timing cuda-events`` (also the
automatic fallback when the profiler records no device activity) times each repetition with CUDA events
instead, which includes launch gaps.

Inputs rotate over enough buffer sets that the bytes they read exceed 4x the L2 cache (``traffic.py``), so
data streams from HBM. Also here: the device-to-device copy bandwidth every GB/s is compared with, and the
wall-clock latency of eager calls.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.common import base, traffic


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return base.L2_FALLBACK_BYTES
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    return int(size) if size > 0 else base.L2_FALLBACK_BYTES


def cuda_device(prog: str) -> torch.device | None:
    """The current CUDA device for a GPU-only tool; None, after saying why on stderr, when there is no GPU."""
    if not torch.cuda.is_available():
        print(f"{prog} needs a CUDA GPU", file=sys.stderr)
        return None
    return torch.device("cuda", torch.cuda.current_device())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------------------
# Profiler events
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Activity:
    start_ns: int
    dur_ns: int
    name: str
    kind: str


def kind_from_name(name: str) -> str:
    if name.startswith("Memcpy"):
        return "gpu_memcpy"
    if name.startswith("Memset"):
        return "gpu_memset"
    if "Sync" in name or name.startswith("cuda") or name.startswith("ProfilerStep"):
        return "other"
    return "kernel"


def profiled(body: Callable[[], None], device: torch.device | None = None, cpu: bool = True):
    """The finished ``torch.profiler.profile`` of ``body`` (CUDA activities, and CPU ones unless ``cpu`` is
    False). It synchronizes before the profile closes: kernels still running would not be recorded."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cpu else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        body()
        torch.cuda.synchronize(device)
    return prof


def device_activities(prof, device_type, kinds: tuple[str, ...] = base.DEVICE_KINDS) -> list[Activity]:
    """Activities of ``device_type`` and of the given kinds that a finished ``torch.profiler.profile`` recorded,
    sorted by start. Reads the raw kineto events (``prof.profiler.kineto_results``), else ``prof.events()``."""
    out: list[Activity] = []
    raw = None
    try:
        raw = prof.profiler.kineto_results.events()
    except AttributeError:
        raw = None
    if raw is not None:
        for e in raw:
            if e.device_type() != device_type:
                continue
            kind = e.activity_type() if hasattr(e, "activity_type") else kind_from_name(e.name())
            if kind in kinds:
                out.append(Activity(int(e.start_ns()), int(e.duration_ns()), e.name(), kind))
    else:
        for e in prof.events():
            if e.device_type != device_type:
                continue
            kind = getattr(e, "activity_type", None) or kind_from_name(e.name)
            if kind in kinds:
                start = int(round(e.time_range.start * 1000))
                end = int(round(e.time_range.end * 1000))
                out.append(Activity(start, end - start, e.name, kind))
    out.sort(key=lambda a: a.start_ns)
    return out


def split_by_markers(events: list[Activity], marker: str, reps: int) -> list[list[Activity]] | None:
    """Split start-sorted activities at the marker kernels: ``reps + 1`` markers bracket ``reps`` segments.
    Returns None when the markers are not exactly there (the caller then falls back)."""
    idx = [i for i, e in enumerate(events) if e.name == marker]
    if len(idx) != reps + 1:
        return None
    return [events[a + 1 : b] for a, b in zip(idx, idx[1:], strict=False)]


# --------------------------------------------------------------------------------------------------------------
# Timer
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    us: list[float]  # per-call time of each repetition
    kernels_per_call: float = float("nan")
    method: str = ""


class Timer:
    """Times ``run_pass`` (``calls`` provider calls) ``reps`` times; see the module doc for the methods."""

    def __init__(self, device: torch.device, method: str):
        self.device = device
        self.method = method if device.type == "cuda" else "wall"
        self.marker: str | None = None

    def _profile(self, body: Callable[[], None]) -> list[Activity]:
        return device_activities(profiled(body, self.device), torch.autograd.DeviceType.CUDA)

    def calibrate(self) -> str:
        """Learn the marker kernel's name; returns a line describing the outcome."""
        if self.method != "profiler":
            return f"timing: {base.METHOD_TEXT[self.method]}"
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is None:
            return "timing: profiler, one session per repetition (torch.cuda._sleep missing)"
        try:
            sleep(base.MARKER_CYCLES)  # load the kernel outside the profile
            torch.cuda.synchronize(self.device)
            for _ in range(3):  # the first session may come up empty while CUPTI initializes
                events = self._profile(lambda: sleep(base.MARKER_CYCLES))
                if events:
                    break
        except Exception as exc:  # noqa: BLE001 - any failure just disables the markers
            return f"timing: profiler, one session per repetition (marker failed: {base.short_error(exc)})"
        if len(events) == 1:
            self.marker = events[0].name
            return f"timing: {base.METHOD_TEXT['profiler']}; repetitions split by marker kernel {self.marker!r}"
        if not events:
            self.method = "cuda-events"
            return "timing: the profiler recorded NO device activity; falling back to CUDA events"
        return f"timing: profiler, one session per repetition (marker gave {len(events)} events)"

    def time_reps(self, run_pass: Callable[[], None], reps: int, calls: int) -> Timing:
        if self.method == "wall":
            us = wall_latency_us(run_pass, self.device, 1, reps)
            return Timing([u / calls for u in us], float("nan"), "wall")
        if self.method == "cuda-events":
            return self._events(run_pass, reps, calls)
        t = None
        if self.marker is not None:
            t = self._profiler_markers(run_pass, reps, calls)
        if t is None:
            t = self._profiler_sessions(run_pass, reps, calls)
        if t is None:  # a repetition without any device activity: not measurable by the profiler
            t = self._events(run_pass, reps, calls)
            t.method = "cuda-events (profiler saw nothing)"
        return t

    def _from_segments(self, segments: list[list[Activity]], calls: int) -> Timing | None:
        if any(not seg for seg in segments):
            return None
        us = [sum(a.dur_ns for a in seg) / 1000.0 / calls for seg in segments]
        kpc = sum(len(seg) for seg in segments) / len(segments) / calls
        return Timing(us, kpc, "profiler")

    def _profiler_markers(self, run_pass, reps, calls) -> Timing | None:
        sleep = torch.cuda._sleep

        def body():
            sleep(base.MARKER_CYCLES)
            for _ in range(reps):
                run_pass()
                sleep(base.MARKER_CYCLES)

        segments = split_by_markers(self._profile(body), self.marker, reps)
        return None if segments is None else self._from_segments(segments, calls)

    def _profiler_sessions(self, run_pass, reps, calls) -> Timing | None:
        segments = [self._profile(run_pass) for _ in range(reps)]
        return self._from_segments(segments, calls)

    def _events(self, run_pass, reps, calls) -> Timing:
        us = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            run_pass()
            end.record()
            end.synchronize()
            us.append(start.elapsed_time(end) * 1000.0 / calls)
        return Timing(us, float("nan"), "cuda-events")


def wall_latency_us(call: Callable[[], object], device: torch.device, calls: int, reps: int) -> list[float]:
    """Host+device wall time per eager call: ``calls`` back-to-back calls then one sync, per repetition."""
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    return out


def copy_bandwidth(timer: Timer, device: torch.device, nbytes: int, reps: int) -> tuple[list[float], str]:
    """GB/s (bytes read + written) of each of ``reps`` timed ``dst.copy_(src)`` of ``nbytes``, and the method
    that timed them (the timer's own, unless the profiler saw nothing)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t = timer.time_reps(lambda: dst.copy_(src), reps, 1)
    return [traffic.gbps(2 * nbytes, u) for u in t.us], t.method
