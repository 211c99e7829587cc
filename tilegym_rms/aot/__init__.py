"""Compile check: every cuTile kernel variant the dispatcher can select compiles to a cubin.

Needs no GPU, only ``cuda-tile`` and the matched tileiras toolchain. Run it as
``python -m tilegym_rms.aot [--arch sm_90 ...]`` or ``tilegym-rms aot``: it prints a table and
exits non-zero on any failure. The variants are what the host launches (:mod:`tilegym_rms.cutile.host`: its
own functions run on meta tensors, each launch recorded instead of made) under the heuristics and the shipped
tuning tables, over a representative set of hidden sizes (the arithmetic-only axes, other dtypes than bf16
included, at one width per tile class, ``TILE_CLASS_N``).

The variants of each kernel family live beside their grids: :mod:`.norm` (the plain norm, the fused add and the
dw reduction), :mod:`.qk`, :mod:`.gated` and :mod:`.fp8`; :mod:`.variant` is what they record, :mod:`.build`
compiles one.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from ..cutile import _toolchain_status
from .build import compile_timed, cubin
from .fp8 import FP8_KERNEL, fp8_arch, fp8_variants
from .gated import gated_variants, gated_variants_for
from .norm import fused_add_variants_for, norm_variants, reduction_variants, variants_for
from .qk import QK_HEADS_RATIO, QK_REPRESENTATIVE_D, QK_TAIL_D, qk_variants, qk_variants_for
from .variant import REFERENCE_SMS, Variant, params_of

__all__ = [
    "ARCHS", "FP8_KERNEL", "QK_REPRESENTATIVE_D", "QK_TAIL_D", "REFERENCE_SMS", "Variant", "cubin", "fp8_arch",
    "fp8_variants", "fused_add_variants_for", "gated_variants", "gated_variants_for", "main", "params_of",
    "qk_variants", "run", "table_arch", "table_variants", "variants", "variants_for",
]  # fmt: skip

ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")


def variants(arch: str | None = None) -> list[Variant]:
    """The distinct kernel variants reachable from the dispatcher over the representative grid, plus the
    measured winners of the tuning tables for ``arch`` (None: of every table). An arch without fp8 types
    (``cutile.FP8_MIN_CC``) gets no FP8 kernel: the host quantizes after the norm there."""
    found = dict.fromkeys(_heuristic_variants())
    found.update(dict.fromkeys(table_variants(arch)))
    if arch is not None and not fp8_arch(arch):
        return [v for v in found if v.kernel_name != FP8_KERNEL]
    return list(found)


def _heuristic_variants() -> list[Variant]:
    """What the heuristics (``config.HEURISTICS``, as overridden at the call) launch over the representative grids
    of every kernel family."""
    found: dict[Variant, None] = {}
    for family in (qk_variants, gated_variants, fp8_variants, norm_variants, reduction_variants):
        found.update(dict.fromkeys(family()))
    return list(found)


def table_arch(doc: dict) -> str:
    """The compile target of a tuning table's device class, e.g. ``"sm_90"`` for ``sm90_132sm``."""
    major, minor = doc["device"]["capability"]
    return f"sm_{major}{minor}"


