"""RMSNorm forward / backward / forward+backward benchmark of tilegym_rms against its peers.

Run from the repository root: ``python bench/bench_rmsnorm.py [--quick] ...``; ``--help`` lists the flags.
"""

from __future__ import annotations

import argparse
import json
import sys

try:  # imported as part of the bench package / namespace
    from . import common
except ImportError:  # run as a script: bench/ is on sys.path
    import common

KERNEL_NAME = "rms_norm"
JSON_NAME = "rms_norm.json"
MODES = ("forward", "backward", "full", "latency", "ascend-rs", "large")
GRID_MODES = ("forward", "backward", "full")
QUICK_DEFAULT_MODES = GRID_MODES

LATENCY_M = (1, 8, 64, 512)
LATENCY_N = 4096
LATENCY_CALLS = 100
ASCEND_RS = ((1, 768), (1, 4096), (64, 768), (64, 4096), (1024, 4096))
LARGE_M = 4096
LARGE_N = (32768, 65536, 131072, 262144)
QUICK_LATENCY_M = (1, 512)
QUICK_ASCEND_RS = ((1, 4096), (1024, 4096))
QUICK_LARGE_N = (32768, 131072)

DESCRIPTION = """\
Times RMSNorm (last-dim, with weight, eps 1e-6, Llama casting) for tilegym_rms and its peers.

modes (--mode, comma list; default all, or forward,backward,full with --quick):
  forward    y = provider(x, w) under torch.no_grad(); traffic = read x, w + write y.
  backward   autograd backward only: y = provider(x, w) is computed per input set OUTSIDE the timed region,
             the timed call is torch.autograd.grad(y, (x, w), dy, retain_graph=True); traffic = read x, dy,
             w, rstd (M fp32) + write dx, dw.
  full       forward + backward per call (y = provider(x, w); torch.autograd.grad(y, (x, w), dy));
             traffic = forward + rstd write (M fp32) + backward.
  (forward/backward/full run over the grid M x N x dtype: --M, --N, --dtype.)
  latency    host + device wall clock per eager call: time.perf_counter around back-to-back calls with one
             sync at the end; M in {1, 8, 64, 512}, N = 4096, bf16; ops forward and full; microseconds.
  ascend-rs  the ascend-rs suite: (M, N) in (1,768) (1,4096) (64,768) (64,4096) (1024,4096), fp32,
             ops forward and full.
  large      large hidden sizes: N in {32768, 65536, 131072, 262144} at M = 4096, bf16, ops forward, full.
  An explicit --dtype also applies to latency, ascend-rs and large; --M/--N only to the grid modes.

providers: tilegym_rms-cutile, tilegym_rms-triton (those available_backends() says can run), torch
(eager F.rms_norm), torch.compile (Llama-style fp32 RMSNorm, dynamic=False), liger (LigerRMSNormFunction,
casting 'llama', in_place False), tilegym (tilegym.ops.cutile.rms_norm); tilegym_rms-torch on request.
"""

EPILOG = """\
timing: sum of device kernel/memcpy/memset durations from torch.profiler per call (see bench/common.py;
--timing cuda-events for CUDA events instead); median of --reps repetitions with 20th/80th percentiles,
each repetition one pass over input sets that total > 4x L2. GB/s are also given as % of a 1 GiB
device-to-device copy measured in the same run. The first call of each provider and shape is checked
against float64 math (rel. error limit 1e-2 bf16/fp16, 1e-4 fp32); failures are marked '!'.

output: tables on stdout, a progress line per configuration on stderr, Liger-format JSON merged into
<out>/rms_norm.json (re-runs replace matching points, so the grid can be split across runs) and one PNG
per mode, <out>/rms_norm_<mode>.png.

examples:
  python bench/bench_rmsnorm.py --quick
  python bench/bench_rmsnorm.py --mode forward,backward,full
  python bench/bench_rmsnorm.py --mode latency,ascend-rs,large
  python bench/bench_rmsnorm.py --mode full --dtype bf16 --M 32768 --providers tilegym_rms-cutile,liger
exit codes: 0 ok, 1 a provider hit a fatal CUDA error, 2 no GPU / bad arguments.
"""


