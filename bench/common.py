"""Shared machinery of the tilegym_rms benchmark scripts (``bench_rmsnorm.py``, ``bench_rmsnorm_backward.py``).

Timing (primary method, ``--timing profiler``): GPU time per call is the sum of the device durations of the
kernel, memcpy and memset activities that ``torch.profiler`` (CUPTI) records, divided by the number of timed
calls. All repetitions of one configuration run inside one profiler session, separated by a tiny marker kernel
(``torch.cuda._sleep``) whose name is calibrated at start-up; the markers themselves are not counted. If the
markers cannot be used, every repetition gets its own profiler session. ``--timing cuda-events`` (also the
automatic fallback when the profiler records no device activity) times each repetition with CUDA events
instead, which includes launch gaps.

Inputs rotate over enough buffer sets that the bytes they read exceed 4x the L2 cache, so data streams from HBM.
The first run of each provider and shape (which also compiles) is checked against a float64 reference.

``TILEGYM_RMS_BENCH_CPU=1`` runs the whole pipeline on the CPU with wall-clock timing; it exists only to test
the scripts themselves, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-2, "fp32": 1e-4}

GRID_M = (4096, 32768)
GRID_N = (1024, 2048, 4096, 5120, 7168, 8192, 16384)
QUICK_M = (4096,)
QUICK_N = (2048, 8192)

EPS = 1e-6
L2_FALLBACK_BYTES = 50 * 2**20
L2_FACTOR = 4
MAX_SETS = 512  # tiny shapes: more sets would only add Python calls; flagged when it caps
MIN_CALLS_PER_PASS = 4
COPY_BYTES = 2**30
DEFAULT_REPS = 20
QUICK_REPS = 10
MARKER_CYCLES = 1000
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_ENV = "TILEGYM_RMS_BENCH_CPU"

PROVIDERS_ALL = (
    "tilegym_rms-cutile",
    "tilegym_rms-triton",
    "tilegym_rms-torch",
    "torch",
    "torch.compile",
    "liger",
    "tilegym",
)
PROVIDERS_DEFAULT = ("tilegym_rms-cutile", "tilegym_rms-triton", "torch", "torch.compile", "liger", "tilegym")

METHOD_TEXT = {
    "profiler": "sum of device kernel+memcpy+memset durations (torch.profiler/CUPTI) per call",
    "cuda-events": "CUDA-event elapsed time per repetition / calls (includes launch gaps)",
    "wall": "host wall clock (CPU test mode; meaningless numbers)",
}


def log(msg: str) -> None:
    """A progress line, flushed, on stderr."""
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------------
# Argument parsing
# --------------------------------------------------------------------------------------------------------------


def csv_list(kind: Callable[[str], object]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        try:
            return [kind(t) for t in items]
        except (ValueError, KeyError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse


def parse_dtype(name: str) -> str:
    name = name.lower()
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return name


def parse_provider(name: str) -> str:
    if name not in PROVIDERS_ALL:
        raise ValueError(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS_ALL)}")
    return name


def choice_list(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(name: str) -> str:
        if name not in choices:
            raise ValueError(f"unknown mode {name!r}; choose from {', '.join(choices)}")
        return name

    return parse


def script_parser(prog: str, description: str, epilog: str, modes: tuple[str, ...], default, mode_help: str):
    """The argument parser both scripts start from: their help text, ``--mode`` over ``modes``."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", type=csv_list(choice_list(modes)), default=default, help=mode_help)
    return parser