def table_variants(arch: str | None = None) -> list[Variant]:
    """The variants the shipped tuning tables' measured winners launch (bench/tools/tune_table.py may pick tiles,
    hints and kernels the heuristics never do; analytic entries are the heuristics', covered above): a
    training call's variants at each measured run; the fused add's forward (both modes, with and without the
    rstd store, x and the residual of one dtype) for every dtype whose fused add runs on that entry
    (:func:`_fused_add_users`: a fused entry, one borrowed from the other 16-bit dtype, or the plain forward's
    where no fused entry serves the width); a backward winner's also with the residual gradient, as the fused add
    runs it. A winner's constants do not depend on N within its bucket, so the bucket's own width stands for
    every N in it.

    With ``arch``, only the tables of that compile target: a table applies to its own device class alone
    (other devices fall back to the heuristics), so its winners need no cubin for the other archs."""
    from ..cutile import tuning

    found: dict[Variant, None] = {}
    for key in tuning.packaged_keys():
        table = tuning.packaged(key)
        if arch is not None and table_arch(table.doc) != arch:
            continue
        sms = table.doc["device"]["sms"]
        for op in tuning.OPS:
            for dt, by_n in table.doc.get(op, {}).items():
                dtype = tuning.DTYPES[dt]
                for n_b, runs in by_n.items():
                    users = _fused_add_users(table.doc, op, dt, n_b) if op in tuning.FORWARD_OPS else []
                    for run in (r for r in runs if "gbps" in r):
                        more = []
                        if op == "qk":  # k's rows: q's and k's together fall in the run's M bucket
                            m_k = max(1, run["m"] // (QK_HEADS_RATIO + 1))
                            more = qk_variants_for(m_k, int(n_b), dtype, sms, False, table)
                        elif op != "fused_forward":
                            more = variants_for(run["m"], int(n_b), dtype, sms, (None,), False, table)
                        for user in users:
                            udt = tuning.DTYPES[user]
                            more += fused_add_variants_for(
                                run["m"], int(n_b), udt, udt, sms, (None,), table, every_mode=True
                            )
                        if op == "backward":  # the fused add's backward (HAS_DRES) runs on the same winner
                            more += fused_add_variants_for(run["m"], int(n_b), dtype, dtype, sms, (), table)
                        found.update(dict.fromkeys(more))
    return list(found)


def _fused_add_users(doc: dict, op: str, dt: str, n_b: str) -> list[str]:
    """The dtypes whose fused add's forward at bucket ``n_b`` runs on ``doc``'s ``op`` entry of ``dt``: those for
    which it is the first entry ``doc`` holds along their fallback chain (``tuning.fallback_chain``), as the
    host's lookup takes it."""
    from ..cutile import tuning

    def has_entry(o, d):
        return n_b in doc.get(o, {}).get(d, {})

    return [u for u in tuning.DTYPES if tuning.serving_entry("fused_forward", u, has_entry) == (op, dt)]


def run(archs=ARCHS, jobs: int = 2, out=sys.stdout, only: list[Variant] | None = None) -> int:
    """Compiles every variant (or those of ``only``) for every arch, prints a table; returns the number of
    failures. ``jobs`` > 1 compiles in that many processes: cuda.tile holds one process-wide lock over each
    whole compile (tileiras included), so threads would take turns."""
    todo = [(v, a) for a in archs for v in (variants(a) if only is None else only)]
    failures = 0
    print(f"{'variant':<72} {'arch':<7} {'cubin':>8} {'s':>5}  result", file=out)
    if jobs > 1:
        # spawn: a fresh interpreter per worker, never a fork of one that may hold torch's threads
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
    else:
        pool = ThreadPoolExecutor(max_workers=1)
    with pool:
        for (v, a), (size, err, secs) in zip(todo, pool.map(compile_timed, todo, chunksize=4), strict=True):
            failures += err is not None
            print(f"{v.describe():<72} {a:<7} {size:>8} {secs:>5.1f}  {err or 'ok'}", file=out, flush=True)
    print(
        f"{len(todo) - failures} compiled, {failures} failed ({len(todo)} variant-arch pairs, {len(archs)} archs)",
        file=out,
    )
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tilegym-rms aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=ARCHS, help="target (repeatable); default: all four")
    parser.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    args = parser.parse_args(argv)
    # Without cuda.tile (the [cuda] extra) or its compiler every variant would fail alike: say so once.
    ok, why = _toolchain_status()
    if not ok:
        parser.exit(2, f"{parser.prog}: error: {why}\n")
    return 1 if run(tuple(args.arch or ARCHS), args.jobs) else 0