def build_parser() -> argparse.ArgumentParser:
    mode_help = f"comma list among {','.join(MODES)} (default all; with --quick: {','.join(QUICK_DEFAULT_MODES)})"
    parser = common.script_parser("bench_rmsnorm.py", DESCRIPTION, EPILOG, MODES, None, mode_help)
    parser.add_argument(
        "--latency-calls",
        type=int,
        default=None,
        help=f"eager calls per latency repetition (default {LATENCY_CALLS}, 30 with --quick)",
    )
    common.add_common_args(parser)
    return parser


def plan(args: argparse.Namespace) -> list[tuple[str, str, str, list[tuple[str, int, int]]]]:
    """(mode flag, op, suite, configs) in run order."""
    out = []
    for mode in args.mode:
        if mode in GRID_MODES:
            out.append((mode, mode, "grid", common.grid_configs(args.dtype, args.M, args.N)))
        elif mode == "latency":
            dtypes = args.dtype if args.explicit_dtype else ["bf16"]
            ms = QUICK_LATENCY_M if args.quick else LATENCY_M
            for op in ("forward", "full"):
                out.append((mode, op, "latency", [(d, m, LATENCY_N) for d in dtypes for m in ms]))
        elif mode == "ascend-rs":
            dtypes = args.dtype if args.explicit_dtype else ["fp32"]
            shapes = QUICK_ASCEND_RS if args.quick else ASCEND_RS
            for op in ("forward", "full"):
                out.append((mode, op, "ascend-rs", [(d, m, n) for d in dtypes for m, n in shapes]))
        elif mode == "large":
            dtypes = args.dtype if args.explicit_dtype else ["bf16"]
            ns = QUICK_LARGE_N if args.quick else LARGE_N
            for op in ("forward", "full"):
                out.append((mode, op, "large", [(d, LARGE_M, n) for d in dtypes for n in ns]))
    return out


def label_for(suite: str):
    if suite == "ascend-rs":

        def label(dtype_name: str, m: int, n: int):
            return "shape", "M x N", f"{m}x{n}", {"dtype": dtype_name, "suite": suite}

        return label
    return common.grid_label(suite)


def select(mode: str):
    """Which JSON records go into the plot of ``mode``."""

    def pick(rec: dict) -> bool:
        if rec["kernel_name"] != KERNEL_NAME:
            return False
        suite = json.loads(rec["extra_benchmark_config_str"]).get("suite")
        if mode in GRID_MODES:
            return suite == "grid" and rec["kernel_operation_mode"] == mode and rec["metric_name"] == "throughput"
        if mode == "latency":
            return suite == "latency" and rec["metric_name"] == "latency"
        return suite == mode and rec["metric_name"] == "throughput"

    return pick


TITLES = {
    "forward": "RMSNorm forward",
    "backward": "RMSNorm backward (autograd)",
    "full": "RMSNorm forward+backward",
    "latency": "RMSNorm eager latency per call",
    "ascend-rs": "RMSNorm ascend-rs suite",
    "large": "RMSNorm large hidden sizes",
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode is None:
        args.mode = list(QUICK_DEFAULT_MODES if args.quick else MODES)
    args = common.finish_args(args)
    if args.latency_calls is None:
        args.latency_calls = 30 if args.quick else LATENCY_CALLS
    steps = plan(args)
    dry_run_plan = [(op, suite, configs) for _, op, suite, configs in steps]
    session = common.start_session(args, dry_run_plan, KERNEL_NAME, JSON_NAME)
    if isinstance(session, int):
        return session
    done_modes: list[str] = []
    for i, (mode, op, suite, configs) in enumerate(steps):
        if session.aborted:
            break
        if suite == "latency":
            by_dtype = {}
            for d, m, _n in configs:
                by_dtype.setdefault(d, []).append(m)
            points = []
            for d, ms in by_dtype.items():
                points += session.run_latency(op, ms, LATENCY_N, d, args.latency_calls)
            title = f"latency, {op}"
        else:
            points = session.run_configs(op, suite, configs, label_for(suite))
            title = f"{TITLES[mode]}" + (f", {op}" if suite != "grid" else "")
        session.print_table(title, points)
        last_of_mode = i + 1 == len(steps) or steps[i + 1][0] != mode
        if last_of_mode:
            session.plot(f"rms_norm_{mode}", TITLES[mode], select(mode))
            done_modes.append(mode)
    print(f"\nJSON: {session.json_path()}")
    if session.aborted:
        print("ABORTED: a fatal CUDA error stopped the run; results so far are saved", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if not __package__:
        common.ensure_repo_on_path()
    sys.exit(main())