def add_common_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("common options")
    g.add_argument(
        "--dtype",
        type=csv_list(parse_dtype),
        default=None,
        help="comma list of dtypes among bf16,fp16,fp32 (default: bf16,fp16,fp32 for the M x N grid)",
    )
    g.add_argument("--M", type=csv_list(int), default=None, help=f"comma list of row counts (default {GRID_M})")
    g.add_argument("--N", type=csv_list(int), default=None, help=f"comma list of hidden sizes (default {GRID_N})")
    g.add_argument(
        "--providers",
        type=csv_list(parse_provider),
        default=None,
        help=f"comma list among {', '.join(PROVIDERS_ALL)} (default: {', '.join(PROVIDERS_DEFAULT)}); "
        "unavailable ones are skipped with the reason printed",
    )
    g.add_argument("--reps", type=int, default=None, help=f"timed repetitions, >= 10 advised (default {DEFAULT_REPS})")
    g.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: M={QUICK_M}, N={QUICK_N}, bf16, {QUICK_REPS} reps, results under <out>/quick",
    )
    g.add_argument(
        "--timing",
        choices=("profiler", "cuda-events"),
        default="profiler",
        help="primary timing method (default profiler: sum of kernel durations)",
    )
    g.add_argument("--eps", type=float, default=EPS, help=f"RMSNorm epsilon (default {EPS})")
    g.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    g.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default bench/results/<gpu-slug>/, plus quick/ for --quick); JSON there is merged",
    )
    g.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    g.add_argument("--dry-run", action="store_true", help="print the planned configurations and exit (no GPU needed)")


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick."""
    args.explicit_dtype = args.dtype is not None
    if args.dtype is None:
        args.dtype = ["bf16"] if args.quick else list(DTYPES)
    if args.M is None:
        args.M = list(QUICK_M if args.quick else GRID_M)
    if args.N is None:
        args.N = list(QUICK_N if args.quick else GRID_N)
    if args.reps is None:
        args.reps = QUICK_REPS if args.quick else DEFAULT_REPS
    if args.reps < 1:
        raise SystemExit("--reps must be >= 1")
    if args.providers is None:
        args.providers = list(PROVIDERS_DEFAULT)
        args.explicit_providers = False
    else:
        args.explicit_providers = True
    return args


# --------------------------------------------------------------------------------------------------------------
# Bytes, statistics, rotation
# --------------------------------------------------------------------------------------------------------------


def forward_bytes(m: int, n: int, elt: int, w_elt: int | None = None) -> int:
    """Minimal forward traffic: read x and w, write y."""
    w_elt = elt if w_elt is None else w_elt
    return 2 * m * n * elt + n * w_elt


def backward_bytes(m: int, n: int, elt: int, w_elt: int | None = None) -> int:
    """Minimal backward traffic: read x, dy (M*N), w (N), rstd (M fp32); write dx (M*N), dw (N)."""
    w_elt = elt if w_elt is None else w_elt
    return 3 * m * n * elt + 2 * n * w_elt + 4 * m


def full_bytes(m: int, n: int, elt: int, w_elt: int | None = None) -> int:
    """Forward (plus writing rstd, M fp32) followed by backward."""
    return forward_bytes(m, n, elt, w_elt) + 4 * m + backward_bytes(m, n, elt, w_elt)


def op_bytes(op: str, m: int, n: int, elt: int) -> int:
    if op == "forward":
        return forward_bytes(m, n, elt)
    if op in ("backward", "standalone", "autograd"):
        return backward_bytes(m, n, elt)
    if op == "full":
        return full_bytes(m, n, elt)
    raise ValueError(op)


def read_bytes(op: str, m: int, n: int, elt: int) -> int:
    """Bytes one call reads from its input set (what the rotation has to push out of L2)."""
    if op == "forward":
        return m * n * elt + n * elt
    if op in ("backward", "standalone", "autograd"):
        return 2 * m * n * elt + n * elt + 4 * m
    if op == "full":
        return 2 * m * n * elt + n * elt
    raise ValueError(op)


def workspace_share(minimal: int, workspace: int) -> float:
    """Share of the traffic that the dw partial buffer adds: it is written once and read once."""
    extra = 2 * workspace
    total = minimal + extra
    return extra / total if total else 0.0


def rotation_sets(set_bytes: int, l2_bytes: int, factor: int = L2_FACTOR, cap: int = MAX_SETS) -> tuple[int, bool]:
    """Number of input sets so that their total exceeds factor x L2; and whether ``cap`` cut it short."""
    need = factor * l2_bytes // max(1, set_bytes) + 1
    return (min(need, cap), need > cap)


def calls_per_pass(n_sets: int, minimum: int = MIN_CALLS_PER_PASS) -> int:
    """Calls in one repetition: whole passes over the sets, at least ``minimum`` calls."""
    return n_sets * max(1, math.ceil(minimum / n_sets))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values: list[float]) -> tuple[float, float, float]:
    """(median, 20th percentile, 80th percentile)."""
    return percentile(values, 50), percentile(values, 20), percentile(values, 80)


def gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9 if us > 0 else float("nan")


# --------------------------------------------------------------------------------------------------------------
# Device, naming
# --------------------------------------------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200', 'NVIDIA GH200 480GB' -> 'gh200'."""
    m = re.search(r"(?<![A-Z0-9])([A-Z]{1,2}\d{2,4}[A-Z]?)(?![A-Z0-9])", name.upper())
    if m:
        return m.group(1).lower()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    slug = re.sub(r"^nvidia-", "", slug)
    return slug or "unknown-gpu"


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return L2_FALLBACK_BYTES
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    return int(size) if size > 0 else L2_FALLBACK_BYTES


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_sticky_cuda_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(
        s in text
        for s in ("illegal memory access", "unspecified launch failure", "device-side assert", "illegal instruction")
    )


def short_error(exc: BaseException, limit: int = 160) -> str:
    line = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {line}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def device_activities(prof, device_type, kinds: tuple[str, ...] = DEVICE_KINDS) -> list[Activity]:
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

    # -- profiler plumbing
    def _profile(self, body: Callable[[], None]) -> list[Activity]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            body()
            torch.cuda.synchronize(self.device)
        return device_activities(prof, torch.autograd.DeviceType.CUDA)

    def calibrate(self) -> str:
        """Learn the marker kernel's name; returns a line describing the outcome."""
        if self.method != "profiler":
            return f"timing: {METHOD_TEXT[self.method]}"
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is None:
            return "timing: profiler, one session per repetition (torch.cuda._sleep missing)"
        try:
            sleep(MARKER_CYCLES)  # load the kernel outside the profile
            torch.cuda.synchronize(self.device)
            for _ in range(3):  # the first session may come up empty while CUPTI initializes
                events = self._profile(lambda: sleep(MARKER_CYCLES))
                if events:
                    break
        except Exception as exc:  # noqa: BLE001 - any failure just disables the markers
            return f"timing: profiler, one session per repetition (marker failed: {short_error(exc)})"
        if len(events) == 1:
            self.marker = events[0].name
            return f"timing: {METHOD_TEXT['profiler']}; repetitions split by marker kernel {self.marker!r}"
        if not events:
            self.method = "cuda-events"
            return "timing: the profiler recorded NO device activity; falling back to CUDA events"
        return f"timing: profiler, one session per repetition (marker gave {len(events)} events)"

    def time_reps(self, run_pass: Callable[[], None], reps: int, calls: int) -> Timing:
        if self.method == "wall":
            return self._wall(run_pass, reps, calls)
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
            sleep(MARKER_CYCLES)
            for _ in range(reps):
                run_pass()
                sleep(MARKER_CYCLES)

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

    def _wall(self, run_pass, reps, calls) -> Timing:
        us = []
        for _ in range(reps):
            sync(self.device)
            t0 = time.perf_counter()
            run_pass()
            sync(self.device)
            us.append((time.perf_counter() - t0) * 1e6 / calls)
        return Timing(us, float("nan"), "wall")


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


# --------------------------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Provider:
    name: str
    forward: Callable  # (x, w) -> y, autograd-capable
    standalone_backward: Callable | None = None  # (x, dy, w, rstd) -> (dx, dw)


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm: fp32 math, rounded to the input dtype before the weight product."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def configure_compile() -> None:
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 4096)
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 65536)
    try:
        import torch._functorch.config as fconfig

        fconfig.donated_buffer = False  # backward is replayed with retain_graph
    except (ImportError, AttributeError):
        pass


