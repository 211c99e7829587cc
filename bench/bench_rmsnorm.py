"""RMSNorm forward / backward / forward+backward benchmark of tilegym_rms against its peers.

Run from the repository root: ``python -m bench.bench_rmsnorm [--quick] ...``; ``--help`` lists the flags.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.common import base, cli_args, gated, traffic
from bench.common.session import grid_configs, grid_label, start_session

KERNEL_NAME = "rms_norm"
JSON_NAME = "rms_norm.json"
MEASURES = (
    "forward",
    "backward",
    "full",
    "latency",
    "ascend-rs",
    "large",
    "fused_add",
    "qk_norm",
    "fp8",
    "gated",
    "heldout",
)
GRID_MEASURES = ("forward", "backward", "full")
QUICK_DEFAULT_MEASURES = GRID_MEASURES
# The held-out shapes (bench/heldout.json, each with its own dtype): the grid measures' ops, in a file of their
# own (bench/results/<gpu>/heldout.json), which bench/heldout_report.py judges apart from the grid.
HELDOUT_JSON_NAME = "heldout.json"
SUITE_JSON = {"heldout": HELDOUT_JSON_NAME}

LATENCY_M = (1, 8, 64, 512)
LATENCY_N = 4096
LATENCY_CALLS = 100
ASCEND_RS = ((1, 768), (1, 4096), (64, 768), (64, 4096), (1024, 4096))
LARGE_M = 4096
LARGE_N = (32768, 65536, 131072, 262144)
QUICK_LATENCY_M = (1, 512)
QUICK_ASCEND_RS = ((1, 4096), (1024, 4096))
QUICK_LARGE_N = (32768, 131072)
# The residual add fused with RMSNorm, mode "pre": its own M x N grid unless --M/--N name one.
FUSED_ADD_DTYPE = "bf16"
FUSED_ADD_M = (4096, 32768)
FUSED_ADD_N = (2048, 4096, 5120, 8192)
QUICK_FUSED_ADD_M = (4096,)
QUICK_FUSED_ADD_N = (2048, 8192)
FUSED_ADD_OPS = ("fused_add_fwd", "fused_add_bwd")
HELDOUT_OPS = GRID_MEASURES + FUSED_ADD_OPS  # the plain norm's and the fused add's, on every held-out shape
# QK-norm: M rows of q (k has M/4: base.QK_HEADS) x head dim N, unless --M/--N name others.
QK_NORM_DTYPE = "bf16"
QK_NORM_M = tuple(1 << e for e in range(14, 23, 2))
QK_NORM_N = (64, 128, 256)
QUICK_QK_NORM_M = (1 << 16, 1 << 20)
QUICK_QK_NORM_N = (128,)
QK_NORM_OPS = traffic.QK_OPS  # forward and backward on each layout of q and k
# RMSNorm with FP8 (e4m3fn) output, inference: per-row, per-group and static scales, and the fused add.
FP8_DTYPE = "bf16"
FP8_M = (4096, 32768)
FP8_N = (2048, 4096, 5120, 8192)
QUICK_FP8_M = (4096,)
QUICK_FP8_N = (4096,)
FP8_OPS = tuple(traffic.FP8_OPS)
# The gated RMSNorm: M rows of N columns (groups as bench/common/gated.py lays them out), unless --M/--N name others.
GATED_DTYPE = "bf16"
GATED_M = (8192, 65536)
GATED_N = (128, 2048, 4096, 8192)
QUICK_GATED_M = (8192,)
QUICK_GATED_N = (128, 4096)
# The measures with an M x N grid of their own: (dtype, M, N, quick M, quick N, ops).
OWN_GRIDS = {
    "fused_add": (FUSED_ADD_DTYPE, FUSED_ADD_M, FUSED_ADD_N, QUICK_FUSED_ADD_M, QUICK_FUSED_ADD_N, FUSED_ADD_OPS),
    "qk_norm": (QK_NORM_DTYPE, QK_NORM_M, QK_NORM_N, QUICK_QK_NORM_M, QUICK_QK_NORM_N, QK_NORM_OPS),
    "fp8": (FP8_DTYPE, FP8_M, FP8_N, QUICK_FP8_M, QUICK_FP8_N, FP8_OPS),
    "gated": (GATED_DTYPE, GATED_M, GATED_N, QUICK_GATED_M, QUICK_GATED_N, gated.OPS),
}
# The fixed suites: dtype unless --dtype names one, the (M, N) shapes of a full run and of --quick, the ops.
# Decode-sized calls are where an FP8 serving step spends its norms: latency also times the per-row FP8 op.
SUITES = {
    "latency": (
        "bf16", [(m, LATENCY_N) for m in LATENCY_M], [(m, LATENCY_N) for m in QUICK_LATENCY_M],
        ("forward", "full", "fp8_token"),
    ),
    "ascend-rs": ("fp32", ASCEND_RS, QUICK_ASCEND_RS, ("forward", "full")),
    "large": ("bf16", [(LARGE_M, n) for n in LARGE_N], [(LARGE_M, n) for n in QUICK_LARGE_N], ("forward", "full")),
}  # fmt: skip

DESCRIPTION = """\
Times RMSNorm (last-dim, with weight, eps 1e-6, Llama casting) for tilegym_rms and its peers.

