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
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
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


def resource_usage(cubin: bytes, cuobjdump: str) -> dict[str, int]:
    """``{"REG": .., "STACK": .., "SHARED": .., "LOCAL": .., "THREADS": ..}`` of the single kernel in ``cubin``
    (``THREADS``: the block size the kernel requires, 0 where it names none)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        elf = subprocess.run([cuobjdump, "-elf", f.name], capture_output=True, text=True, check=True).stdout
    use = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    ntid = re.search(r"EIATTR_REQNTID\s+Format:\s+\S+\s+Value:\s+((?:0x[0-9a-f]+\s*)+)", elf)
    use["THREADS"] = 0 if ntid is None else math.prod(int(v, 16) for v in ntid.group(1).split())
    return use


# Per-SM limits of the occupancy calculation, by compile target: registers, shared memory (bytes, the
# largest carve-out), threads, blocks, and the shared memory the driver reserves per block.
SM_LIMITS = {
    "sm_80": {"regs": 65536, "shared": 167936, "threads": 2048, "blocks": 32, "reserved": 1024},
    "sm_90": {"regs": 65536, "shared": 233472, "threads": 2048, "blocks": 32, "reserved": 1024},
    "sm_100": {"regs": 65536, "shared": 233472, "threads": 2048, "blocks": 32, "reserved": 1024},
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
    by_shared = lim["shared"] // (use["SHARED"] + lim["reserved"])
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.kernel_resources", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="32768x4096", help="MxN,... (default %(default)s)")
    parser.add_argument("--dtype", type=cli_args.parse_dtype, default="bf16", help="bf16, fp16 or fp32")
    parser.add_argument("--arch", default="sm_90", help="compile target (default %(default)s)")
    parser.add_argument("--sms", type=int, default=132, help="SM count the heuristics assume (H100: 132)")
    parser.add_argument("--analytic", action="store_true", help="the heuristics' choices, not the tuning table's")
    parser.add_argument("--generic", action="store_true", help="the build without alignment assumptions")
    args = parser.parse_args(argv)
    from tilegym_rms import aot

    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("kernel_resources.py needs cuobjdump (CUDA toolkit, or the one Triton ships)", file=sys.stderr)
        return 2
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
            use = resource_usage(aot.cubin(v, args.arch, as_launched=not args.generic), cuobjdump)
            print(f"  {v.describe():<96} REG {use['REG']:>3}  STACK {use['STACK']:>4}  SHARED {use['SHARED']:>6}")
            print(f"    {launch_shape(use, grids[v], args.arch, args.sms)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