def import_tilegym_rms():
    """(module or None, version string, error string)."""
    try:
        import tilegym_rms
    except Exception as exc:  # noqa: BLE001 - the package may be mid-edit; report and go on
        return None, "unavailable", short_error(exc)
    return tilegym_rms, str(getattr(tilegym_rms, "__version__", "unknown")), ""


def discover_providers(
    names: list[str], device: torch.device, eps: float, tilegym_rms=None, tilegym_rms_error: str = ""
) -> tuple[list[Provider], dict[str, str]]:
    """The requested providers that can run on ``device``, and a reason for each skipped one."""
    found: list[Provider] = []
    skipped: dict[str, str] = {}
    avail: dict = {}
    if any(n.startswith("tilegym_rms-") for n in names) and tilegym_rms is not None:
        try:
            avail = tilegym_rms.available_backends(device)
        except Exception as exc:  # noqa: BLE001
            tilegym_rms_error = f"available_backends failed: {short_error(exc)}"
            tilegym_rms = None
    for name in names:
        try:
            if name.startswith("tilegym_rms-"):
                backend = name.split("-", 1)[1]
                if tilegym_rms is None:
                    skipped[name] = f"tilegym_rms not importable ({tilegym_rms_error})"
                    continue
                ok, why = avail.get(backend, (False, "not reported by available_backends"))
                if not ok:
                    skipped[name] = why or "not available"
                    continue
                found.append(_tilegym_rms_provider(name, tilegym_rms, backend, eps))
            elif name == "torch":
                n_fn = torch.nn.functional.rms_norm
                found.append(Provider(name, lambda x, w, f=n_fn: f(x, (x.shape[-1],), w, eps)))
            elif name == "torch.compile":
                configure_compile()

                def llama_fixed_eps(x, w):  # eps a closure constant, so the graph specializes on it
                    return llama_rms_norm(x, w, eps)

                compiled = torch.compile(llama_fixed_eps, dynamic=False)
                found.append(Provider(name, compiled))
            elif name == "liger":
                from liger_kernel.ops.rms_norm import LigerRMSNormFunction

                found.append(
                    Provider(name, lambda x, w, f=LigerRMSNormFunction: f.apply(x, w, eps, 0.0, "llama", False))
                )
            elif name == "tilegym":
                # by module path: the package attribute tilegym.ops.cutile.rms_norm is the function, not the module
                tg = importlib.import_module("tilegym.ops.cutile.rms_norm")

                found.append(
                    Provider(
                        name,
                        lambda x, w, f=tg.rms_norm: f(x, (x.shape[-1],), w, eps),
                        standalone_backward=getattr(tg, "rms_norm_backward", None),
                    )
                )
            else:
                skipped[name] = "unknown provider"
        except Exception as exc:  # noqa: BLE001 - an absent or broken peer is skipped, not fatal
            skipped[name] = short_error(exc)
    return found, skipped


def _tilegym_rms_provider(name: str, mod, backend: str, eps: float) -> Provider:
    def forward(x, w):
        return mod.rms_norm(x, w, eps, backend=backend)

    def standalone(x, dy, w, rstd):
        return mod.rms_norm_backward(x, dy, w, rstd, backend=backend)

    return Provider(name, forward, standalone)


# --------------------------------------------------------------------------------------------------------------
# Inputs, calls, correctness
# --------------------------------------------------------------------------------------------------------------


class InputSets:
    """``n`` independent (x, w, dy, rstd) sets of one shape; ``xg``/``wg`` are grad-requiring leaves that share
    the storage of ``x``/``w``."""

    def __init__(self, m: int, n_cols: int, dtype, device, n: int, seed: int, eps: float, need_dy: bool = True):
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        self.n = n
        self.x = [torch.randn(m, n_cols, dtype=dtype, device=device, generator=g) for _ in range(n)]
        self.w = [
            (1.0 + 0.1 * torch.randn(n_cols, dtype=torch.float32, device=device, generator=g)).to(dtype)
            for _ in range(n)
        ]
        self.dy = [torch.randn(m, n_cols, dtype=dtype, device=device, generator=g) for _ in range(n)] if need_dy else []
        self.eps = eps
        self._rstd: list | None = None
        self._xg: list | None = None
        self._wg: list | None = None

    @property
    def rstd(self) -> list[torch.Tensor]:
        if self._rstd is None:
            self._rstd = [torch.rsqrt(x.float().square().mean(-1) + self.eps) for x in self.x]
        return self._rstd

    @property
    def xg(self) -> list[torch.Tensor]:
        if self._xg is None:
            self._xg = [x.detach().requires_grad_(True) for x in self.x]
        return self._xg

    @property
    def wg(self) -> list[torch.Tensor]:
        if self._wg is None:
            self._wg = [w.detach().requires_grad_(True) for w in self.w]
        return self._wg


def build_call(op: str, provider: Provider, sets: InputSets) -> tuple[Callable[[int], dict], str]:
    """``call(i)`` running ``op`` on set ``i`` and returning its outputs by name, and a note on how.

    forward: under no_grad. backward/autograd: the forward graphs of all sets are built here (outside any timed
    region) and ``call`` replays ``torch.autograd.grad(y, (x, w), dy, retain_graph=True)``. standalone: the
    provider's standalone backward, or the autograd backward when it has none. full: forward + autograd.grad.
    """
    if op == "forward":

        def call_fwd(i):
            with torch.no_grad():
                return {"y": provider.forward(sets.x[i], sets.w[i])}

        return call_fwd, ""
    if op == "standalone" and provider.standalone_backward is not None:
        bwd = provider.standalone_backward

        def call_standalone(i):
            dx, dw = bwd(sets.x[i], sets.dy[i], sets.w[i], sets.rstd[i])
            return {"dx": dx, "dw": dw}

        return call_standalone, ""
    if op in ("backward", "autograd", "standalone"):
        ys = [provider.forward(sets.xg[i], sets.wg[i]) for i in range(sets.n)]

        def call_bwd(i):
            dx, dw = torch.autograd.grad(ys[i], (sets.xg[i], sets.wg[i]), sets.dy[i], retain_graph=True)
            return {"dx": dx, "dw": dw}

        return call_bwd, ("autograd backward" if op == "standalone" else "")
    if op == "full":

        def call_full(i):
            y = provider.forward(sets.xg[i], sets.wg[i])
            dx, dw = torch.autograd.grad(y, (sets.xg[i], sets.wg[i]), sets.dy[i])
            return {"y": y, "dx": dx, "dw": dw}

        return call_full, ""
    raise ValueError(f"unknown op {op!r}")


