"""Writing tuning tables: the analytic table, the sweep's candidates and winner rule, merge and overlay.

The tools of ``bench/tools/tune_table.py`` (and the tests); the host never imports this module: it reads tables
through :mod:`tilegym_rms.cutile.tuning` (schema, validation, lookup, the table of a device).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .. import config
from ..config import QKCandidate
from . import (
    DTYPES,
    FORWARD_OPS,
    M_BUCKET_MAX,
    M_BUCKETS,
    N_BUCKETS,
    OPS,
    SCHEMA,
    Table,
    TuningTableError,
    candidate_error,
    class_of,
    fallback_chain,
    m_bucket,
    n_bucket,
    parse_winner,
)

# The ops the analytic table writes at every bucket; the others are optional, absent unless measured.
ANALYTIC_OPS = ("forward", "backward")
# The forward kernels a sweep times and a table may ship. Not the split: its blocks wait on each other, and one of
# its builds never finished in the GPU suite (PERFORMANCE.md, "A row over several blocks"); it runs only when
# named until its GPU tests pass in the suite on every card it could ship for.
TABLE_FORWARD_KERNELS = tuple(k for k in config.FORWARD_KERNELS if k != "split")


def is_card_of(key: str, class_key_: str) -> bool:
    """Whether ``key`` is a card key (:func:`~tilegym_rms.cutile.tuning.card_key`) of the class ``class_key_``,
    not the class key itself."""
    return key != class_key_ and class_of(key) == class_key_


def label(op: str, cand) -> str:
    """A candidate in one short string (the keys of a run's ``gbps``; a qk candidate: its two halves')."""
    if op == "qk":
        return " | ".join(qk_half_label(cand, side) for side in ("fwd", "bwd"))
    kind = cand.kernel if op in FORWARD_OPS else cand.strategy
    tail = f"+{cand.tail_n}" if cand.tail_n else ""
    return f"{kind} {cand.tile_m}x{cand.tile_n}{tail} b{cand.blocks_per_sm} o{cand.occupancy} w{cand.num_worker_warps}"


_LABEL = re.compile(r"(\w+) (\d+)x(\d+)(?:\+(\d+))? b(\d+) o(\d+) w(\d+)")


def parse_label(op: str, text: str):
    """The candidate a :func:`label` names (a forward or backward op's, e.g. ``"persistent 2x4096+1024 b4 o2 w0"``),
    checked as a table's winner is; raises :class:`TuningTableError`."""
    if op == "qk":
        raise TuningTableError("qk candidates have no single label to parse (two halves)")
    found = _LABEL.fullmatch(text.strip())
    if not found:
        raise TuningTableError(f"{text!r} is not a candidate label like 'persistent 2x4096+1024 b4 o2 w0'")
    kind, *numbers = found.groups()
    names = ("tile_m", "tile_n", "tail_n", "blocks_per_sm", "occupancy", "num_worker_warps")
    first = "kernel" if op in FORWARD_OPS else "strategy"
    return parse_winner(op, {first: kind, **{k: int(v or 0) for k, v in zip(names, numbers, strict=True)}}, text)


def with_winner(doc: dict, op: str, dtype: str, m_b: int, n: int, cand) -> dict:
    """A copy of ``doc`` whose ``op`` entry for ``dtype`` and N's bucket gives ``cand`` at M bucket ``m_b`` alone:
    the other M buckets keep the winners they had (the op's fallback's or the analytic ones where ``doc`` has no
    such entry). For timing a candidate at row counts between bucket points (``tune_cutile.py --entry``)."""
    n_b = n_bucket(n)
    why = "is wider than every bucket" if n_b is None else candidate_error(op, cand, n_b)
    if why:
        raise TuningTableError(f"{label(op, cand)} cannot serve N = {n} ({op}): {why}")
    out = json.loads(json.dumps(doc))
    runs = _reference_runs(out, out, op, dtype, str(n_b))
    after = [{"m": m_b * 2, "winner": _winner_at(runs, m_b * 2)}] if m_b < M_BUCKET_MAX else []
    kept = [r for r in runs if r["m"] < m_b] + [{"m": m_b, "winner": asdict(cand)}] + after
    kept += [r for r in runs if r["m"] > m_b * 2]
    set_runs(out, op, dtype, n_b, kept)
    return out


def qk_half_label(cand: QKCandidate, side: str) -> str:
    """The forward ("fwd") or backward ("bwd") half of a qk candidate, e.g. ``"fwd 32r b8 o2"``."""
    tile_m, blocks, occupancy = (getattr(cand, f"{side}_{k}") for k in ("tile_m", "blocks_per_sm", "occupancy"))
    return f"{side} {tile_m}r b{blocks} o{occupancy}"


def new_doc(key: str, name: str, capability, sms: int, source: str, generated_by: str) -> dict:
    return {
        "schema": SCHEMA,
        "device": {"key": key, "name": name, "capability": list(capability), "sms": sms},
        "source": source,
        "generated_by": generated_by,
        **{op: {} for op in OPS},
    }


def set_runs(doc: dict, op: str, dtype: str, n_b: int, runs: list[dict]) -> None:
    doc.setdefault(op, {}).setdefault(dtype, {})[str(n_b)] = sorted(runs, key=lambda r: r["m"])


def analytic_runs(op: str, dtype: torch.dtype, n_b: int, sms: int) -> list[dict]:
    """The analytic heuristics' choice at every M bucket of ``n_b``, as runs (equal neighbours merged)."""
    runs = []
    for m in M_BUCKETS:
        if op in FORWARD_OPS:
            cand = config.forward_candidate(m, n_b, dtype, sms)
        elif op == "qk":
            cand = config.qk_candidate(m, n_b, dtype, sms)
        else:
            cand = config.backward_candidate(m, n_b, dtype, sms)
        if not runs or runs[-1]["winner"] != asdict(cand):
            runs.append({"m": m, "winner": asdict(cand)})
    return runs


def analytic_doc(key: str, name: str, capability, sms: int, generated_by: str) -> dict:
    """A table holding the analytic heuristics' decisions at every bucket point (``"source": "analytic"``)."""
    doc = new_doc(key, name, capability, sms, "analytic", generated_by)
    for op in ANALYTIC_OPS:
        for dt, dtype in DTYPES.items():
            for n_b in N_BUCKETS:
                set_runs(doc, op, dt, n_b, analytic_runs(op, dtype, n_b, sms))
    return doc


def candidates(op: str, m_b: int, n_b: int, dtype: torch.dtype, sms: int, wide: bool = False) -> list:
    """What the sweep times at one bucket, the analytic choice first, then a few neighbours valid for the
    bucket: the other forward kernels (:data:`TABLE_FORWARD_KERNELS`, their analytic tiles), or the persistent
    backward strategy in place of the direct one; twice the blocks per SM (only the grid changes: no compile);
    twice the rows per tile of a persistent tile, or twice the gather kernel's occupancy hint (one compiled
    variant each). Few on purpose: compiles dominate a sweep's time, see ``bench/tools/tune_table.py
    --estimate``.

    ``wide`` reaches further where the quick neighbours left a gap to the peers: four times the blocks per
    SM (up to 64 times for the persistent forward), half the rows per tile, and occupancy hints of two and
    four times the analytic one (for qk on both halves, and qk forwards of one tile per block; for the forward
    ops on both kernels, and the one-tile-per-block forward's builds); for rows wider than a chunk, the gather's
    chunks at half their width, at twice each occupancy hint; for a padded forward row of the persistent or the
    one-tile-per-block kernel, the row as a tile plus a tail tile (:func:`_add_split_row_builds`); and
    one-block-per-SM builds of each persistent tile shape, with eight warps and at occupancy 1
    (:func:`_add_one_block_builds`)."""
    out: list = []

    def add(cand):
        if cand not in out and candidate_error(op, cand, n_b) is None:
            out.append(cand)

    scales = (1, 2, 4) if wide else (1, 2)
    if op == "qk":  # each half: half, the same or twice the rows per tile, once or twice the blocks per SM
        base = config.qk_candidate(m_b, n_b, dtype, sms)
        add(base)
        for side in ("fwd", "bwd"):
            tile_m, blocks, occ = (getattr(base, f"{side}_{k}") for k in ("tile_m", "blocks_per_sm", "occupancy"))
            occupancies = (occ, max(1, occ) * 2, max(1, occ) * 4) if wide else (occ,)
            for t in (max(1, tile_m // 2), tile_m, tile_m * 2):
                for b in scales:
                    for o in occupancies:
                        fields = {"tile_m": t, "blocks_per_sm": blocks * b, "occupancy": o}
                        add(replace(base, **{f"{side}_{k}": v for k, v in fields.items()}))
        if wide:  # one forward tile per block without the walk, around the plain forward's analytic "tiles"
            tiles = config.forward_candidate(m_b, n_b, dtype, sms, "tiles")
            for t in (max(1, tiles.tile_m // 2), tiles.tile_m, tiles.tile_m * 2):
                for o in (max(1, tiles.occupancy // 2), tiles.occupancy, tiles.occupancy * 2):
                    add(replace(base, fwd_tile_m=t, fwd_blocks_per_sm=0, fwd_occupancy=o))
            # the plain norm's choice for rows of one head (its measured short-row settings)
            f = config.forward_candidate(m_b, n_b, dtype, sms, "persistent")
            b = config.backward_candidate(m_b, n_b, dtype, sms)
            add(replace(base, fwd_tile_m=f.tile_m, fwd_blocks_per_sm=f.blocks_per_sm, fwd_occupancy=f.occupancy))
            add(replace(base, bwd_tile_m=b.tile_m, bwd_blocks_per_sm=b.blocks_per_sm, bwd_occupancy=b.occupancy))
        return out
    if op in FORWARD_OPS:  # the fused forward tries the plain forward's candidates
        add(config.forward_candidate(m_b, n_b, dtype, sms))
        for kernel in TABLE_FORWARD_KERNELS:
            try:
                base = config.forward_candidate(m_b, n_b, dtype, sms, kernel)
            except ValueError:
                continue  # persistent: rows too wide
            add(base)
            occupancies = [max(1, base.occupancy) * o for o in (2, 4)] if wide else [max(1, base.occupancy * 2)]
            if kernel == "gather":  # one row or one chunk per block: only the hints to vary
                for occupancy in occupancies:
                    add(replace(base, occupancy=occupancy))
                chunk = config.current().fwd_chunk_n  # the chunk the analytic candidates use
                if wide and n_b > chunk:  # wide rows: narrower chunks, more blocks resident
                    for o in (max(1, base.occupancy), *occupancies):
                        add(replace(base, tile_n=chunk // 2, occupancy=o * 2))
                continue
            if kernel == "tiles":  # the quick set times its analytic tiles only
                if wide:
                    _add_tile_builds(add, base, occupancies)
                    _add_split_row_builds(add, base, n_b)
                continue
            if not wide:
                add(replace(base, blocks_per_sm=base.blocks_per_sm * 2))
                add(replace(base, tile_m=base.tile_m * 2))
                continue
            # 16 and 64 times the blocks: at most one row tile per block at large M (no persistence),
            # with the hardware keeping as many blocks resident as the registers allow.
            for tile_m in (base.tile_m // 2, base.tile_m, base.tile_m * 2):
                for b in (1, 2, 4, 16, 64):
                    add(replace(base, tile_m=tile_m, blocks_per_sm=base.blocks_per_sm * b))
            for occupancy in occupancies:
                for b in (1, 16):
                    add(replace(base, occupancy=occupancy, blocks_per_sm=base.blocks_per_sm * b))
            _add_split_row_builds(add, base, n_b)
        if wide:
            _add_one_block_builds(add, out, "kernel")
        return out
    base = config.backward_candidate(m_b, n_b, dtype, sms)
    add(base)
    if base.strategy == "direct":  # what the direct strategy replaced at this M
        base = config.backward_candidate(m_b, n_b, dtype, sms, replace(config.HEURISTICS, bwd_direct_max_rows_per_sm=0))
        add(base)
    for b in scales[1:]:
        add(replace(base, blocks_per_sm=base.blocks_per_sm * b))
    add(replace(base, tile_m=base.tile_m * 2))
    if wide:
        add(replace(base, tile_m=base.tile_m // 2))
        _add_one_block_builds(add, out, "strategy")
    return out


def _add_split_row_builds(add, base, n_b: int) -> None:
    """The wide set's padded rows held as a tile plus a tail tile (``config.split_row``: 2304 = 2048 + 256), which
    the analytic choice keeps for the widest persistent rows only: fewer padded registers and shared bytes per row.
    Persistent: once and twice the rows, the occupancy hint and twice it, once and twice the blocks. One tile per
    block (``"tiles"``): once to four times the rows at the hint and half of it (its winners took taller tiles and
    lower hints than the analytic ones; blocks per SM stay 0)."""
    tile_n, tail_n = config.split_row(n_b)
    if not tail_n or base.tail_n:
        return
    o = base.occupancy
    if base.kernel == "tiles":
        tile_ms, occupancies = (base.tile_m, base.tile_m * 2, base.tile_m * 4), (max(1, o // 2), o)
    else:
        tile_ms, occupancies = (base.tile_m, base.tile_m * 2), (o, max(1, o) * 2)
    for tile_m in tile_ms:
        for occupancy in occupancies:
            for b in (1, 2):
                split = dict(tile_n=tile_n, tail_n=tail_n, tile_m=tile_m, occupancy=occupancy)
                add(replace(base, **split, blocks_per_sm=base.blocks_per_sm * b))


def _add_tile_builds(add, base, occupancies: list[int]) -> None:
    """The wide set's neighbours of the one-tile-per-block forward (``"tiles"``): half to four times the rows,
    occupancy hints of two and four times the analytic one, each with the compiler's warps and with eight. Without
    a load ring, bytes in flight per SM come from the resident blocks (the hint) times each block's tile
    (PERFORMANCE.md, "Narrow rows")."""
    for tile_m in (max(1, base.tile_m // 2), base.tile_m, base.tile_m * 2, base.tile_m * 4):
        for occupancy in (base.occupancy, *occupancies):
            for warps in (0, 8):
                add(replace(base, tile_m=tile_m, occupancy=occupancy, num_worker_warps=warps))


def _add_one_block_builds(add, out: list, kind: str) -> None:
    """The wide set's one-block-per-SM builds of each persistent tile shape in ``out`` that leaves the warps to
    the compiler: with eight warps, and with the compiler's warps at occupancy 1. As launched on aligned rows the
    compiler stages row tiles in a ring of shared memory sized by the occupancy hint: at occupancy 1 about five
    32 KB tiles, at occupancy 2 three, at 4 one (PERFORMANCE.md, "Toolchain"), so these are the builds with
    the most of a block's own loads in flight."""
    shapes = {(c.tile_m, c.tile_n, c.tail_n): c for c in out if getattr(c, kind) == "persistent"}
    for c in shapes.values():
        if not c.num_worker_warps:
            add(replace(c, blocks_per_sm=1, occupancy=1, num_worker_warps=8))
            add(replace(c, blocks_per_sm=1, occupancy=1))


def span_rows(m_b: int) -> int | None:
    """Rows of the second point ``tune_table --span`` times in M bucket ``m_b``: 5/8 of its rows, among those
    that take the bucket's winner (from half its rows, exclusive, up to them); None for a bucket too small."""
    m = m_b * 5 // 8
    return m if m > m_b // 2 else None


def scores(run: dict) -> dict[str, float]:
    """What a measured run's winner is chosen by, per candidate: its GB/s at the bucket point, or where the run
    also timed a point inside the bucket (``"span"``: ``{"m": rows, "gbps": {...}}``), the geometric mean of
    the two, for the candidates timed at both: a bucket's winner serves every row count in it."""
    span = run.get("span")
    if not span:
        return run["gbps"]
    other = span["gbps"]
    return {k: math.sqrt(v * other[k]) for k, v in run["gbps"].items() if k in other}


def select_winner(gbps: dict[str, float], default: str, min_gain: float = 0.01) -> str:
    """The fastest candidate, unless it beats ``default`` (the analytic choice) by less than ``min_gain``:
    timing noise is then no reason to change a decision."""
    if not gbps:
        raise ValueError("no candidate was measured")
    best = max(gbps, key=gbps.get)
    if default in gbps and gbps[best] < gbps[default] * (1 + min_gain):
        return default
    return best


def measured(runs: list[dict]) -> bool:
    return all("gbps" in r for r in runs)


def merge(base: dict, new: dict) -> dict:
    """``new`` over ``base`` (same device): a measured run list replaces an analytic one of the same
    (op, dtype, N); two measured lists merge by M, ``new`` winning. ``source`` follows what remains."""
    if base["device"]["key"] != new["device"]["key"]:
        raise TuningTableError(f"cannot merge tables of {base['device']['key']} and {new['device']['key']}")
    # The key (compute capability, SM count) does not tell every card apart: an H200 has an H100 SXM's. A
    # sweep measured on one must not land in the other's table.
    names = base["device"].get("name"), new["device"].get("name")
    if all(names) and names[0] != names[1]:
        raise TuningTableError(
            f"cannot merge a table measured on {names[1]!r} into one of {names[0]!r}: the same key "
            f"({base['device']['key']}) but another card"
        )
    out = json.loads(json.dumps(base))
    out["generated_by"] = new["generated_by"]
    if "copy_gbps" in new:
        out["copy_gbps"] = new["copy_gbps"]
    for op in OPS:
        for dt, by_n in new.get(op, {}).items():
            for key, runs in by_n.items():
                old = out.get(op, {}).get(dt, {}).get(key)
                if old is not None and measured(old) and measured(runs):
                    runs = list({r["m"]: r for r in old + runs}.values())
                set_runs(out, op, dt, int(key), runs)
    out["source"] = source_of(out)
    return out


def card_start(class_doc: dict, device: dict) -> dict:
    """A card's first table, begun from its class's table measured on another card of the class (see
    :func:`card_key`). It holds the class's winners under the card's own ``device`` entry, with ``based_on``
    naming the card they were measured on; their timings are left out (they are that card's). A sweep on the
    card laid over it (``tune_table.py --overlay SWEEP --base <class table>``) then keeps the choice the card
    runs today at every bucket the sweep did not measure, not the heuristics'."""
    class_key_ = class_doc["device"]["key"]
    if not is_card_of(device["key"], class_key_):
        raise TuningTableError(f"{device['key']!r} is not the key of a card of class {class_key_!r}")
    out = json.loads(json.dumps(class_doc))
    out["device"] = dict(device)
    out["based_on"] = class_doc["device"]
    for op in OPS:
        for dt, by_n in class_doc.get(op, {}).items():
            for key, runs in by_n.items():
                set_runs(out, op, dt, int(key), [{"m": r["m"], "winner": r["winner"]} for r in runs])
    out["source"] = source_of(out)
    return out


def _winner_at(runs: list[dict], m_b: int) -> dict:
    """The winner a run list gives M bucket ``m_b`` (the floor rule of :meth:`Table.lookup`)."""
    return next((r["winner"] for r in reversed(runs) if r["m"] <= m_b), runs[0]["winner"])


def _reference_runs(doc: dict, before: dict, op: str, dt: str, key: str) -> list[dict]:
    """The runs the host would follow for (op, dtype, N) in ``doc`` without a new measurement: the first entry
    of its fallback chain (:func:`fallback_chain`) that ``doc`` has, else the analytic heuristics' of the chain's
    last op. Another dtype's entry comes from ``before`` (the table before the sweep), so that the dtypes of one
    sweep are each measured against what ran before it, not against each other, in whatever order."""
    chain = fallback_chain(op, dt, lambda o, d: bool(doc.get(o, {}).get(d, {}).get(key)))
    for step_op, step_dt in chain:
        runs = (doc if step_dt == dt else before).get(step_op, {}).get(step_dt, {}).get(key)
        if runs:
            return runs
    return analytic_runs(chain[-1][0], DTYPES[dt], int(key), doc["device"]["sms"])


def _incumbent_kept(op: str, run: dict, incumbent: dict, min_gain: float) -> dict:
    """A measured sweep ``run`` whose winner yields to ``incumbent`` (what the base launches at that M bucket)
    when the sweep timed the incumbent too and its winner beats it by less than ``min_gain`` (by :func:`scores`):
    as the sweep's own rule keeps the analytic choice (:func:`select_winner`), so a re-timed table keeps its
    choices within the noise. A qk run is timed by halves: each half (forward, backward) yields on its own."""
    if run["winner"] == incumbent:
        return run
    gbps = scores(run)
    if op == "qk":
        kept, timed = parse_winner(op, incumbent, "incumbent"), parse_winner(op, run["winner"], "winner")
        winner = dict(run["winner"])
        for side in ("fwd", "bwd"):
            mine, theirs = gbps.get(qk_half_label(kept, side)), gbps.get(qk_half_label(timed, side))
            if mine is not None and theirs is not None and theirs < mine * (1 + min_gain):
                winner.update({k: v for k, v in incumbent.items() if k.startswith(f"{side}_")})
        return {**run, "winner": winner}
    mine = gbps.get(label(op, parse_winner(op, incumbent, "incumbent")))
    theirs = gbps.get(label(op, parse_winner(op, run["winner"], "winner")))
    if mine is None or theirs is None or theirs >= mine * (1 + min_gain):
        return run
    return {**run, "winner": incumbent}


# What a run's "kept" says where the overlay kept the base's winner over the sweep's (keep_base): the run's GB/s show
# the sweep's winner ahead, and this is why it does not launch.
KEPT_BY_AB = "the table before: an A/B rejected the sweep's winner at this bucket"


def _with_the_bases_other_half(run: dict, base_runs: list[dict]) -> dict:
    """A qk ``run`` that timed one half (``tune_table --qk-half``) with the timings of the other half that the
    base's run at its bucket holds: the run replaces the base's whole, and its winner's other half is the launch
    the base chose there from those timings (the table the sweep ran on), which stay its evidence."""
    base_run = next((r for r in base_runs if r["m"] == run["m"] and "gbps" in r), None)
    if base_run is None or "gbps" not in run:
        return run
    timed_halves = {label.split(" ", 1)[0] for label in run["gbps"]}
    other = {k: v for k, v in base_run["gbps"].items() if k.split(" ", 1)[0] not in timed_halves}
    return {**run, "gbps": {**other, **run["gbps"]}} if other else run


def overlay(base: dict, sweep: dict, min_gain: float = 0.01, keep_base: Iterable[tuple] = ()) -> dict:
    """A sparse sweep (a few M buckets) laid over ``base`` (the analytic table, or a shipped table whose other entries
    must stay), M bucket by M bucket: a measured winner stands for the buckets above its own while the base's choice
    there stays the one it was measured against (so M buckets where the heuristics switch kernel, e.g. to the gather
    forward at many rows, keep their switch), or where the sweep's next measured bucket chose the same winner (two
    measurements that agree outrank a switch the base only predicts between them), and buckets below the first
    measured one keep the base's choice. For an op without a base entry the base is what the host would fall back
    to (``tuning.fallback_chain``): the fused forward the other 16-bit dtype's fused entry in ``base``, else the
    forward's entry (already overlaid), the qk op and the rest the analytic heuristics.
    Entries the sweep did not measure stay as in ``base``, and so do the base's own measured runs at M buckets the
    sweep did not measure: a sweep winner stands for the buckets above its own only up to the next bucket either
    table measured. At a bucket the sweep measured, the winner the base launched there stays unless the sweep's
    beats it by ``min_gain`` (:func:`_incumbent_kept`), and at the buckets ``keep_base`` names (``(op, dtype, N, M)``,
    from :func:`leave_out`: where an A/B rejected the sweep's winner) it stays whatever the sweep timed (for an op
    without a base entry, what the fallback would launch there)."""
    keep_base = set(keep_base)
    out = merge(base, {**sweep, **{op: {} for op in OPS}})
    for op in OPS:  # in order: the forward is overlaid before the fused forward falls back to it
        for dt, by_n in sweep.get(op, {}).items():
            for key, measured_runs in by_n.items():
                ref_runs = _reference_runs(out, base, op, dt, key)
                measured_runs = [
                    {**r, "winner": _winner_at(ref_runs, r["m"]), "kept": KEPT_BY_AB}
                    if (op, dt, key, r["m"]) in keep_base
                    else _incumbent_kept(op, r, _winner_at(ref_runs, r["m"]), min_gain)
                    for r in measured_runs
                ]
                own = out.get(op, {}).get(dt, {}).get(key) or []  # not a fallback's: measured for another op
                if op == "qk":
                    measured_runs = [_with_the_bases_other_half(r, own) for r in measured_runs]
                points = {r["m"]: r for r in measured_runs}
                base_points = {r["m"]: r for r in own if "gbps" in r and r["m"] not in points}
                runs: list[dict] = []
                for m_b in M_BUCKETS:
                    below = [r for r in measured_runs if r["m"] <= m_b]
                    ref = below[-1] if below else None
                    if ref is not None and any(ref["m"] < p <= m_b for p in base_points):
                        ref = None  # the base measured a bucket nearer to this one: its choice stands
                    above = next((r for r in measured_runs if r["m"] > m_b), None)
                    agreed = (
                        ref is not None
                        and above is not None
                        and above["winner"] == ref["winner"]
                        and not any(ref["m"] < p < above["m"] for p in base_points)
                    )
                    if ref is not None and (agreed or _winner_at(ref_runs, m_b) == _winner_at(ref_runs, ref["m"])):
                        winner = ref["winner"]
                    else:
                        winner = _winner_at(ref_runs, m_b)
                    kept = points.get(m_b) or (base_points.get(m_b) if ref is None else None)
                    if kept is not None:
                        runs.append(kept)  # kept whole: its timings document the choice
                    elif not runs or runs[-1]["winner"] != winner:
                        runs.append({"m": m_b, "winner": winner})
                set_runs(out, op, dt, int(key), runs)
    out["source"] = "mixed"
    return out


def without(doc: dict, entries: Iterable[str]) -> dict:
    """A copy of ``doc`` less the entries named: ``"op/dtype/N"`` (N a bucket point the doc has) or ``"op/dtype"``
    (every width of that dtype): the part of a sweep an A/B rejected or has not timed yet, so that the table
    shipped is the overlay of the committed sweep less those. Each name must name entries of ``doc`` itself; names
    may overlap."""
    out = json.loads(json.dumps(doc))
    for entry in entries:
        parts = entry.split("/")
        op, dt, n = (parts + [None])[:3] if len(parts) in (2, 3) else ("", "", "")
        by_n = doc.get(op, {}).get(dt, {})
        if not by_n or (n is not None and n not in by_n):
            raise TuningTableError(
                f"{entry!r} names no entry of the sweep (op/dtype/N or op/dtype, e.g. forward/bf16/8192; "
                "op/dtype/N/M for one measured bucket)"
            )
        left = out[op].get(dt, {})
        for key in list(left) if n is None else [n]:
            left.pop(key, None)
        if not left:
            out[op].pop(dt, None)
    return out


def leave_out(doc: dict, entries: Iterable[str]) -> tuple[dict, set[tuple[str, str, str, int]]]:
    """A sweep ``doc`` less the entries named, for :func:`overlay`: ``"op/dtype/N"`` and ``"op/dtype"`` leave out
    a width or a dtype (:func:`without`); ``"op/dtype/N/M"`` (M a bucket the sweep timed at that width) keeps the
    base's winner at that bucket, returned as ``(op, dtype, N, M)`` for ``overlay``'s ``keep_base`` (a qk winner
    whole: both halves). A name the sweep lacks, or a bucket inside a width or dtype also left out, is refused."""
    entries = list(entries)
    buckets, whole = [e for e in entries if e.count("/") == 3], [e for e in entries if e.count("/") != 3]
    keep = set()
    for entry in buckets:
        op, dt, n, m = entry.split("/")
        runs = doc.get(op, {}).get(dt, {}).get(n, [])
        if not re.fullmatch(r"[0-9]+", m) or int(m) not in {r["m"] for r in runs}:
            raise TuningTableError(f"{entry!r} names no run of the sweep (op/dtype/N/M, e.g. backward/bf16/1152/32768)")
        if f"{op}/{dt}" in whole or f"{op}/{dt}/{n}" in whole:
            raise TuningTableError(f"{entry!r} lies in a width or dtype that is left out whole")
        keep.add((op, dt, n, int(m)))
    return without(doc, whole), keep


def source_of(doc: dict) -> str:
    kinds = {measured(runs) for op in OPS for by_n in doc.get(op, {}).values() for runs in by_n.values()}
    return "mixed" if len(kinds) > 1 else ("measured" if kinds == {True} else "analytic")


def _timed_labels(op: str, winner: dict) -> set[str]:
    """The keys under which a sweep timed ``winner`` in a run's ``gbps`` (a qk winner: each half's)."""
    cand = parse_winner(op, winner, "winner")
    return {qk_half_label(cand, side) for side in ("fwd", "bwd")} if op == "qk" else {label(op, cand)}


def slim(doc: dict) -> dict:
    """The table to ship from one a sweep wrote: each run's ``m`` and ``winner``, and of a measured run's
    ``gbps`` only the winner's own (with ``timed``, what those GB/s are of, and ``kept``, why a slower winner
    stands), so that the run still reads as
    measured (the compile check builds measured winners). The other candidates' timings, the evidence of
    each choice, stay in the sweep's table. Every lookup gives what ``doc``'s gives."""
    out = {k: v for k, v in doc.items() if k not in OPS}
    for op in OPS:
        if op not in doc:
            continue
        out[op] = {}
        for dt, by_n in doc[op].items():
            for key, runs in by_n.items():
                kept = []
                for run in runs:
                    short = {"m": run["m"], "winner": run["winner"]}
                    if "gbps" in run:
                        labels = _timed_labels(op, run["winner"])
                        short["gbps"] = {k: v for k, v in run["gbps"].items() if k in labels}
                        short.update({k: run[k] for k in ("timed", "kept") if k in run})
                    kept.append(short)
                set_runs(out, op, dt, int(key), kept)
    return out


def dumps(doc: dict) -> str:
    """JSON with one line per (op, dtype, N): small diffs when a sweep changes a few buckets."""
    head = {k: v for k, v in doc.items() if k not in OPS}
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    ops = [op for op in OPS if op in doc]  # an optional op never measured stays out of the file
    for i, op in enumerate(ops):
        lines.append(f'  "{op}": {{')
        dts = list(doc.get(op, {}).items())
        for j, (dt, by_n) in enumerate(dts):
            lines.append(f'    "{dt}": {{')
            items = sorted(by_n.items(), key=lambda kv: int(kv[0]))
            for k, (key, runs) in enumerate(items):
                lines.append(f'      "{key}": {json.dumps(runs)}' + ("," if k < len(items) - 1 else ""))
            lines.append("    }" + ("," if j < len(dts) - 1 else ""))
        lines.append("  }" + ("," if i < len(ops) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"


def write(doc: dict, path) -> None:
    """Validates ``doc`` and writes it atomically (an interrupted sweep keeps its last complete file)."""
    Table(doc, str(path))
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(dumps(doc))
    os.replace(tmp, path)


# The qk sweep's shapes: q of QK_SWEEP_HEADS[0] heads and k of QK_SWEEP_HEADS[1] per token (GQA, as the
# benchmarks' qk_norm measure): k holds a fifth of the rows, q four fifths.
QK_SWEEP_HEADS = (16, 4)


def qk_sweep_tokens(m_b: int) -> int:
    """Tokens (of ``(tokens, heads, D)`` tensors) whose q and k rows together fall in M bucket ``m_b``,
    or 0 where none do (fewer than 32 rows)."""
    tokens = m_b // sum(QK_SWEEP_HEADS)
    return tokens if tokens and m_bucket(tokens * sum(QK_SWEEP_HEADS)) == m_b else 0


def sweep_points(dtypes: Iterable[str], ns: Iterable[int], ms: Iterable[int]):
    """Every (dtype, N bucket, M bucket) of a sweep, N outermost within a dtype (one input size at a time)."""
    return [(dt, n_b, m_b) for dt in dtypes for n_b in ns for m_b in ms]
