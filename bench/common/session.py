"""One run of a benchmark script: the device, timer, copy bandwidth and providers it sets up, the loops that
measure every provider on every configuration, and what it prints and saves; also the configuration grid and
the dry run."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import base, gated, providers, records, report, timing, traffic


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200', 'NVIDIA GH200 480GB' -> 'gh200'."""
    m = re.search(r"(?<![A-Z0-9])([A-Z]{1,2}\d{2,4}[A-Z]?)(?![A-Z0-9])", name.upper())
    if m:
        return m.group(1).lower()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    slug = re.sub(r"^nvidia-", "", slug)
    return slug or "unknown-gpu"


class Session:
    """Everything one script run shares: device, timer, copy bandwidth, providers, collected points."""

    def __init__(
        self, args: argparse.Namespace, kernel_name: str, json_name: str, suite_json: dict[str, str] | None = None
    ):
        self.args = args
        self.kernel_name = kernel_name
        self.json_name = json_name
        self.suite_json = dict(suite_json or {})  # suites whose points go to a file of their own
        self.cpu_mode = os.environ.get(base.CPU_ENV) == "1"
        self.device = torch.device("cuda", torch.cuda.current_device()) if not self.cpu_mode else torch.device("cpu")
        self.gpu_name = torch.cuda.get_device_name(self.device) if not self.cpu_mode else "cpu-test"
        self.l2 = timing.l2_bytes(self.device)
        self.timer = timing.Timer(self.device, args.timing)
        self.points: list[records.Point] = []
        self.copy_bw: float | None = None
        self.copy_stats: tuple[float, float, float] | None = None
        self.t0 = time.perf_counter()
        self.timestamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.mod, self.version, self.mod_error = providers.import_tilegym_rms()
        out = args.out if args.out is not None else base.BENCH_DIR / "results" / gpu_slug(self.gpu_name)
        self.out_dir = Path(out) / "quick" if (args.quick and args.out is None) else Path(out)
        self.providers: list[providers.Provider] = []
        self.skipped: dict[str, str] = {}
        # residual add fused with RMSNorm: providers with forward (x, r, w) -> (y, residual_out)
        self.fused_providers: list[providers.Provider] = []
        self.fused_skipped: dict[str, str] = {}
        # QK-norm: providers with forward (q, k, wq, wk) -> (q_out, k_out)
        self.qk_providers: list[providers.Provider] = []
        self.qk_skipped: dict[str, str] = {}
        # RMSNorm with FP8 output: providers with forward (x, r or None, w, **quant) -> (y_q, scales, sum or None)
        self.fp8_providers: list[providers.Provider] = []
        self.fp8_skipped: dict[str, str] = {}
        # gated RMSNorm: providers with forward (x, z, w, norm_before_gate) -> y
        self.gated_providers: list[providers.Provider] = []
        self.gated_skipped: dict[str, str] = {}
        self.aborted = False
        self.extra_points: list[tuple] = []  # free-form extras a script records (e.g. workspace sizes)

    # -- setup
    def start(self) -> None:
        print(f"tilegym_rms {self.version}; torch {torch.__version__}; device {self.gpu_name} ({self.device})")
        if self.mod is None:
            print(f"  tilegym_rms import failed: {self.mod_error}")
        print(
            f"  L2 {self.l2 / 2**20:.0f} MiB; rotating input sets total > {base.L2_FACTOR}x L2 "
            f"(at most {base.MAX_SETS} sets)"
        )
        print("  " + self.timer.calibrate())
        self.measure_copy()
        # a script may split its providers: rms_providers for RMSNorm ops, fused_providers for the fused add
        rms_names = getattr(self.args, "rms_providers", self.args.providers)
        fused_names = getattr(self.args, "fused_providers", None) or []
        if rms_names:
            self.providers, self.skipped = self._discover(providers.discover_providers, rms_names, "")
        qk_names = getattr(self.args, "qk_providers", None) or []
        if qk_names:
            self.qk_providers, self.qk_skipped = self._discover(providers.discover_qk_providers, qk_names, "qk-norm ")
        gated_names = getattr(self.args, "gated_providers", None) or []
        if gated_names:
            self.gated_providers, self.gated_skipped = self._discover(gated.discover, gated_names, "gated ")
        if fused_names:
            self.fused_providers, self.fused_skipped = self._discover(
                providers.discover_fused_add_providers, fused_names, "fused add "
            )
        fp8_names = getattr(self.args, "fp8_providers", None) or []
        if fp8_names:
            self.fp8_providers, self.fp8_skipped = self._discover(providers.discover_fp8_providers, fp8_names, "fp8 ")
        print(f"  results: {self.out_dir}", flush=True)

    def _discover(self, discover, names: list[str], label: str):
        """``discover``'s (found, skipped) providers among ``names``, each skip and the result printed."""
        found, skipped = discover(names, self.device, self.args.eps, self.mod, self.mod_error)
        for name, why in skipped.items():
            print(f"  {label}provider {name} skipped: {why}")
        print(f"  {label}providers: {', '.join(p.name for p in found) or '(none)'}")
        return found, skipped

    def measure_copy(self) -> None:
        nbytes = base.COPY_BYTES if not self.cpu_mode else 2**24
        bws, method = timing.copy_bandwidth(self.timer, self.device, nbytes, max(self.args.reps, 10))
        if self.timer.method == "profiler" and method != "profiler":
            self.timer.method = "cuda-events"
            print("  the profiler recorded no device activity for the copy: timing switched to CUDA events")
        self.copy_stats = traffic.summarize(bws)
        self.copy_bw = self.copy_stats[0]
        print(
            f"  device copy bandwidth ({nbytes / 2**30:g} GiB dst.copy_(src), read+write): "
            f"{self.copy_bw:.0f} GB/s (p20 {self.copy_stats[1]:.0f}, p80 {self.copy_stats[2]:.0f}) [{method}]"
        )
        if self.device.type == "cuda" and not (100 < self.copy_bw < 20000):
            print("  WARNING: copy bandwidth looks implausible; check the timing method")

    def meta(self) -> dict:
        return {
            "gpu_name": self.gpu_name,
            "timestamp": self.timestamp,
            "tilegym_rms_version": self.version,
            "copy_bandwidth_GBps": self.copy_bw,
            "timing_method": base.METHOD_TEXT[self.timer.method],
        }

    def elapsed(self) -> str:
        return f"+{time.perf_counter() - self.t0:.0f}s"

    # -- measurement of one point
    def checked_call(
        self, p: records.Point, provider: providers.Provider, sets: providers.InputSets
    ) -> Callable[[int], dict]:
        """``provider``'s call of ``p.op`` on ``sets``, run once on set 0 (which also compiles it) and checked
        against float64 math: fills ``p.note``, ``p.errs`` and ``p.ok``. Exceptions reach the caller."""
        call, p.note = providers.build_call(p.op, provider, sets)
        out = call(0)
        timing.sync(self.device)
        p.errs = providers.output_errors(p.op, sets, self.args.eps, out)
        p.ok = providers.check_ok(p.errs, p.dtype)
        return call

    def failed(self, p: records.Point, exc: Exception) -> None:
        """Record a provider's exception on its point; one that leaves the CUDA context unusable ends the run."""
        p.error = base.short_error(exc)
        if base.is_sticky_cuda_error(exc):
            self.aborted = True

    def measure_point(
        self, p: records.Point, provider: providers.Provider, sets: providers.InputSets, calls: int
    ) -> None:
        """First call + check, warm-up over every set, then ``reps`` timed passes of ``calls`` calls."""
        call = None
        try:
            call = self.checked_call(p, provider, sets)
            for i in range(sets.n):
                call(i)
            timing.sync(self.device)

            def run_pass():
                for k in range(calls):
                    call(k % sets.n)

            t = self.timer.time_reps(run_pass, self.args.reps, calls)
            p.us, p.kernels_per_call, p.method = t.us, t.kernels_per_call, t.method
        except Exception as exc:  # noqa: BLE001 - one failing provider must not end the run
            self.failed(p, exc)
        finally:
            call = None
            if self.device.type == "cuda" and not self.aborted:
                try:
                    torch.cuda.synchronize(self.device)
                except Exception as exc:  # noqa: BLE001
                    p.error = p.error or base.short_error(exc)
                    self.aborted = True

    def progress(self, idx: int, total: int, p: records.Point) -> None:
        head = f"[{idx:>4}/{total} {self.elapsed():>6}] {p.op:<10} {p.dtype} M={p.m:<6} N={p.n:<6} {p.provider:<19}"
        if p.error:
            base.log(f"{head} ERROR {p.error}")
            return
        t50 = p.time_stats()[0]
        err = f"err={p.max_err:.1e}" if p.max_err is not None else "err=n/a"
        check = {True: "ok", False: "MISMATCH", None: "unchecked"}[p.ok]
        if p.metric == "latency":
            base.log(f"{head} {t50:9.2f} us/call  {err} {check}")
            return
        bw = p.gbps_stats()[0]
        pct = f" ({100 * bw / self.copy_bw:5.1f}%)" if self.copy_bw else ""
        kpc = f"{p.kernels_per_call:.1f} kern/call" if math.isfinite(p.kernels_per_call) else p.method
        sets = f"sets={p.n_sets}{' (capped: L2-resident)' if p.capped else ''}"
        note = f" [{p.note}]" if p.note else ""
        base.log(f"{head} {report.fmt_num(bw):>8} GB/s{pct} {t50:9.2f} us  {kpc}  {sets}  {err} {check}{note}")

    # -- loops
    def run_configs(
        self,
        op: str,
        suite: str,
        configs: list[tuple[str, int, int]],
        label: Callable[[str, int, int], tuple[str, str, object, dict]],
        after_config: Callable[[str, int, int], None] | None = None,
        skip: tuple[str, ...] = (),
    ) -> list[records.Point]:
        """Measure every provider on every (dtype, M, N) in ``configs`` for ``op``; ``label`` gives
        (x_name, x_label, x_value, extra) of a configuration. Each op runs its providers (:meth:`providers_for`)."""
        points: list[records.Point] = []
        fused = op in traffic.FUSED_ADD_OPS or traffic.FP8_OPS.get(op, (None, False))[1]
        chosen = [p for p in self.providers_for(op) if p.name not in skip]
        total = len(configs) * len(chosen)
        idx = 0
        for dtype_name, m, n in configs:
            if self.aborted:
                break
            dtype = base.DTYPES[dtype_name]
            elt = torch.empty((), dtype=dtype).element_size()
            n_sets, capped = traffic.rotation_sets(traffic.read_bytes(op, m, n, elt), self.l2)
            sets = None
            err = ""
            try:
                sets = providers.InputSets(
                    m, n, dtype, self.device, n_sets, self.args.seed, self.args.eps,
                    need_dy=op not in ("forward", "fused_add_fwd", *traffic.FP8_OPS)
                    and not op.startswith(("qk_fwd", "gated_fwd")),
                    need_residual=fused, qk=traffic.qk_op_parts(op)[1] if op in traffic.QK_OPS else "",
                    gate_dtype=gated.parse(op)[2] if op in gated.OPS else None,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the largest shapes
                err = base.short_error(exc)
            for provider in chosen:
                idx += 1
                x_name, x_label, x_value, extra = label(dtype_name, m, n)
                p = records.Point(
                    self.kernel_name, op, suite, provider.name, dtype_name, m, n, x_name, x_label, x_value, extra,
                    nbytes=traffic.op_bytes(op, m, n, elt), n_sets=n_sets, capped=capped,
                )  # fmt: skip
                if sets is None:
                    p.error = f"input allocation failed: {err}"
                elif not self.aborted:
                    self.measure_point(p, provider, sets, traffic.calls_per_pass(n_sets))
                else:
                    p.error = "skipped after a sticky CUDA error"
                self.keep(p, points, idx, total)
            del sets
            if after_config is not None:
                after_config(dtype_name, m, n)
            self.release()
            self.save()
        return points

    def run_latency(
        self, op: str, ms: list[int], n: int, dtype_name: str, calls: int, warmup: int = 10
    ) -> list[records.Point]:
        """Wall-clock microseconds per eager call (host + device) for small shapes. The providers of one M
        take turns, one repetition each: a busy stretch of a shared host then slows every provider alike
        instead of whichever ran during it (PERFORMANCE.md, "How to measure")."""
        points = []
        chosen = self.providers_for(op)
        total = len(ms) * len(chosen)
        idx = 0
        dtype = base.DTYPES[dtype_name]
        for m in ms:
            if self.aborted:
                break
            need_dy = op not in ("forward", *traffic.FP8_OPS)
            sets = providers.InputSets(m, n, dtype, self.device, 1, self.args.seed, self.args.eps, need_dy=need_dy)
            timed = []  # [point, its call or None once it failed], one per provider, in order
            for provider in chosen:
                extra = {"N": n, "dtype": dtype_name, "suite": "latency"}
                p = records.Point(
                    self.kernel_name, op, "latency", provider.name, dtype_name, m, n, "M", "rows M", m, extra
                )
                p.metric = "latency"
                p.method = "wall clock per eager call (perf_counter, sync at the end; providers interleaved)"
                p.us = []
                timed.append([p, None])
                try:
                    call = self.checked_call(p, provider, sets)
                    for _ in range(warmup):
                        call(0)
                    timed[-1][1] = call
                except Exception as exc:  # noqa: BLE001 - one failing provider must not end the run
                    self.failed(p, exc)
            for _ in range(self.args.reps):
                for entry in timed:
                    p, call = entry
                    if call is None:
                        continue
                    try:
                        p.us += timing.wall_latency_us(lambda c=call: c(0), self.device, calls, 1)
                    except Exception as exc:  # noqa: BLE001
                        self.failed(p, exc)
                        p.us, entry[1] = [], None
            for p, _ in timed:
                idx += 1
                self.keep(p, points, idx, total)
            timed = None  # the calls hold the input sets
            del sets
            self.release()
            self.save()
        return points

    def providers_for(self, op: str) -> list[providers.Provider]:
        if op in traffic.FP8_OPS:
            return self.fp8_providers
        if op in traffic.QK_OPS:
            return self.qk_providers
        if op in gated.OPS:
            return self.gated_providers
        return self.fused_providers if op in traffic.FUSED_ADD_OPS else self.providers

    def keep(self, p: records.Point, points: list[records.Point], idx: int, total: int) -> None:
        """A finished point joins the loop's list and the session's, and gets its progress line."""
        points.append(p)
        self.points.append(p)
        self.progress(idx, total, p)

    def release(self) -> None:
        if self.device.type == "cuda" and not self.aborted:
            torch.cuda.empty_cache()

    # -- output
    def print_table(self, title: str, points: list[records.Point], with_time: bool = True) -> None:
        names = [p.name for p in self.providers_for(points[0].op if points else "")]
        print()
        print(f"== {title}")
        if points and points[0].metric == "latency":
            print("   microseconds per eager call (host + device wall clock; median of reps; '!' = check failed)")
            print(report.results_table(points, names, None, "us"))
        else:
            bw = f"{self.copy_bw:.0f}" if self.copy_bw else "?"
            print(f"   GB/s of minimal traffic (% of device copy bandwidth {bw} GB/s); '!' = check failed; ERR = error")
            print(f"   timing: {base.METHOD_TEXT[self.timer.method]}; median of {self.args.reps} reps")
            print(report.results_table(points, names, self.copy_bw))
            if with_time:
                print("   median microseconds per call:")
                print(report.results_table(points, names, self.copy_bw, "us"))
        for line in report.mismatch_lines(points):
            print(line)
        notes = sorted({(p.provider, p.note) for p in points if p.note})
        for prov, note in notes:
            print(f"   note: {prov}: {note}")
        capped = sorted({(p.dtype, p.m, p.n) for p in points if p.capped})
        if capped:
            print(f"   note: input rotation capped at {base.MAX_SETS} sets (data partly L2-resident) for {capped}")
        sys.stdout.flush()

    def json_path(self, suite: str | None = None) -> Path:
        """The JSON file of ``suite``'s points: its own where ``suite_json`` names one, else the script's."""
        return self.out_dir / self.suite_json.get(suite, self.json_name)

    def json_paths(self) -> list[Path]:
        """The files this run's points go to (the script's file before any point)."""
        return list(dict.fromkeys(self.json_path(p.suite) for p in self.points)) or [self.json_path()]

    def save(self) -> list[dict]:
        """Merge this run's points into their JSON files (called after every configuration); returns the merged
        records of every file written."""
        merged: list[dict] = []
        for path in self.json_paths():
            points = [p for p in self.points if self.json_path(p.suite) == path]
            try:
                merged += records.write_json(path, records.build_records(points, self.meta()))
            except OSError as exc:
                base.log(f"warning: could not write {path}: {exc}")
        return merged

    def finish(self) -> int:
        """The closing lines of a run; returns the script's exit code (1: a fatal CUDA error cut it short)."""
        print()
        for path in self.json_paths():
            print(f"JSON: {path}")
        if self.aborted:
            print("ABORTED: a fatal CUDA error stopped the run; results so far are saved", file=sys.stderr)
            return 1
        return 0

    def plot(self, file_stem: str, title: str, select: Callable[[dict], bool]) -> None:
        if self.args.no_plot:
            return
        merged = self.save()
        recs = [r for r in merged if select(r)]
        try:
            msg = report.plot_records(
                recs, self.out_dir / f"{file_stem}.png", f"{title} - {self.gpu_name}", self.copy_bw
            )
        except Exception as exc:  # noqa: BLE001 - a plot must never lose the numbers
            msg = f"plot {file_stem} failed: {base.short_error(exc)}"
        print(msg, flush=True)


def grid_configs(dtypes: list[str], ms: list[int], ns: list[int]) -> list[tuple[str, int, int]]:
    return [(d, m, n) for d in dtypes for m in ms for n in ns]


def grid_label(suite: str) -> Callable[[str, int, int], tuple[str, str, object, dict]]:
    def label(dtype_name: str, m: int, n: int):
        return "N", "hidden size N", n, {"M": m, "dtype": dtype_name, "suite": suite}

    return label


def start_session(args, dry_run_plan, kernel_name: str, json_name: str, suite_json: dict[str, str] | None = None):
    """What both scripts do before measuring: the dry run, the GPU check, provider discovery.
    Returns a started :class:`Session` (``suite_json``: suites written to a file of their own), or the exit
    code to return."""
    if args.dry_run:
        print_dry_run(dry_run_plan, args)
        return 0
    code = check_environment()
    if code is not None:
        return code
    session = Session(args, kernel_name, json_name, suite_json)
    session.start()
    if not (
        session.providers
        or session.fused_providers
        or session.qk_providers
        or session.fp8_providers
        or session.gated_providers
    ):
        print("no provider can run; nothing to do", file=sys.stderr)
        return 2
    return session


def check_environment() -> int | None:
    """None when a GPU (or the CPU test mode) is there; else prints why and returns the exit code 2."""
    if os.environ.get(base.CPU_ENV) == "1":
        print(f"{base.CPU_ENV}=1: CPU test mode, wall-clock timing; the numbers mean nothing")
        return None
    if not torch.cuda.is_available():
        print(
            "No CUDA GPU is available (torch.cuda.is_available() is False): these benchmarks need an NVIDIA GPU.",
            file=sys.stderr,
        )
        return 2
    return None


def print_dry_run(
    plan: list[tuple[str, str, list[tuple[str, int, int]]]], args, l2: int = base.L2_FALLBACK_BYTES
) -> None:
    """plan: (op, suite, configs)."""
    print(f"dry run: providers {', '.join(args.providers)}; reps {args.reps}; L2 assumed {l2 / 2**20:.0f} MiB")
    total = 0
    for op, suite, configs in plan:
        print(f"-- {suite} / {op}: {len(configs)} configurations")
        for dtype_name, m, n in configs:
            elt = base.DTYPES[dtype_name].itemsize
            if suite == "latency":
                print(f"   {dtype_name} M={m} N={n}: wall clock, 1 set")
                continue
            n_sets, capped = traffic.rotation_sets(traffic.read_bytes(op, m, n, elt), l2)
            print(
                f"   {dtype_name} M={m} N={n}: {traffic.op_bytes(op, m, n, elt) / 1e6:.1f} MB/call, {n_sets} sets"
                f"{' (capped)' if capped else ''}, {traffic.calls_per_pass(n_sets)} calls/rep"
            )
        total += len(configs)
    print(f"total configurations: {total} (x {len(args.providers)} providers)")