def relative_errors(
    x: torch.Tensor, w: torch.Tensor, eps: float, outputs: dict, dy: torch.Tensor | None = None
) -> dict[str, float]:
    """``||out - ref|| / ||ref||`` for each of y, dx, dw present in ``outputs``; the reference is float64 math,
    computed in row chunks to bound memory."""
    m, n = x.shape
    chunk = max(1, (1 << 25) // n)
    wf = w.detach().double()
    num = {"y": 0.0, "dx": 0.0}
    den = {"y": 0.0, "dx": 0.0}
    dw_ref = torch.zeros(n, dtype=torch.float64, device=x.device)
    need_bwd = "dx" in outputs or "dw" in outputs
    for r0 in range(0, m, chunk):
        r1 = min(m, r0 + chunk)
        xc = x[r0:r1].detach().double()
        rstd = torch.rsqrt(xc.square().mean(-1, keepdim=True) + eps)
        xhat = xc * rstd
        if "y" in outputs:
            ref = xhat * wf
            num["y"] += (outputs["y"][r0:r1].detach().double() - ref).square().sum().item()
            den["y"] += ref.square().sum().item()
        if need_bwd:
            dyc = dy[r0:r1].double()
            g = dyc * wf
            ref = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
            if "dx" in outputs:
                num["dx"] += (outputs["dx"][r0:r1].detach().double() - ref).square().sum().item()
                den["dx"] += ref.square().sum().item()
            dw_ref += (dyc * xhat).sum(0)
    errs = {}
    for k in ("y", "dx"):
        if k in outputs:
            errs[k] = math.sqrt(num[k]) / math.sqrt(den[k]) if den[k] > 0 else math.sqrt(num[k])
    if "dw" in outputs:
        d = outputs["dw"].detach().double().reshape(-1)
        ref_norm = dw_ref.norm().item()
        diff = (d - dw_ref).norm().item()
        errs["dw"] = diff / ref_norm if ref_norm > 0 else diff
    return errs


def check_ok(errs: dict[str, float], dtype_name: str) -> bool:
    tol = TOLERANCE[dtype_name]
    return all(math.isfinite(e) and e <= tol for e in errs.values())


# --------------------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Point:
    """One provider on one configuration."""

    kernel_name: str
    op: str  # kernel_operation_mode
    suite: str
    provider: str
    dtype: str
    m: int
    n: int
    x_name: str
    x_label: str
    x_value: object
    extra: dict
    nbytes: int = 0
    us: list[float] = field(default_factory=list)
    metric: str = "throughput"  # or "latency"
    ok: bool | None = None
    errs: dict = field(default_factory=dict)
    error: str = ""
    note: str = ""
    kernels_per_call: float = float("nan")
    n_sets: int = 0
    capped: bool = False
    method: str = ""

    @property
    def valid(self) -> bool:
        return not self.error and bool(self.us)

    def time_stats(self) -> tuple[float, float, float]:
        return summarize(self.us)

    def gbps_stats(self) -> tuple[float, float, float]:
        return summarize([gbps(self.nbytes, u) for u in self.us])

    @property
    def max_err(self) -> float | None:
        return max(self.errs.values()) if self.errs else None


def extra_str(extra: dict) -> str:
    return json.dumps(extra, sort_keys=True)


def point_values(p: Point) -> dict[str, tuple[str, tuple[float, float, float]]]:
    """metric_name -> (unit, (p50, p20, p80)) for a valid point."""
    if p.metric == "latency":
        return {"latency": ("us", p.time_stats())}
    t50, t20, t80 = p.time_stats()
    return {"throughput": ("GB/s", p.gbps_stats()), "speed": ("ms", (t50 / 1000, t20 / 1000, t80 / 1000))}


def build_records(points: list[Point], meta: dict) -> list[dict]:
    """Liger-format records: one per (kernel, provider, op mode, metric, extra config), x over the points.
    ``meta``: gpu_name, timestamp, tilegym_rms_version, copy_bandwidth_GBps, timing_method."""
    groups: dict[tuple, dict] = {}
    for p in points:
        if not p.valid:
            continue
        for metric, (unit, (y50, y20, y80)) in point_values(p).items():
            key = (p.kernel_name, p.provider, metric, p.op, extra_str(p.extra), p.x_name)
            rec = groups.get(key)
            if rec is None:
                rec = groups[key] = {
                    "kernel_name": p.kernel_name,
                    "kernel_provider": p.provider,
                    "metric_name": metric,
                    "metric_unit": unit,
                    "gpu_name": meta["gpu_name"],
                    "x_name": p.x_name,
                    "x_label": p.x_label,
                    "x_values": [],
                    "y_values_50": [],
                    "y_values_20": [],
                    "y_values_80": [],
                    "timestamp": meta["timestamp"],
                    "kernel_operation_mode": p.op,
                    "extra_benchmark_config_str": extra_str(p.extra),
                    "tilegym_rms_version": meta["tilegym_rms_version"],
                    "copy_bandwidth_GBps": meta.get("copy_bandwidth_GBps"),
                    "timing_method": meta.get("timing_method", ""),
                    "rel_err": [],
                    "mismatch_x_values": [],
                }
            rec["x_values"].append(p.x_value)
            rec["y_values_50"].append(y50)
            rec["y_values_20"].append(y20)
            rec["y_values_80"].append(y80)
            rec["rel_err"].append(p.max_err)
            if p.ok is False:
                rec["mismatch_x_values"].append(p.x_value)
    for rec in groups.values():
        _sort_record(rec)
    return list(groups.values())


def x_sort_key(x) -> tuple:
    if isinstance(x, (int, float)):
        return (0, float(x))
    parts = re.findall(r"\d+", str(x))
    return (1, tuple(int(v) for v in parts), str(x))


def _sort_record(rec: dict) -> None:
    cols = ("x_values", "y_values_50", "y_values_20", "y_values_80", "rel_err")
    rows = sorted(zip(*(rec[c] for c in cols), strict=True), key=lambda r: x_sort_key(r[0]))
    for i, c in enumerate(cols):
        rec[c] = [r[i] for r in rows]


def record_key(rec: dict) -> tuple:
    return (
        rec["kernel_name"],
        rec["kernel_provider"],
        rec["metric_name"],
        rec["kernel_operation_mode"],
        rec["extra_benchmark_config_str"],
        rec["x_name"],
    )


def merge_records(old: list[dict], new: list[dict]) -> list[dict]:
    """Point-wise merge: a new point replaces the old point with the same key and x; other old points stay."""
    merged: dict[tuple, dict] = {record_key(r): r for r in old}
    for rec in new:
        key = record_key(rec)
        prev = merged.get(key)
        if prev is None:
            merged[key] = rec
            continue
        n_prev = len(prev["x_values"])
        prev_err = prev.get("rel_err") or [None] * n_prev
        pts = {
            json.dumps(x): (x, prev["y_values_50"][i], prev["y_values_20"][i], prev["y_values_80"][i], prev_err[i])
            for i, x in enumerate(prev["x_values"])
        }
        bad = {json.dumps(x) for x in prev.get("mismatch_x_values", [])}
        for i, x in enumerate(rec["x_values"]):
            k = json.dumps(x)
            pts[k] = (x, rec["y_values_50"][i], rec["y_values_20"][i], rec["y_values_80"][i], rec["rel_err"][i])
            bad.discard(k)
        bad |= {json.dumps(x) for x in rec.get("mismatch_x_values", [])}
        out = dict(rec)
        rows = sorted(pts.values(), key=lambda r: x_sort_key(r[0]))
        for i, c in enumerate(("x_values", "y_values_50", "y_values_20", "y_values_80", "rel_err")):
            out[c] = [r[i] for r in rows]
        out["mismatch_x_values"] = [r[0] for r in rows if json.dumps(r[0]) in bad]
        merged[key] = out
    return list(merged.values())


def write_json(path: Path, records: list[dict]) -> list[dict]:
    """Merge ``records`` into the JSON list at ``path`` (created if absent); returns the merged list."""
    old: list[dict] = []
    if path.exists():
        try:
            old = json.loads(path.read_text())
            if not isinstance(old, list):
                old = []
        except (OSError, json.JSONDecodeError) as exc:
            log(f"warning: {path} unreadable ({exc}); it will be overwritten")
            old = []
    merged = merge_records(old, records)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(merged, indent=1))
    tmp.replace(path)
    return merged


