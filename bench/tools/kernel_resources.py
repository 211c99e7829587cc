"""The compiler's report for the kernels the dispatcher picks: registers, stack (spills) and shared memory
per thread block, from the cubin (``cuobjdump -res-usage``). Needs no GPU, only the tileiras toolchain and a
``cuobjdump`` (Triton ships one). The choices are the shipped tuning table's for the device class that
``--arch`` and ``--sms`` name (``sm90_132sm`` by default), as the host makes them on such a card, or the
analytic heuristics' with ``--analytic`` or where no table ships for that class.

A kernel that needs more than 255 registers a thread, or shows a stack, spills to local memory: the first
thing to look at when a variant streams below the copy bandwidth (PERFORMANCE.md, "Wide rows").

Each variant is compiled as a launch specializes it for contiguous tensors with 16-byte aligned rows
(``aot.cubin(..., as_launched=True)``): that build loads through TMA into a ring of shared-memory stages and
splits its warps, so its registers, stack and shared memory differ from the build without those assumptions.
``--generic`` reports that other build instead; it is the one the compile check builds, and the one a launch
makes for rows that are not 16-byte aligned (PERFORMANCE.md, "Toolchain").

    python -m bench.tools.kernel_resources --shapes 32768x4096,4096x16384,4096x32768 --dtype bf16

Each launch line gives the grid, the blocks one SM holds and the waves they make; ``--sass`` adds the build's
instruction count and its loads and stores by width (``LDS.U16``: one 16-bit value a thread from shared memory).
``--waves-of`` takes a ``tune_table`` candidates file instead and sets every persistent candidate of ``--op``
(forward, backward) it timed beside the waves its launch runs in (PERFORMANCE.md, "The launched build and its
load ring"):

    python -m bench.tools.kernel_resources --waves-of bench/results/h100/sweeps/table_sm90_132sm_candidates.json

``--entry LABEL`` reports a table candidate, named as the sweeps name it, instead of the dispatcher's choice, for
each shape (``--op`` forward or backward): how a candidate would build before it is timed. Hints that tileiras 13.4
refuses (``num_worker_warps`` 16) build under ``bench.tools.dev_bytecode`` with tileiras 13.5:

    python -m bench.tools.dev_bytecode -m bench.tools.kernel_resources --shapes 4096x8192 \
        --entry "gather 1x8192 b0 o4 w0,gather 1x8192 b0 o4 w16"
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import base, cli_args


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def _dump(cubin: bytes, cuobjdump: str, *flags: str) -> str:
    """What ``cuobjdump FLAGS`` prints of ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, *flags, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes, cuobjdump: str) -> dict[str, int]:
    """``{"REG": .., "STACK": .., "SHARED": .., "LOCAL": .., "THREADS": ..}`` of the single kernel in ``cubin``
    (``THREADS``: the block size the kernel requires, 0 where it names none)."""
    out = _dump(cubin, cuobjdump, "-res-usage", "-elf")  # the report and the ELF attributes, in one run
    use = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    ntid = re.search(r"EIATTR_REQNTID\s+Format:\s+\S+\s+Value:\s+((?:0x[0-9a-f]+\s*)+)", out)
    use["THREADS"] = 0 if ntid is None else math.prod(int(v, 16) for v in ntid.group(1).split())
    return use


# The SASS opcodes --sass lists one by one (with their width suffix, e.g. LDS.U16 / LDS.64): the memory traffic of
# each thread, the shared-memory reads of staged tiles and the spills.
MEMORY_OPS = ("LDG", "LDS", "STG", "STS", "LDL", "STL", "UTMALDG", "UTMASTG")


def instruction_counts(cubin: bytes, cuobjdump: str) -> collections.Counter:
    """``{opcode: count}`` of the single kernel in ``cubin`` (``cuobjdump -sass``; predicates dropped, the
    opcode's modifiers kept, e.g. ``LDS.U16``, ``STG.E.64``): static counts, each instruction once however
    often it runs."""
    counts = collections.Counter()
    for code in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]+);", _dump(cubin, cuobjdump, "-sass")):
        words = code.split()
        counts[words[1] if words[0].startswith("@") else words[0]] += 1
    return counts


def sass_summary(counts: collections.Counter) -> str:
    """One line: the instruction total and each memory opcode's count (:data:`MEMORY_OPS`)."""
    memory = sorted((op, n) for op, n in counts.items() if op.split(".")[0] in MEMORY_OPS)
    return f"{sum(counts.values())} instructions; " + ", ".join(f"{op} {n}" for op, n in memory)


# Per-SM limits of the occupancy calculation, by compile target: registers, shared memory (bytes, the
# largest carve-out), threads, blocks. The report's SHARED already counts the 1 KB the driver reserves per
# block: on launched sm_90 builds it is the driver's static size plus 1024, and the driver's own blocks per SM
# (cuOccupancyMaxActiveBlocksPerMultiprocessor) equal this model's with SHARED as it stands (PERFORMANCE.md,
# "Rings sized just past two blocks").
SM_LIMITS = {
    "sm_80": {"regs": 65536, "shared": 167936, "threads": 2048, "blocks": 32},
    "sm_90": {"regs": 65536, "shared": 233472, "threads": 2048, "blocks": 32},
    "sm_100": {"regs": 65536, "shared": 233472, "threads": 2048, "blocks": 32},
}


