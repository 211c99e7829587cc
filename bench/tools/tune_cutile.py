"""Sweep the cuTile heuristics (``tilegym_rms/cutile/config/``) on a GPU.

Each ``--set NAME=v1,v2`` names an integer parameter of the analytic heuristics (a field of
``config.Heuristics``, any case; the tuning table is off then); each ``--hint NAME=v1,v2`` a cuTile compiler
hint (``occupancy``, ``num_worker_warps``, ``num_ctas``; 0 leaves it to the compiler) that overrides the
config's hints for every kernel of the op, or for the kernel named by ``--only``. Every combination of the
values is applied in turn (the host-side caches are cleared between combinations) and the op is timed as the
sum of its kernels' device time (torch.profiler, as the benchmarks do) over inputs rotating through more
than 4x the L2 cache. ``--breakdown`` also prints the per-kernel device time of each combination, to see
e.g. how much of a backward the dw reduction takes. Prints one table; the winners go into
``config.Heuristics`` with their measurements in ``PERFORMANCE.md``.

    python -m bench.tools.tune_cutile --op backward --shapes 4096x2048 --set bwd_narrow_blocks_per_sm=1,2 --breakdown
    python -m bench.tools.tune_cutile --op forward --shapes 4096x1024 --set fwd_narrow_occupancy=0,2,4
    python -m bench.tools.tune_cutile --op backward --hint num_worker_warps=0,8 --only rms_norm_dw_reduce --breakdown

The gated norm's and the FP8 output's ops go by the benchmark's names (``gated_bwd_after_fp32gate``,
``fp8_token``, ...; gated rows in the benchmark's groups unless ``--group-size`` says otherwise), e.g. the sweep
behind their launch settings (PERFORMANCE.md, "FP8 output"):

    python -m bench.tools.tune_cutile --op fp8_token --shapes 16384x4096 --warm-procs 14 --check \
        --set fp8_tile_elems=4096,8192,16384 --set fp8_blocks_per_sm=1,2,4,8 \
        --set fp8_occupancy=1,2 --set fp8_worker_warps=0,8

``--entry LABEL`` (forward and backward) times a tuning-table candidate instead, named as the sweeps name them
(``"persistent 2x8192 b2 o2 w0"``), as the device's table's winner at each shape's buckets; repeat it or
separate labels by commas. It shows how a bucket's candidates hold at row counts between the bucket points,
which ``tune_table.py`` does not time:

    python -m bench.tools.tune_cutile --op forward --shapes 6144x5120 \
        --entry "persistent 2x8192 b8 o0 w0,persistent 2x8192 b2 o2 w0,gather 1x8192 b0 o4 w0"

``--warm-procs K`` first compiles every combination in K processes (the compile cache is shared; compiling is
most of a sweep's time), ``--check`` prints how far each combination's outputs are from the first one's.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.common import base, cli_args, gated, timing, traffic

OPS = ("forward", "backward", *gated.OPS, *traffic.FP8_OPS)
EPS = 1e-6


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",")]


def parse_set(text: str) -> tuple[str, list[int]]:
    name, _, values = text.partition("=")
    if not values:
        raise argparse.ArgumentTypeError(f"--set takes NAME=v1,v2,..., got {text!r}")
    return name.strip(), [int(v) for v in values.split(",")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.tune_cutile", description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=OPS, default="backward")
    parser.add_argument("--dtype", type=cli_args.parse_dtype, default="bf16", help="bf16, fp16 or fp32")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("4096x4096,32768x4096"), help="MxN,...")
    parser.add_argument("--set", dest="sets", type=parse_set, action="append", default=[], help="NAME=v1,v2")
    parser.add_argument("--hint", dest="hints", type=parse_set, action="append", default=[], help="NAME=v1,v2")
    parser.add_argument(
        "--entry",
        dest="entries",
        action="append",
        default=[],
        help="forward, backward: a table candidate, e.g. 'persistent 2x8192 b2 o2 w0' (repeat, or separate by commas)",
    )
    parser.add_argument("--only", metavar="KERNEL", help="apply the --hint values to this kernel only")
    parser.add_argument("--reps", type=int, default=10, help="timed passes over the rotating inputs (median)")
    parser.add_argument("--breakdown", action="store_true", help="per-kernel device time of each setting")
    parser.add_argument("--group-size", type=int, help="gated ops: columns per group (default: the benchmark's)")
    parser.add_argument("--check", action="store_true", help="max |output - the first combination's output|")
    parser.add_argument("--warm-procs", type=int, default=1, help="compile every combination first, in K processes")
    parser.add_argument("--warm-shard", help=argparse.SUPPRESS)  # "i/K": compile the combinations i, i+K, ...
    return parser


def _inputs(op: str, m: int, n: int, dtype: torch.dtype, device: torch.device, count: int | None = None):
    """``(input sets, minimal bytes)`` of the plain ``forward`` or ``backward`` (also tune_table.py's): ``count``
    sets, or (None) enough to rotate through more than the L2 cache."""
    per_set = m * n * dtype.itemsize * (2 if op == "forward" else 3)
    count = count or traffic.rotation_sets(per_set, timing.l2_bytes(device))[0]
    sets = []
    for _ in range(count):
        x = torch.randn(m, n, dtype=dtype, device=device)
        sets.append((x, torch.randn_like(x), torch.rand(m, device=device) + 0.5))
    return sets, traffic.op_bytes(op, m, n, dtype.itemsize)


def _call(cutile, op, w):
    """The host call of the plain ``forward`` or ``backward`` on one input set (also tune_table.py's)."""
    if op == "forward":
        return lambda s: cutile.forward(s[0], w, EPS, 0.0, "llama")
    return lambda s: cutile.backward(s[0], s[1], w, s[2], 0.0, "llama")


@dataclass
class Problem:
    """One shape of one op: input sets rotating through more than the L2 cache, the call, its minimal bytes."""

    sets: list[tuple]
    call: Callable[[tuple], object]
    nbytes: int


def _problem(cutile, op: str, m: int, n: int, dtype, device, group_size: int | None, sets: int | None = None):
    """The :class:`Problem` of ``op`` at ``(m, n)`` (``sets`` input sets; None: enough to rotate through L2)."""
    w = torch.randn(n, dtype=dtype, device=device)
    elt = dtype.itemsize
    if op in gated.OPS:
        direction, norm_before_gate, gate_dtype = gated.parse(op)
        kw = dict(group_size=group_size or gated.group_size(n) or n, norm_before_gate=norm_before_gate)

        def make():
            x, z = torch.randn(m, n, dtype=dtype, device=device), torch.randn(m, n, device=device).to(gate_dtype)
            if direction == "fwd":
                return x, z
            return x, z, torch.randn_like(x), cutile.gated_forward(x, z, w, EPS, 0.0, "llama", **kw)[1]

        def call(s):
            if direction == "fwd":
                return cutile.gated_forward(s[0], s[1], w, EPS, 0.0, "llama", store_rstd=False, **kw)[0]
            return cutile.gated_backward(s[0], s[1], s[2], w, s[3], 0.0, "llama", **kw)

        nbytes, read = (f(op, m, n, elt, kw["group_size"]) for f in (gated.op_bytes, gated.read_bytes))
    elif op in traffic.FP8_OPS:
        scales, add = traffic.FP8_OPS[op]
        fp8 = dict(out_dtype=torch.float8_e4m3fn, scale_ub=None, use_ue8m0=False,
                   scale=torch.full((1,), 0.05, device=device) if scales == "static" else None,
                   group_size=traffic.FP8_GROUP_SIZE if scales == "group" else None)  # fmt: skip

        def make():
            x = torch.randn(m, n, dtype=dtype, device=device)
            return x, (torch.randn_like(x) if add else None)  # the fused add writes the sum over the residual

        def call(s):
            return cutile.fp8_forward(s[0], s[1], w, EPS, 0.0, "llama", **fp8)

        nbytes, read = traffic.fp8_bytes(op, m, n, elt), traffic.read_bytes(op, m, n, elt)
    else:
        inputs, nbytes = _inputs(op, m, n, dtype, device, sets)
        return Problem(inputs, _call(cutile, op, w), nbytes)
    count = sets or traffic.rotation_sets(read, timing.l2_bytes(device))[0]
    return Problem([make() for _ in range(count)], call, nbytes)


def _outputs(value) -> list[torch.Tensor]:
    """The tensors of an op's result (a tensor or nested tuples), as fp32."""
    if isinstance(value, torch.Tensor):
        return [value.float()]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _outputs(v)]
    return []


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest |a - b| over the outputs (a NaN difference counts as 0)."""
    return max(
        ((x - y).abs().nan_to_num(0.0).max().item() for x, y in zip(a, b, strict=True) if x.numel()), default=0.0
    )


def _fresh(s: tuple) -> tuple:
    # A copy of one input set: the fused add writes over its residual, so each check starts from the same copy.
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in s)


def _time_us(timer: timing.Timer, fn, sets, reps: int) -> float:
    for s in sets[:2]:
        fn(s)  # compile and warm up
    torch.cuda.synchronize()

    def run_pass():
        for s in sets:
            fn(s)

    return traffic.summarize(timer.time_reps(run_pass, reps, len(sets)).us)[0]


def _breakdown(fn, sets) -> str:
    def loop():
        for s in sets:
            fn(s)

    rows = []
    for evt in timing.profiled(loop, cpu=False).key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if total:
            rows.append(f"    {evt.key[:70]:<70} {total / len(sets):9.1f} us/call")
    return "\n".join(rows)


def _entry_table(op: str, dtype: torch.dtype, m: int, n: int, cand, device: torch.device) -> dict:
    """The device's tuning table (an empty one where it has none: the analytic choices) with ``cand`` as the
    ``op`` winner at the buckets of ``(m, n, dtype)`` alone."""
    from tilegym_rms.cutile import tuning
    from tilegym_rms.cutile.launch import num_sms
    from tilegym_rms.cutile.tuning import build

    table = tuning.table_for(device.index)
    if table is None:
        name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        doc = build.new_doc(tuning.device_key(device.index), name, capability, num_sms(device.index), "analytic", "")
    else:
        doc = table.doc
    return build.with_winner(doc, op, tuning.DTYPE_NAMES[dtype], tuning.m_bucket(m), n, cand)


def _apply(stack, config, launch_module, original_with_hints, names, hint_names, combo, only=None, table=None) -> str:
    """Sets the heuristics parameters (until ``stack`` closes) and hint overrides of one combination, or its
    tuning ``table`` (a table entry's combination); returns its description."""
    from tilegym_rms.cutile import tuning
    from tilegym_rms.experimental import kernel_name

    values = dict(zip(names + hint_names, combo, strict=True))
    if table is not None:
        stack.enter_context(tuning.use_table(table))
    if names:  # the heuristics' parameters act only without a tuning table
        stack.enter_context(tuning.use_table(None))
        stack.enter_context(config.override(**{name: values[name] for name in names}))
    overrides = {name: values[name] for name in hint_names}
    if overrides:
        original = original_with_hints

        def with_overrides(kernel, hints):
            # The swept values win over the config's hints; 0 removes a hint (the compiler's choice).
            if only is not None and kernel_name(kernel) != only:
                return original(kernel, hints)
            merged = {**dict(hints), **overrides}
            return original(kernel, tuple(sorted((k, v) for k, v in merged.items() if v)))

        launch_module.with_hints = with_overrides
    return ", ".join(f"{k}={v}" for k, v in values.items()) or "defaults"


def _warm(argv: list[str], procs: int) -> None:
    """Compiles every combination in ``procs`` processes of this tool (``--warm-shard``), which share the
    compile cache, and waits for them."""
    command = [sys.executable, "-m", "bench.tools.tune_cutile", *argv, "--warm-shard"]
    running = [subprocess.Popen([*command, f"{i}/{procs}"]) for i in range(procs)]
    for proc in running:
        proc.wait()


def _parse_entries(args, names: list[str]) -> list[tuple[str | None, object]] | None:
    """``(label, candidate)`` of each ``--entry`` (``[(None, None)]`` without one); None after printing why
    they cannot be used."""
    from tilegym_rms.cutile.tuning import TuningTableError, build

    labels = [part.strip() for text in args.entries for part in text.split(",") if part.strip()]
    if not labels:
        return [(None, None)]
    if args.op not in ("forward", "backward") or names:
        print("--entry times table candidates of --op forward or backward, without --set", file=sys.stderr)
        return None
    try:
        return [(text, build.parse_label(args.op, text)) for text in labels]
    except TuningTableError as exc:
        print(f"--entry: {exc}", file=sys.stderr)
        return None


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    device = timing.cuda_device(parser.prog)
    if device is None:
        return 2
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import config
    from tilegym_rms.cutile import launch as launch_module
    from tilegym_rms.cutile.tuning import TuningTableError

    original_with_hints = launch_module.with_hints  # restored after each combination

    fields = config.Heuristics.__dataclass_fields__
    args.sets = [(name.lower(), values) for name, values in args.sets]
    for name, _ in args.sets:
        if name not in fields:
            print(f"config.Heuristics has no parameter {name!r}; one of {', '.join(fields)}", file=sys.stderr)
            return 2
    dtype = base.DTYPES[args.dtype]
    names = [name for name, _ in args.sets]
    hint_names = [name for name, _ in args.hints]
    entries = _parse_entries(args, names)
    if entries is None:
        return 2
    combos = list(itertools.product(*[values for _, values in args.sets + args.hints])) or [()]
    combos = [(entry, combo) for entry in entries for combo in combos]
    shard, shards = (int(v) for v in args.warm_shard.split("/")) if args.warm_shard else (0, 1)
    if args.warm_procs > 1 and not args.warm_shard:
        _warm(argv, args.warm_procs)
    elif args.warm_shard:
        combos = combos[shard::shards]
    timer = None
    if not args.warm_shard:
        timer = timing.Timer(device, "profiler")
        print(timer.calibrate())
        copy_bw = traffic.summarize(timing.copy_bandwidth(timer, device, base.COPY_BYTES, 5)[0])[0]
        print(f"{torch.cuda.get_device_name(device)}; copy bandwidth {copy_bw:.0f} GB/s; {args.op} {args.dtype}")
    for m, n in args.shapes:
        problem = _problem(cutile, args.op, m, n, dtype, device, args.group_size, 1 if args.warm_shard else None)
        first = None
        pristine = _fresh(problem.sets[0]) if args.check else None  # timing writes over fused-add residuals
        for (label, cand), combo in combos:
            stack = contextlib.ExitStack()
            try:
                table = None if cand is None else _entry_table(args.op, dtype, m, n, cand, device)
            except TuningTableError as exc:  # a candidate of another width class
                print(f"  {m:>6} x {n:<6} {label}: {exc}")
                continue
            setting = _apply(
                stack, config, launch_module, original_with_hints, names, hint_names, combo, args.only, table
            )
            if label is not None:
                setting = label if setting == "defaults" else f"{label}, {setting}"
            cutile.clear_caches()
            try:
                if args.warm_shard:
                    problem.call(problem.sets[0])
                    torch.cuda.synchronize()
                    continue
                note = ""
                if args.check:
                    out = _outputs(problem.call(_fresh(pristine)))
                    first = out if first is None else first
                    note = f"  max diff {_max_diff(first, out):.3g}"
                us = _time_us(timer, problem.call, problem.sets, args.reps)
                gb = traffic.gbps(problem.nbytes, us)
                print(f"  {m:>6} x {n:<6} {setting:<50} {us:9.1f} us {gb:6.0f} GB/s ({100 * gb / copy_bw:.0f}%){note}")
                if args.breakdown:
                    print(_breakdown(problem.call, problem.sets))
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is a result too
                print(f"  {m:>6} x {n:<6} {setting}: {base.short_error(exc)}")
            finally:
                stack.close()
                launch_module.with_hints = original_with_hints
                cutile.clear_caches()
            sys.stdout.flush()
        del problem
    return 0


if __name__ == "__main__":
    sys.exit(main())