# --------------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------------


def format_table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Plain-text table; the first ``left`` columns are left-aligned, the others right-aligned."""
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r, strict=False)]

    def fmt(cells):
        pairs = enumerate(zip(cells, widths, strict=False))
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in pairs)

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def cell(p: Point | None, copy_bw: float | None, what: str = "gbps") -> str:
    if p is None:
        return "-"
    if p.error:
        return "ERR"
    if not p.us:
        return "-"
    flag = "!" if p.ok is False else ""
    if what == "us" or p.metric == "latency":
        return f"{p.time_stats()[0]:.1f}{flag}"
    bw = p.gbps_stats()[0]
    pct = f" ({100 * bw / copy_bw:.0f}%)" if copy_bw else ""
    return f"{fmt_num(bw)}{pct}{flag}"


def fmt_num(v: float) -> str:
    """Three significant digits for small numbers, integers from 100 up."""
    if not math.isfinite(v):
        return str(v)
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def row_label(p: Point) -> list[str]:
    return [p.dtype, str(p.m), str(p.n)]


def results_table(points: list[Point], providers: list[str], copy_bw: float | None, what: str = "gbps") -> str:
    """Rows = configurations (in first-seen order), columns = providers."""
    rows: dict[tuple, dict[str, Point]] = {}
    for p in points:
        rows.setdefault((p.dtype, p.m, p.n), {})[p.provider] = p
    cols = [pr for pr in providers if any(pr in r for r in rows.values())]
    body = []
    for (dtype, m, n), by in rows.items():
        body.append([dtype, str(m), str(n)] + [cell(by.get(pr), copy_bw, what) for pr in cols])
    return format_table(["dtype", "M", "N"] + cols, body, left=1)


def mismatch_lines(points: list[Point]) -> list[str]:
    out = []
    for p in points:
        if p.ok is False:
            errs = ", ".join(f"{k}={v:.2e}" for k, v in p.errs.items())
            out.append(f"  ! {p.provider} {p.op} {p.dtype} M={p.m} N={p.n}: {errs} (limit {TOLERANCE[p.dtype]:g})")
        if p.error:
            out.append(f"  ERR {p.provider} {p.op} {p.dtype} M={p.m} N={p.n}: {p.error}")
    return out


# --------------------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------------------


def plot_records(records: list[dict], path: Path, title: str, copy_bw: float | None = None) -> str:
    """One subplot per (op mode, extra config); one line per provider; dashed line at the copy bandwidth for
    GB/s plots. Returns a message (written, or why not)."""
    if not records:
        return f"plot {path.name}: no data"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"plot {path.name} skipped: matplotlib unavailable ({short_error(exc)})"

    panels: dict[tuple, list[dict]] = {}
    for rec in records:
        panels.setdefault((rec["kernel_operation_mode"], rec["extra_benchmark_config_str"]), []).append(rec)
    keys = sorted(panels, key=_panel_sort_key)
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    height = 3.0 * nrows + 0.9
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, height), squeeze=False, dpi=80)
    order = {p: i for i, p in enumerate(PROVIDERS_ALL)}
    providers = sorted({r["kernel_provider"] for r in records}, key=lambda p: (order.get(p, 99), p))
    colors = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    for ax, key in zip(axes.flat, keys, strict=False):
        recs = panels[key]
        xs_all = [x for r in recs for x in r["x_values"]]
        numeric = all(isinstance(x, (int, float)) for x in xs_all)
        cats = sorted({json.dumps(x) for x in xs_all}, key=lambda s: x_sort_key(json.loads(s)))
        for rec in sorted(recs, key=lambda r: providers.index(r["kernel_provider"])):
            xs = rec["x_values"] if numeric else [cats.index(json.dumps(x)) for x in rec["x_values"]]
            ax.plot(xs, rec["y_values_50"], marker="o", ms=3, lw=1.2, color=colors[rec["kernel_provider"]])
            ax.fill_between(
                xs, rec["y_values_20"], rec["y_values_80"], alpha=0.15, color=colors[rec["kernel_provider"]]
            )
            bad = [i for i, x in enumerate(rec["x_values"]) if x in rec.get("mismatch_x_values", [])]
            if bad:
                ax.plot([xs[i] for i in bad], [rec["y_values_50"][i] for i in bad], "rx", ms=8, mew=2)
        unit = recs[0]["metric_unit"]
        bw = copy_bw or recs[0].get("copy_bandwidth_GBps")
        if unit == "GB/s" and bw:
            ax.axhline(bw, ls="--", color="k", lw=1)
            ax.text(0.01, bw, f" copy {bw:.0f}", va="bottom", ha="left", fontsize=7, transform=ax.get_yaxis_transform())
            ax.set_ylim(0, max(bw * 1.1, ax.get_ylim()[1]))
        if numeric:
            xv = sorted({float(x) for x in xs_all})
            if len(xv) > 1 and xv[0] > 0 and xv[-1] / xv[0] >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xv)
            labels = [f"{int(x)}" if float(x).is_integer() else f"{x:g}" for x in xv]
            ax.set_xticklabels(labels, fontsize=7, rotation=45 if len(xv) > 4 else 0)
        else:
            ax.set_xticks(range(len(cats)))
            ax.set_xticklabels([json.loads(c) for c in cats], fontsize=7, rotation=30)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel(recs[0]["x_label"], fontsize=8)
        ax.set_ylabel(f"{recs[0]['metric_name']} ({unit})", fontsize=8)
        ax.set_title(_panel_title(key), fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colors[p], marker="o", ms=3, label=p) for p in providers]
    if any(r.get("mismatch_x_values") for r in records):
        handles.append(plt.Line2D([], [], color="r", marker="x", ls="", label="check failed"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1 - 0.3 / height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return f"plot written: {path}"


def _panel_sort_key(key: tuple) -> tuple:
    op, extra = key
    cfg = json.loads(extra)
    order = {"bf16": 0, "fp16": 1, "fp32": 2}
    return (op, cfg.get("M", 0), order.get(cfg.get("dtype"), 9), extra)


def _panel_title(key: tuple) -> str:
    op, extra = key
    cfg = json.loads(extra)
    parts = [op] + [f"{k}={v}" for k, v in sorted(cfg.items()) if k != "suite"]
    return " ".join(parts)


# --------------------------------------------------------------------------------------------------------------
# Session: device setup, the measurement loops, output
# --------------------------------------------------------------------------------------------------------------


class Session:
    """Everything one script run shares: device, timer, copy bandwidth, providers, collected points."""

    def __init__(self, args: argparse.Namespace, kernel_name: str, json_name: str):
        self.args = args
        self.kernel_name = kernel_name
        self.json_name = json_name
        self.cpu_mode = os.environ.get(CPU_ENV) == "1"
        self.device = torch.device("cuda", torch.cuda.current_device()) if not self.cpu_mode else torch.device("cpu")
        self.gpu_name = torch.cuda.get_device_name(self.device) if not self.cpu_mode else "cpu-test"
        self.l2 = l2_bytes(self.device)
        self.timer = Timer(self.device, args.timing)
        self.points: list[Point] = []
        self.copy_bw: float | None = None
        self.copy_stats: tuple[float, float, float] | None = None
        self.t0 = time.perf_counter()
        self.timestamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.mod, self.version, self.mod_error = import_tilegym_rms()
        out = args.out if args.out is not None else BENCH_DIR / "results" / gpu_slug(self.gpu_name)
        self.out_dir = Path(out) / "quick" if (args.quick and args.out is None) else Path(out)
        self.providers: list[Provider] = []
        self.skipped: dict[str, str] = {}
        self.aborted = False
        self.extra_points: list[tuple] = []  # free-form extras a script records (e.g. workspace sizes)

    # -- setup
    def start(self) -> None:
        print(f"tilegym_rms {self.version}; torch {torch.__version__}; device {self.gpu_name} ({self.device})")
        if self.mod is None:
            print(f"  tilegym_rms import failed: {self.mod_error}")
        print(f"  L2 {self.l2 / 2**20:.0f} MiB; rotating input sets total > {L2_FACTOR}x L2 (at most {MAX_SETS} sets)")
        print("  " + self.timer.calibrate())
        self.measure_copy()
        self.providers, self.skipped = discover_providers(
            self.args.providers, self.device, self.args.eps, self.mod, self.mod_error
        )
        for name, why in self.skipped.items():
            print(f"  provider {name} skipped: {why}")
        print(f"  providers: {', '.join(p.name for p in self.providers) or '(none)'}")
        print(f"  results: {self.out_dir}", flush=True)

    def measure_copy(self) -> None:
        nbytes = COPY_BYTES if not self.cpu_mode else 2**24
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        sync(self.device)
        t = self.timer.time_reps(lambda: dst.copy_(src), max(self.args.reps, 10), 1)
        if self.timer.method == "profiler" and t.method != "profiler":
            self.timer.method = "cuda-events"
            print("  the profiler recorded no device activity for the copy: timing switched to CUDA events")
        bws = [gbps(2 * nbytes, u) for u in t.us]
        self.copy_stats = summarize(bws)
        self.copy_bw = self.copy_stats[0]
        print(
            f"  device copy bandwidth ({nbytes / 2**30:g} GiB dst.copy_(src), read+write): "
            f"{self.copy_bw:.0f} GB/s (p20 {self.copy_stats[1]:.0f}, p80 {self.copy_stats[2]:.0f}) [{t.method}]"
        )
        if self.device.type == "cuda" and not (100 < self.copy_bw < 20000):
            print("  WARNING: copy bandwidth looks implausible; check the timing method")

    def meta(self) -> dict:
        return {
            "gpu_name": self.gpu_name,
            "timestamp": self.timestamp,
            "tilegym_rms_version": self.version,
            "copy_bandwidth_GBps": self.copy_bw,
            "timing_method": METHOD_TEXT[self.timer.method],
        }

    def elapsed(self) -> str:
        return f"+{time.perf_counter() - self.t0:.0f}s"

    # -- measurement of one point
    def measure_point(self, p: Point, provider: Provider, sets: InputSets, calls: int) -> None:
        """First call + check, warm-up over every set, then ``reps`` timed passes of ``calls`` calls."""
        call = None
        try:
            call, p.note = build_call(p.op, provider, sets)
            out = call(0)
            sync(self.device)
            p.errs = relative_errors(sets.x[0], sets.w[0], self.args.eps, out, sets.dy[0] if sets.dy else None)
            p.ok = check_ok(p.errs, p.dtype)
            del out
            for i in range(sets.n):
                call(i)
            sync(self.device)

            def run_pass():
                for k in range(calls):
                    call(k % sets.n)

            t = self.timer.time_reps(run_pass, self.args.reps, calls)
            p.us, p.kernels_per_call, p.method = t.us, t.kernels_per_call, t.method
        except Exception as exc:  # noqa: BLE001 - one failing provider must not end the run
            p.error = short_error(exc)
            if is_sticky_cuda_error(exc):
                self.aborted = True
        finally:
            call = None
            if self.device.type == "cuda" and not self.aborted:
                try:
                    torch.cuda.synchronize(self.device)
                except Exception as exc:  # noqa: BLE001
                    p.error = p.error or short_error(exc)
                    self.aborted = True

    def progress(self, idx: int, total: int, p: Point) -> None:
        head = f"[{idx:>4}/{total} {self.elapsed():>6}] {p.op:<10} {p.dtype} M={p.m:<6} N={p.n:<6} {p.provider:<19}"
        if p.error:
            log(f"{head} ERROR {p.error}")
            return
        t50 = p.time_stats()[0]
        err = f"err={p.max_err:.1e}" if p.max_err is not None else "err=n/a"
        check = {True: "ok", False: "MISMATCH", None: "unchecked"}[p.ok]
        if p.metric == "latency":
            log(f"{head} {t50:9.2f} us/call  {err} {check}")
            return
        bw = p.gbps_stats()[0]
        pct = f" ({100 * bw / self.copy_bw:5.1f}%)" if self.copy_bw else ""
        kpc = f"{p.kernels_per_call:.1f} kern/call" if math.isfinite(p.kernels_per_call) else p.method
        sets = f"sets={p.n_sets}{' (capped: L2-resident)' if p.capped else ''}"
        note = f" [{p.note}]" if p.note else ""
        log(f"{head} {fmt_num(bw):>8} GB/s{pct} {t50:9.2f} us  {kpc}  {sets}  {err} {check}{note}")

    # -- loops
    def run_configs(
        self,
        op: str,
        suite: str,
        configs: list[tuple[str, int, int]],
        label: Callable[[str, int, int], tuple[str, str, object, dict]],
        after_config: Callable[[str, int, int], None] | None = None,
        skip: tuple[str, ...] = (),
    ) -> list[Point]:
        """Measure every provider on every (dtype, M, N) in ``configs`` for ``op``; ``label`` gives
        (x_name, x_label, x_value, extra) of a configuration."""
        points: list[Point] = []
        providers = [p for p in self.providers if p.name not in skip]
        total = len(configs) * len(providers)
        idx = 0
        for dtype_name, m, n in configs:
            if self.aborted:
                break
            dtype = DTYPES[dtype_name]
            elt = torch.empty((), dtype=dtype).element_size()
            n_sets, capped = rotation_sets(read_bytes(op, m, n, elt), self.l2)
            sets = None
            err = ""
            try:
                sets = InputSets(
                    m, n, dtype, self.device, n_sets, self.args.seed, self.args.eps, need_dy=op != "forward"
                )
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the largest shapes
                err = short_error(exc)
            for provider in providers:
                idx += 1
                x_name, x_label, x_value, extra = label(dtype_name, m, n)
                p = Point(
                    self.kernel_name, op, suite, provider.name, dtype_name, m, n, x_name, x_label, x_value, extra,
                    nbytes=op_bytes(op, m, n, elt), n_sets=n_sets, capped=capped,
                )  # fmt: skip
                if sets is None:
                    p.error = f"input allocation failed: {err}"
                elif not self.aborted:
                    self.measure_point(p, provider, sets, calls_per_pass(n_sets))
                else:
                    p.error = "skipped after a sticky CUDA error"
                points.append(p)
                self.points.append(p)
                self.progress(idx, total, p)
            del sets
            if after_config is not None:
                after_config(dtype_name, m, n)
            self.release()
            self.save()
        return points

    def run_latency(self, op: str, ms: list[int], n: int, dtype_name: str, calls: int, warmup: int = 10) -> list[Point]:
        """Wall-clock microseconds per eager call (host + device) for small shapes."""
        points = []
        total = len(ms) * len(self.providers)
        idx = 0
        dtype = DTYPES[dtype_name]
        for m in ms:
            if self.aborted:
                break
            sets = InputSets(m, n, dtype, self.device, 1, self.args.seed, self.args.eps, need_dy=op != "forward")
            for provider in self.providers:
                idx += 1
                extra = {"N": n, "dtype": dtype_name, "suite": "latency"}
                p = Point(self.kernel_name, op, "latency", provider.name, dtype_name, m, n, "M", "rows M", m, extra)
                p.metric = "latency"
                p.method = "wall clock per eager call (perf_counter, sync at the end)"
                call = None
                try:
                    call, p.note = build_call(op, provider, sets)
                    out = call(0)
                    sync(self.device)
                    p.errs = relative_errors(sets.x[0], sets.w[0], self.args.eps, out, sets.dy[0] if sets.dy else None)
                    p.ok = check_ok(p.errs, dtype_name)
                    del out
                    for _ in range(warmup):
                        call(0)
                    p.us = wall_latency_us(lambda c=call: c(0), self.device, calls, self.args.reps)
                except Exception as exc:  # noqa: BLE001
                    p.error = short_error(exc)
                    self.aborted = self.aborted or is_sticky_cuda_error(exc)
                call = None
                points.append(p)
                self.points.append(p)
                self.progress(idx, total, p)
            del sets
            self.release()
            self.save()
        return points

    def release(self) -> None:
        if self.device.type == "cuda" and not self.aborted:
            torch.cuda.empty_cache()

    # -- output
    def print_table(self, title: str, points: list[Point], with_time: bool = True) -> None:
        names = [p.name for p in self.providers]
        print()
        print(f"== {title}")
        if points and points[0].metric == "latency":
            print("   microseconds per eager call (host + device wall clock; median of reps; '!' = check failed)")
            print(results_table(points, names, None, "us"))
        else:
            bw = f"{self.copy_bw:.0f}" if self.copy_bw else "?"
            print(f"   GB/s of minimal traffic (% of device copy bandwidth {bw} GB/s); '!' = check failed; ERR = error")
            print(f"   timing: {METHOD_TEXT[self.timer.method]}; median of {self.args.reps} reps")
            print(results_table(points, names, self.copy_bw))
            if with_time:
                print("   median microseconds per call:")
                print(results_table(points, names, self.copy_bw, "us"))
        for line in mismatch_lines(points):
            print(line)
        notes = sorted({(p.provider, p.note) for p in points if p.note})
        for prov, note in notes:
            print(f"   note: {prov}: {note}")
        capped = sorted({(p.dtype, p.m, p.n) for p in points if p.capped})
        if capped:
            print(f"   note: input rotation capped at {MAX_SETS} sets (data partly L2-resident) for {capped}")
        sys.stdout.flush()

    def json_path(self) -> Path:
        return self.out_dir / self.json_name

    def save(self) -> list[dict]:
        """Merge this run's points into the JSON file (called after every configuration)."""
        try:
            return write_json(self.json_path(), build_records(self.points, self.meta()))
        except OSError as exc:
            log(f"warning: could not write {self.json_path()}: {exc}")
            return []

    def plot(self, file_stem: str, title: str, select: Callable[[dict], bool]) -> None:
        if self.args.no_plot:
            return
        merged = self.save()
        recs = [r for r in merged if select(r)]
        try:
            msg = plot_records(recs, self.out_dir / f"{file_stem}.png", f"{title} - {self.gpu_name}", self.copy_bw)
        except Exception as exc:  # noqa: BLE001 - a plot must never lose the numbers
            msg = f"plot {file_stem} failed: {short_error(exc)}"
        print(msg, flush=True)


