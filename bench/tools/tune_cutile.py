"""Sweep the cuTile heuristics (``tilegym_rms/cutile/config.py``) on a GPU.

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
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys

import torch

from bench.common import base, cli_args, timing, traffic

OPS = ("forward", "backward")


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
    parser.add_argument("--only", metavar="KERNEL", help="apply the --hint values to this kernel only")
    parser.add_argument("--reps", type=int, default=10, help="timed passes over the rotating inputs (median)")
    parser.add_argument("--breakdown", action="store_true", help="per-kernel device time of each setting")
    return parser


def _inputs(op: str, m: int, n: int, dtype: torch.dtype, device: torch.device):
    per_set = m * n * dtype.itemsize * (2 if op == "forward" else 3)
    count, _ = traffic.rotation_sets(per_set, timing.l2_bytes(device))
    sets = []
    for _ in range(count):
        x = torch.randn(m, n, dtype=dtype, device=device)
        sets.append((x, torch.randn_like(x), torch.rand(m, device=device) + 0.5))
    return sets, traffic.op_bytes(op, m, n, dtype.itemsize)


def _call(cutile, op, w):
    if op == "forward":
        return lambda s: cutile.forward(s[0], w, 1e-6, 0.0, "llama")
    return lambda s: cutile.backward(s[0], s[1], w, s[2], 0.0, "llama")


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


def _apply(stack, config, launch_module, original_with_hints, names, hint_names, combo, only=None) -> str:
    """Sets the heuristics parameters (until ``stack`` closes) and hint overrides of one combination;
    returns its description."""
    from tilegym_rms.cutile import tuning
    from tilegym_rms.experimental import kernel_name

    values = dict(zip(names + hint_names, combo, strict=True))
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


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = timing.cuda_device(parser.prog)
    if device is None:
        return 2
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import config
    from tilegym_rms.cutile import launch as launch_module

    original_with_hints = launch_module.with_hints  # restored after each combination

    fields = config.Heuristics.__dataclass_fields__
    args.sets = [(name.lower(), values) for name, values in args.sets]
    for name, _ in args.sets:
        if name not in fields:
            print(f"config.Heuristics has no parameter {name!r}; one of {', '.join(fields)}", file=sys.stderr)
            return 2
    dtype = base.DTYPES[args.dtype]
    timer = timing.Timer(device, "profiler")
    print(timer.calibrate())
    copy_bw = traffic.summarize(timing.copy_bandwidth(timer, device, base.COPY_BYTES, 5)[0])[0]
    print(f"{torch.cuda.get_device_name(device)}; copy bandwidth {copy_bw:.0f} GB/s; {args.op} {args.dtype}")
    names = [name for name, _ in args.sets]
    hint_names = [name for name, _ in args.hints]
    combos = list(itertools.product(*[values for _, values in args.sets + args.hints])) or [()]
    for m, n in args.shapes:
        sets, nbytes = _inputs(args.op, m, n, dtype, device)
        w = torch.randn(n, dtype=dtype, device=device)
        fn = _call(cutile, args.op, w)
        for combo in combos:
            stack = contextlib.ExitStack()
            setting = _apply(stack, config, launch_module, original_with_hints, names, hint_names, combo, args.only)
            cutile.clear_caches()
            try:
                us = _time_us(timer, fn, sets, args.reps)
                gb = traffic.gbps(nbytes, us)
                print(f"  {m:>6} x {n:<6} {setting:<50} {us:9.1f} us {gb:6.0f} GB/s ({100 * gb / copy_bw:.0f}%)")
                if args.breakdown:
                    print(_breakdown(fn, sets))
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is a result too
                print(f"  {m:>6} x {n:<6} {setting}: {base.short_error(exc)}")
            finally:
                stack.close()
                launch_module.with_hints = original_with_hints
                cutile.clear_caches()
            sys.stdout.flush()
        del sets
    return 0


if __name__ == "__main__":
    sys.exit(main())