measures (--measure, comma list; default all, or forward,backward,full with --quick):
  forward    y = provider(x, w) under torch.no_grad(); traffic = read x, w + write y.
  backward   autograd backward only: y = provider(x, w) is computed per input set OUTSIDE the timed region,
             the timed call is torch.autograd.grad(y, (x, w), dy, retain_graph=True); traffic = read x, dy,
             w, rstd (M fp32) + write dx, dw.
  full       forward + backward per call (y = provider(x, w); torch.autograd.grad(y, (x, w), dy));
             traffic = forward + rstd write (M fp32) + backward.
  (forward/backward/full run over the grid M x N x dtype: --M, --N, --dtype.)
  latency    host + device wall clock per eager call: time.perf_counter around back-to-back calls with one
             sync at the end; M in {1, 8, 64, 512}, N = 4096, bf16; ops forward, full and fp8_token (as in
             fp8, its providers); microseconds.
  ascend-rs  the ascend-rs suite: (M, N) in (1,768) (1,4096) (64,768) (64,4096) (1024,4096), fp32,
             ops forward and full.
  large      large hidden sizes: N in {32768, 65536, 131072, 262144} at M = 4096, bf16, ops forward, full;
             default providers add quack.
  fused_add  residual add fused with RMSNorm, mode "pre": (y, s) = provider(x, r, w), s = x + r,
             y = rms_norm(s); M in {4096, 32768} x N in {2048, 4096, 5120, 8192}, bf16. Two ops:
             fused_add_fwd  under torch.no_grad(); traffic = read x, r, w + write y, s, rstd (M fp32).
             fused_add_bwd  the forward graph is built OUTSIDE the timed region; the timed call is
                            torch.autograd.grad((y, s), (x, r, w), (dy, ds), retain_graph=True);
                            traffic = read dy, ds, s, w, rstd (M fp32) + write dx (= dr), dw.
  qk_norm    QK-norm: (q_out, k_out) = provider(q, k, wq, wk), q of M rows in 16 heads, k of M/4 rows (4
             heads; --qk-heads HQ:HK for another GQA ratio, recorded as "heads"); M in {2^14, 2^16, ..., 2^22}
             x head dim N in {64, 128, 256}, bf16. Two ops per layout:
             qk_fwd  under torch.no_grad(); traffic = the forward of q and of k (read x, w; write y).
             qk_bwd  the forward graph is built OUTSIDE the timed region; the timed call is
                     torch.autograd.grad((yq, yk), (q, k, wq, wk), (dyq, dyk), retain_graph=True);
                     traffic = the backward of q and of k (read x, dy, w, rstd; write dx, dw).
             layouts (op suffix): none, separate q_proj / k_proj outputs (tokens, heads, N), gradients
             contiguous; _transposed, their (B, H, S, N) transposes, gradients contiguous (B, H, S, N);
             _qkv, the q and k slices of one fused qkv projection (B, S, H, N), gradients as autograd hands
             them back from a .transpose(1, 2) consumer (a (B, H, S, N) tensor, transposed). B = 2.
  fp8        RMSNorm with FP8 output for an FP8 GEMM, inference: (y_q, scales) = provider(x, w), y_q
             float8_e4m3fn; M in {4096, 32768} x N in {2048, 4096, 5120, 8192}, bf16, under torch.no_grad().
             Four ops: fp8_token (dynamic scales, one per row), fp8_group (one per 128 columns of a row),
             fp8_static (a given per-tensor scale), fp8_add_token (r += x in place, then fp8_token of r);
             traffic = read x (and r), w; write y_q (1 byte per element), the scales (fp32; the static one
             read) (and the sum). The check dequantizes y_q (y_q * scales) against float64 math (limit 2^-4).
  gated      gated RMSNorm (hybrid models): y = provider(x, z, w), M in {8192, 65536} x N in {128, 2048, 4096,
             8192}, bf16 x; rows of 1024 columns or more in 8 groups (Mamba2; --gated-groups K for another
             count, 1 for whole rows, recorded as "groups"), narrower as one group. Eight
             ops gated_{fwd,bwd}_{before,after}_{bf16gate,fp32gate}: the norm before the gate
             (rms_norm(x) * w * silu(z), Qwen3-Next) or after it (rms_norm(x * silu(z)) * w, Mamba2), with a
             bf16 or an fp32 gate. fwd under torch.no_grad(); traffic = read x, z, w + write y. bwd: the
             forward graph is built OUTSIDE the timed region, the timed call is torch.autograd.grad(y, (x, z,
             w), dy, retain_graph=True); traffic = read x, z, dy, w, rstd (fp32 per group) + write dx, dz, dw.
  heldout    the held-out shapes: forward, backward and full, and the fused add's fused_add_fwd and
             fused_add_bwd (as above, with the fused add's providers), on exactly the (M, N, dtype) shapes of
             bench/heldout.json, which no tuning run may use (--dtype/--M/--N do not apply); default
             providers add quack. Written to <out>/heldout.json, not rms_norm.json; bench/heldout_report.py
             reads it against the performance targets.
  An explicit --dtype also applies to latency, ascend-rs, large, fused_add, qk_norm, fp8 and gated; --M/--N
  only to the grid measures, fused_add, qk_norm, fp8 and gated.

providers: tilegym_rms-cutile, tilegym_rms-triton (those available_backends() says can run), torch
(eager F.rms_norm), torch.compile (Llama-style fp32 RMSNorm, dynamic=False), liger (LigerRMSNormFunction,
casting 'llama', in_place False), tilegym (tilegym.ops.cutile.rms_norm); tilegym_rms-torch on request; quack
(quack.rmsnorm.rmsnorm(x, w, eps=eps)) by default with heldout and large, else on request.
fused_add providers: tilegym_rms-cutile, tilegym_rms-triton (tilegym_rms.fused_add_rms_norm, mode "pre"),
tilegym_rms-unfused (x + r, then tilegym_rms.rms_norm), torch (eager x + r, F.rms_norm), torch.compile (of
that function), liger (LigerFusedAddRMSNormFunction), quack (quack.rmsnorm.rmsnorm, residual=r,
prenorm=True); tilegym_rms-torch on request. --providers applies to both lists.
qk_norm providers: tilegym_rms-cutile (tilegym_rms.qk_rms_norm, one launch each way), and each of torch,
torch.compile, liger and quack (quack.rmsnorm.rmsnorm(x, w, eps=eps) on q's and k's rows, reshaped to 2-D;
skipped where it does not import) called on q and on k; tilegym_rms-unfused (tilegym_rms.rms_norm on q, then
on k, two calls each way), tilegym_rms-triton / -torch on request.
fp8 providers: tilegym_rms-cutile (tilegym_rms.rms_norm_fp8, fused_add_rms_norm_fp8: one kernel), torch.compile
(tilegym_rms.reference.rms_norm_fp8_reference, the norm and its quantization, as one compiled function),
tilegym_rms-unfused (tilegym_rms.rms_norm, or fused_add_rms_norm_ in place, then the reference's quantize_fp8);
torch (the reference, eager) and tilegym_rms-triton / -torch on request (their norm, then torch's quantization).
gated providers: tilegym_rms-cutile, tilegym_rms-triton (tilegym_rms.gated_rms_norm, casting 'llama'),
tilegym_rms-unfused (tilegym_rms.rms_norm, then torch's silu and products), torch.compile (of Hugging Face's
gated forward: Qwen3NextRMSNormGated, FalconH1RMSNormGated with groups, MambaRMSNormGated after the gate), and
mamba-torch (mamba_ssm's gated norm semantics, fp32 throughout, in eager torch).
"""

EPILOG = """\
timing: sum of device kernel/memcpy/memset durations from torch.profiler per call (see bench/common/timing.py;
--timing cuda-events for CUDA events instead); median of --reps repetitions with 20th/80th percentiles,
each repetition one pass over input sets that total > 4x L2. GB/s are also given as % of a 1 GiB
device-to-device copy measured in the same run. The first call of each provider and shape is checked
against float64 math (rel. error limit 1e-2 bf16/fp16, 1e-4 fp32; 2^-4 for an fp8 output, dequantized);
failures are marked '!'.

output: tables on stdout, a progress line per configuration on stderr, Liger-format JSON merged into
<out>/rms_norm.json (heldout: <out>/heldout.json; re-runs replace matching points, so the grid can be split
across runs) and one PNG per measure, <out>/rms_norm_<measure>.png.

examples:
  python -m bench.bench_rmsnorm --quick
  python -m bench.bench_rmsnorm --measure forward,backward,full
  python -m bench.bench_rmsnorm --measure latency,ascend-rs,large
  python -m bench.bench_rmsnorm --measure full --dtype bf16 --M 32768 --providers tilegym_rms-cutile,liger
  python -m bench.bench_rmsnorm --measure fused_add
  python -m bench.bench_rmsnorm --measure qk_norm
  python -m bench.bench_rmsnorm --measure fp8
  python -m bench.bench_rmsnorm --measure gated
  python -m bench.bench_rmsnorm --measure heldout && python -m bench.heldout_report
exit codes: 0 ok, 1 a provider hit a fatal CUDA error, 2 no GPU / bad arguments.
"""


def build_parser() -> argparse.ArgumentParser:
    measure_help = (
        f"comma list among {','.join(MEASURES)} (default all; with --quick: {','.join(QUICK_DEFAULT_MEASURES)})"
    )
    parser = cli_args.script_parser("python -m bench.bench_rmsnorm", DESCRIPTION, EPILOG, MEASURES, None, measure_help)
    parser.add_argument(
        "--latency-calls",
        type=int,
        default=None,
        help=f"eager calls per latency repetition (default {LATENCY_CALLS}, 30 with --quick)",
    )
    parser.add_argument(
        "--qk-heads",
        type=cli_args.parse_heads,
        default=base.QK_HEADS_DEFAULT,
        help="qk_norm: query and key heads HQ:HK (default {}:{}); q has M rows, k M * HK / HQ; M a multiple of "
        "HQ".format(*base.QK_HEADS_DEFAULT),
    )
    parser.add_argument(
        "--gated-groups",
        type=cli_args.positive_int,
        default=gated.GROUPS_DEFAULT,
        help=f"gated: groups per row of {gated.GROUPED_MIN_N} columns or more (default {gated.GROUPS_DEFAULT}; 1: "
        "each row one group); N a multiple of it",
    )
    cli_args.add_common_args(parser)
    return parser


def plan(args: argparse.Namespace) -> list[tuple[str, str, str, list[tuple[str, int, int]]]]:
    """(measure flag, op, suite, configs) in run order."""
    out = []
    for measure in args.measure:
        if measure in GRID_MEASURES:
            out.append((measure, measure, "grid", grid_configs(args.dtype, args.M, args.N)))
            continue
        if measure == "heldout":
            out += [(measure, op, measure, base.heldout_configs()) for op in HELDOUT_OPS]
            continue
        if measure in OWN_GRIDS:
            dtype, ms, ns, quick_ms, quick_ns, ops = OWN_GRIDS[measure]
            dtypes = args.dtype if args.explicit_dtype else [dtype]
            ms = args.M if args.explicit_M else (quick_ms if args.quick else ms)
            ns = args.N if args.explicit_N else (quick_ns if args.quick else ns)
            out += [(measure, op, measure, grid_configs(dtypes, list(ms), list(ns))) for op in ops]
            continue
        dtype, shapes, quick_shapes, ops = SUITES[measure]
        dtypes = args.dtype if args.explicit_dtype else [dtype]
        configs = [(d, m, n) for d in dtypes for m, n in (quick_shapes if args.quick else shapes)]
        out += [(measure, op, measure, configs) for op in ops]
    return out


def plot_stem(op: str, suite: str) -> str:
    """File name (without .png) of the plot that shows ``op`` of ``suite``: one plot per --measure."""
    return f"{KERNEL_NAME}_{op if suite == 'grid' else suite}"


def label_for(suite: str):
    if suite in ("ascend-rs", "heldout"):  # shapes with nothing in common: each its own x

        def label(dtype_name: str, m: int, n: int):
            return "shape", "M x N", f"{m}x{n}", {"dtype": dtype_name, "suite": suite}

        return label
    grid = grid_label(suite)
    if suite == "qk_norm" and base.QK_HEADS != base.QK_HEADS_DEFAULT:
        layout = {"heads": "{}:{}".format(*base.QK_HEADS)}
    elif suite == "gated" and gated.GROUPS != gated.GROUPS_DEFAULT:
        layout = {"groups": gated.GROUPS}
    else:
        return grid

    def layout_label(dtype_name: str, m: int, n: int):  # another GQA ratio or group count: a record of its own
        x_name, x_label, x, extra = grid(dtype_name, m, n)
        return x_name, x_label, x, {**extra, **layout}

    return layout_label


def select(measure: str):
    """Which JSON records go into the plot of ``measure``."""

    def pick(rec: dict) -> bool:
        if rec["kernel_name"] != KERNEL_NAME:
            return False
        suite = json.loads(rec["extra_benchmark_config_str"]).get("suite")
        if measure in GRID_MEASURES:
            return suite == "grid" and rec["kernel_operation_mode"] == measure and rec["metric_name"] == "throughput"
        if measure == "latency":
            return suite == "latency" and rec["metric_name"] == "latency"
        return suite == measure and rec["metric_name"] == "throughput"

    return pick


TITLES = {
    "forward": "RMSNorm forward",
    "backward": "RMSNorm backward (autograd)",
    "full": "RMSNorm forward+backward",
    "latency": "RMSNorm eager latency per call",
    "ascend-rs": "RMSNorm ascend-rs suite",
    "large": "RMSNorm large hidden sizes",
    "fused_add": "Residual add + RMSNorm (mode pre)",
    "qk_norm": "QK-norm (q and k per head)",
    "fp8": "RMSNorm with FP8 output (e4m3fn)",
    "gated": "Gated RMSNorm",
    "heldout": "RMSNorm held-out shapes",
}
OP_TITLES = {
    "fused_add_fwd": "forward",
    "fused_add_bwd": "backward (autograd)",
    "fp8_token": "dynamic per-row scales",
    "fp8_group": f"dynamic scales per {traffic.FP8_GROUP_SIZE} columns",
    "fp8_static": "static scale",
    "fp8_add_token": "residual add in place, per-row scales",
    **{
        op: ("forward" if op.startswith("qk_fwd") else "backward (autograd)") + f", {traffic.qk_op_parts(op)[1]}"
        for op in traffic.QK_OPS
    },
    **{op: gated.title(op) for op in gated.OPS},
}


def split_providers(args: argparse.Namespace) -> None:
    """--providers for the RMSNorm measures (rms_providers), fused_add (fused_providers), qk_norm (qk_providers)
    the FP8 ops of fp8 and latency (fp8_providers) and gated (gated_providers); without --providers each list has
    its own default. A list is empty when no measure needs it."""
    rms = [m for m in args.measure if m not in ("fused_add", "qk_norm", "fp8", "gated")]
    fused = "fused_add" in args.measure or "heldout" in args.measure  # the held-out set has the fused add too
    qk, gated_norm = "qk_norm" in args.measure, "gated" in args.measure
    fp8 = "fp8" in args.measure or "latency" in args.measure
    if args.explicit_providers:
        args.rms_providers = list(args.providers) if rms else []
        args.fused_providers = list(args.providers) if fused else []
        args.qk_providers = list(args.providers) if qk else []
        args.fp8_providers = list(args.providers) if fp8 else []
        args.gated_providers = list(args.providers) if gated_norm else []
    else:
        with_quack = any(m in base.QUACK_BY_DEFAULT for m in rms)
        rms_default = base.HELDOUT_PROVIDERS_DEFAULT if with_quack else base.PROVIDERS_DEFAULT
        args.rms_providers = list(rms_default) if rms else []
        args.fused_providers = list(base.FUSED_ADD_PROVIDERS_DEFAULT) if fused else []
        args.qk_providers = list(base.QK_PROVIDERS_DEFAULT) if qk else []
        args.fp8_providers = list(base.FP8_PROVIDERS_DEFAULT) if fp8 else []
        args.gated_providers = list(gated.PROVIDERS_DEFAULT) if gated_norm else []
        lists = (args.rms_providers, args.fused_providers, args.qk_providers, args.fp8_providers, args.gated_providers)
        args.providers = list(dict.fromkeys(name for names in lists for name in names))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.measure is None:
        args.measure = list(QUICK_DEFAULT_MEASURES if args.quick else MEASURES)
    args = cli_args.finish_args(args)
    base.QK_HEADS = args.qk_heads  # the run's GQA ratio (base.QK_HEADS)
    gated.GROUPS = args.gated_groups  # the run's groups per row (gated.GROUPS)
    if args.latency_calls is None:
        args.latency_calls = 30 if args.quick else LATENCY_CALLS
    split_providers(args)
    steps = plan(args)
    qk_ms = {m for _, _, suite, configs in steps if suite == "qk_norm" for _, m, _ in configs}
    bad = sorted(m for m in qk_ms if m % args.qk_heads[0])
    if bad:
        print(f"--qk-heads {args.qk_heads[0]}:{args.qk_heads[1]}: M must be a multiple of {args.qk_heads[0]}, "
              f"got {', '.join(map(str, bad))}", file=sys.stderr)  # fmt: skip
        return 2
    gated_ns = {n for _, _, suite, configs in steps if suite == "gated" for _, _, n in configs}
    bad = sorted(n for n in gated_ns if n >= gated.GROUPED_MIN_N and n % args.gated_groups)
    if bad:
        print(f"--gated-groups {args.gated_groups}: N of {gated.GROUPED_MIN_N} columns or more must be a multiple of "
              f"it, got {', '.join(map(str, bad))}", file=sys.stderr)  # fmt: skip
        return 2
    dry_run_plan = [(op, suite, configs) for _, op, suite, configs in steps]
    session = start_session(args, dry_run_plan, KERNEL_NAME, JSON_NAME, SUITE_JSON)
    if isinstance(session, int):
        return session
    done_measures: list[str] = []
    for i, (measure, op, suite, configs) in enumerate(steps):
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
            title = f"{TITLES[measure]}" + (f", {OP_TITLES.get(op, op)}" if suite != "grid" else "")
        session.print_table(title, points)
        last_of_measure = i + 1 == len(steps) or steps[i + 1][0] != measure
        if last_of_measure:
            session.plot(plot_stem(op, suite), TITLES[measure], select(measure))
            done_measures.append(measure)
    return session.finish()


if __name__ == "__main__":
    sys.exit(main())