def blocks_that_fit(use: dict[str, int], arch: str) -> int | None:
    """Blocks of a kernel with resources ``use`` (:func:`resource_usage`) that one SM of ``arch`` holds at
    once, the least of what its registers (allocated per warp in units of 256), shared memory, threads and
    block slots allow; None for a target without :data:`SM_LIMITS` or a kernel that names no block size."""
    lim = SM_LIMITS.get(arch)
    if lim is None or not use.get("THREADS"):
        return None
    warps = -(-use["THREADS"] // 32)
    regs_per_warp = -(-max(use["REG"], 1) * 32 // 256) * 256
    by_regs = (lim["regs"] // regs_per_warp) // warps
    by_shared = lim["shared"] // max(use["SHARED"], 1)
    return min(by_regs, by_shared, lim["threads"] // use["THREADS"], lim["blocks"])


def launch_shape(use: dict[str, int], grid: tuple[int, ...], arch: str, sms: int) -> str:
    """One line on how a launch of ``grid`` blocks lands on ``sms`` SMs: threads per block, blocks that fit
    per SM (:func:`blocks_that_fit`) and the waves that makes; more than one wave of a walking kernel means
    blocks that start only when others end (PERFORMANCE.md, "The launched build and its load ring")."""
    blocks = math.prod(grid)
    fit = blocks_that_fit(use, arch)
    if fit is None:
        return f"grid {blocks}, {use.get('THREADS') or '?'} threads per block"
    waves = -(-blocks // (fit * sms)) if fit else 0
    return f"grid {blocks} ({blocks / sms:.1f} per SM), {use['THREADS']} threads, {fit} fit per SM: {waves} wave(s)"


def chosen_table(arch: str, sms: int, analytic: bool = False):
    """``(table or None, what the choices follow)``: the shipped tuning table of the device class ``arch`` and
    ``sms`` name (``sm_90``, 132: ``sm90_132sm``), which the host uses on such a card, unless ``analytic``."""
    from tilegym_rms.cutile import tuning

    digits = arch.removeprefix("sm_")  # sm_90 -> (9, 0), sm_100 -> (10, 0)
    key = tuning.class_key((int(digits[:-1]), int(digits[-1])), sms)
    table = None if analytic else tuning.packaged(key)
    return table, (f"the {key} tuning table" if table is not None else "the analytic heuristics")


def _launched(op: str, dt: str, n: int, m: int, label: str, sms: int):
    """``(variant, blocks)``: the ``op`` ("forward" or "backward") build and grid the host makes for ``m`` rows
    of ``n`` in ``dt`` when a table names the sweep candidate ``label`` (``tuning.build.label``) for them."""
    from tilegym_rms import aot
    from tilegym_rms.cutile import tuning
    from tilegym_rms.cutile.tuning import build

    empty = build.new_doc("probe", "probe", (9, 0), sms, "measured", "kernel_resources")
    doc = build.with_winner(empty, op, dt, tuning.m_bucket(m), n, build.parse_label(op, label))
    grids: dict = {}
    found = aot.variants_for(m, n, base.DTYPES[dt], sms, (None,), False, tuning.load(doc), grids=grids)
    prefix = "rms_norm_fwd_" if op == "forward" else "rms_norm_bwd_"
    variant = next(v for v in found if v.kernel_name.startswith(prefix))
    return variant, math.prod(grids[variant])


def _launched_use(variant, arch: str) -> dict[str, int]:
    from tilegym_rms import aot

    return resource_usage(aot.cubin(variant, arch, as_launched=True), find_cuobjdump())


def sweep_waves(doc: dict, arch: str, sms: int, jobs: int = 1, op: str = "forward") -> list[dict]:
    """Every persistent ``op`` ("forward" or "backward") candidate a sweep timed (``doc``: a ``tune_table``
    candidates file), with its GB/s, the grid the host makes, the blocks one SM holds, the waves, registers, stack
    and shared memory."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    points = [
        (dt, int(key), run["m"], label, gbps)
        for dt, by_n in doc.get(op, {}).items()
        for key, runs in by_n.items()
        for run in runs
        for label, gbps in run.get("gbps", {}).items()
        if label.startswith("persistent ")
    ]
    launched = {p[:4]: _launched(op, *p[:4], sms) for p in points}
    variants = sorted({v for v, _ in launched.values()}, key=str)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        uses = dict(zip(variants, pool.map(_launched_use, variants, [arch] * len(variants)), strict=True))
    out = []
    for dt, n, m, label, gbps in points:
        variant, blocks = launched[dt, n, m, label]
        use = uses[variant]
        fit = blocks_that_fit(use, arch)
        out.append({
            "dtype": dt, "n": n, "m": m, "label": label, "gbps": gbps, "blocks": blocks, "fit": fit,
            "waves": -(-blocks // (fit * sms)) if fit else None,
            "reg": use["REG"], "stack": use["STACK"], "shared": use["SHARED"],
        })  # fmt: skip
    return out


def waves_summary(rows: list[dict]) -> list[str]:
    """Per M bucket, over the sweep points that timed both: the best multi-wave persistent candidate against the
    best that runs in one wave (median ratio, points where it wins or loses by more than 2%)."""
    by_point: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["waves"] is not None:
            by_point.setdefault((r["dtype"], r["n"], r["m"]), []).append(r)
    ratios: dict[int, list[float]] = {}
    for (_, _, m), rs in by_point.items():
        one = [r["gbps"] for r in rs if r["waves"] == 1]
        many = [r["gbps"] for r in rs if r["waves"] > 1]
        if one and many:
            ratios.setdefault(m, []).append(max(many) / max(one))
    lines = ["rows   points  multi-wave / one-wave best: median  wins >2%  loses >2%"]
    for m in sorted(ratios):
        r = ratios[m]
        wins, losses = sum(x > 1.02 for x in r), sum(x < 0.98 for x in r)
        lines.append(f"{m:>8} {len(r):>6}  {statistics.median(r):>38.3f}  {wins:>8}  {losses:>9}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.kernel_resources", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="32768x4096", help="MxN,... (default %(default)s)")
    parser.add_argument("--dtype", type=cli_args.parse_dtype, default="bf16", help="bf16, fp16 or fp32")
    parser.add_argument("--arch", default="sm_90", help="compile target (default %(default)s)")
    parser.add_argument("--sms", type=int, default=132, help="SM count the heuristics assume (H100: 132)")
    parser.add_argument("--analytic", action="store_true", help="the heuristics' choices, not the tuning table's")
    parser.add_argument("--generic", action="store_true", help="the build without alignment assumptions")
    parser.add_argument("--sass", action="store_true", help="also count each build's instructions (cuobjdump -sass)")
    parser.add_argument("--waves-of", metavar="SWEEP.json", help="a tune_table candidates file: waves of its timings")
    parser.add_argument("--out", help="with --waves-of: write every candidate's row here (JSON)")
    parser.add_argument("--jobs", type=int, default=4, help="with --waves-of: compile processes")
    parser.add_argument("--op", choices=("forward", "backward"), default="forward", help="with --waves-of, --entry")
    parser.add_argument(
        "--entry",
        action="append",
        default=[],
        help="a table candidate to report instead of the dispatcher's choice, e.g. 'gather 1x8192 b0 o4 w16' "
        "(repeat, or separate by commas)",
    )
    args = parser.parse_args(argv)
    from tilegym_rms import aot

    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("kernel_resources.py needs cuobjdump (CUDA toolkit, or the one Triton ships)", file=sys.stderr)
        return 2
    if args.waves_of:
        rows = sweep_waves(json.loads(Path(args.waves_of).read_text()), args.arch, args.sms, args.jobs, args.op)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=0))
        print(f"{len(rows)} persistent {args.op} timings of {args.waves_of}, {args.arch} as launched")
        print("\n".join(waves_summary(rows)))
        return 0
    labels = [part.strip() for text in args.entry for part in text.split(",") if part.strip()]
    if labels:
        print(f"{args.arch}, {args.dtype}, {args.op} table candidates as launched on 16-byte aligned rows; per thread:")
        print("registers, stack bytes; per block: shared bytes")
        for item in args.shapes.split(","):
            m, n = (int(v) for v in item.lower().split("x"))
            print(f"{m} x {n}:")
            for label in labels:
                variant, blocks = _launched(args.op, args.dtype, n, m, label, args.sms)
                cubin = aot.cubin(variant, args.arch, as_launched=True)
                use = resource_usage(cubin, cuobjdump)
                print(f"  {label:<34} REG {use['REG']:>3}  STACK {use['STACK']:>4}  SHARED {use['SHARED']:>6}")
                print(f"    {launch_shape(use, (blocks,), args.arch, args.sms)}")
                if args.sass:
                    print(f"    {sass_summary(instruction_counts(cubin, cuobjdump))}")
        return 0
    dtype = base.DTYPES[args.dtype]
    table, source = chosen_table(args.arch, args.sms, args.analytic)
    build = "the generic build" if args.generic else "as launched on 16-byte aligned rows"
    print(f"{args.arch}, {args.dtype}, {source}, {build}; per thread: registers, stack bytes; per block: shared bytes")
    for item in args.shapes.split(","):
        m, n = (int(v) for v in item.lower().split("x"))
        print(f"{m} x {n}:")
        # What a training call launches for this shape (default dispatch, weight, llama casting).
        grids: dict = {}
        for v in aot.variants_for(m, n, dtype, args.sms, (None,), False, table, grids=grids):
            cubin = aot.cubin(v, args.arch, as_launched=not args.generic)
            use = resource_usage(cubin, cuobjdump)
            print(f"  {v.describe():<96} REG {use['REG']:>3}  STACK {use['STACK']:>4}  SHARED {use['SHARED']:>6}")
            print(f"    {launch_shape(use, grids[v], args.arch, args.sms)}")
            if args.sass:
                print(f"    {sass_summary(instruction_counts(cubin, cuobjdump))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