def grid_configs(dtypes: list[str], ms: list[int], ns: list[int]) -> list[tuple[str, int, int]]:
    return [(d, m, n) for d in dtypes for m in ms for n in ns]


def grid_label(suite: str) -> Callable[[str, int, int], tuple[str, str, object, dict]]:
    def label(dtype_name: str, m: int, n: int):
        return "N", "hidden size N", n, {"M": m, "dtype": dtype_name, "suite": suite}

    return label


def start_session(args, dry_run_plan, kernel_name: str, json_name: str):
    """What both scripts do before measuring: the dry run, the GPU check, provider discovery.
    Returns a started :class:`Session`, or the exit code to return."""
    if args.dry_run:
        print_dry_run(dry_run_plan, args)
        return 0
    code = check_environment()
    if code is not None:
        return code
    session = Session(args, kernel_name, json_name)
    session.start()
    if not session.providers:
        print("no provider can run; nothing to do", file=sys.stderr)
        return 2
    return session


def check_environment() -> int | None:
    """None when a GPU (or the CPU test mode) is there; else prints why and returns the exit code 2."""
    if os.environ.get(CPU_ENV) == "1":
        print(f"{CPU_ENV}=1: CPU test mode, wall-clock timing; the numbers mean nothing")
        return None
    if not torch.cuda.is_available():
        print(
            "No CUDA GPU is available (torch.cuda.is_available() is False): these benchmarks need an NVIDIA GPU.",
            file=sys.stderr,
        )
        return 2
    return None


def print_dry_run(plan: list[tuple[str, str, list[tuple[str, int, int]]]], args, l2: int = L2_FALLBACK_BYTES) -> None:
    """plan: (op, suite, configs)."""
    print(f"dry run: providers {', '.join(args.providers)}; reps {args.reps}; L2 assumed {l2 / 2**20:.0f} MiB")
    total = 0
    for op, suite, configs in plan:
        print(f"-- {suite} / {op}: {len(configs)} configurations")
        for dtype_name, m, n in configs:
            elt = DTYPES[dtype_name].itemsize
            if suite == "latency":
                print(f"   {dtype_name} M={m} N={n}: wall clock, 1 set")
                continue
            n_sets, capped = rotation_sets(read_bytes(op, m, n, elt), l2)
            print(
                f"   {dtype_name} M={m} N={n}: {op_bytes(op, m, n, elt) / 1e6:.1f} MB/call, {n_sets} sets"
                f"{' (capped)' if capped else ''}, {calls_per_pass(n_sets)} calls/rep"
            )
        total += len(configs)
    print(f"total configurations: {total} (x {len(args.providers)} providers)")


def ensure_repo_on_path() -> None:
    """When run as ``python bench/x.py``, make the checkout's tilegym_rms importable (after installed ones)."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.append(root)
