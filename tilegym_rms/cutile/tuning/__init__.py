"""Tuning tables: the measured winner per shape bucket and device class, in JSON files of this package.

A device class is keyed by compute capability and SM count, ``sm{major}{minor}_{sms}sm`` (``sm90_132sm``: an
H100 SXM). ``<key>.json`` here is the table the host uses on such a device; a device without one, and a
shape outside a table's buckets, gets the analytic heuristics (:mod:`..config`). A class table names the card
it was measured on; another card of the class (an H200 has an H100 SXM's key) is keyed
``<key>.<card>`` (``sm90_132sm.nvidia-h200``, :func:`card_key`) and runs ``<key>.<card>.json`` where one ships,
else its class's table.

Buckets. ``N``: 64 and 96 (QK-norm head dims), every multiple of 128 up to 8192, then multiples of 1024 up
to 16384, of 4096 up to 32768 and of 8192 up to 65536 (:data:`N_BUCKETS`); an N between two bucket points
takes the next one up, so the winner's tiles cover it (N above 65536: no entry). ``M``: powers of two
from 1 to 2**22 (M rounded up to one; larger M clamp to 2**22).

Schema (``"schema": 1``)::

    {
      "schema": 1,
      "device": {"key": "sm90_132sm", "name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "sms": 132},
      "source": "analytic" | "measured" | "mixed",
      "generated_by": "the command line that wrote it",
      "copy_gbps": 2990.0,                        # measured tables: the card's copy bandwidth
      "forward": {                                # and "backward", "fused_forward", same shape
        "bf16": {                                 # "bf16", "fp16", "fp32"
          "4096": [                               # an N bucket point
            {"m": 1, "winner": {...}},            # from M bucket 1 on ...
            {"m": 1024, "winner": {...},          # ... from 1024 on (until the next run's m)
             "gbps": {"persistent 4x4096+0 b2 o2 w0": 2710.0, ...}}   # measured: every candidate's GB/s
          ], ...}, ...}}

Runs are sorted by ``m``; the run for an M bucket is the last one whose ``m`` is at most it (M buckets below
the first run take the first run). A forward winner has the fields of :class:`..config.ForwardCandidate`
(``kernel``, ``tile_m``, ``tile_n``, ``tail_n``, ``blocks_per_sm``, ``occupancy``, ``num_worker_warps``), a
backward winner those of :class:`..config.BackwardCandidate` (``plan`` instead of ``kernel``). Loading
checks every winner against every N of its bucket (tiles that cover the row, widths that fit a block) and
raises :class:`TuningTableError` saying which entry is wrong.

Ops. ``forward`` and ``backward``: the plain norm (the analytic table writes both at every bucket).
``fused_forward``: the forward with the fused residual add (``fused_add_forward``, both modes), forward
winners measured with mode "pre" (twice the plain forward's traffic per row). Optional: where it has no
entry the host takes the ``forward`` entry, then the heuristics (:data:`FALLBACK`); the analytic table never
writes it (absence means "as the plain forward"). ``qk``: the qk kernels (``qk_rms_norm``), keyed by the
head dim's N bucket (64, 96, 128, 256, ... up to ``Heuristics.qk_max_tile_n``) and by the M bucket of the
rows of q and k together; a winner has the fields of :class:`..config.QKCandidate` (``fwd_tile_m``,
``bwd_tile_m``, ``fwd_blocks_per_sm``, ``bwd_blocks_per_sm``, ``fwd_occupancy``, ``bwd_occupancy``), its
run's ``gbps`` keyed by each half's label (``"fwd 32r b8 o2"``, ``"bwd ..."``: the sweep times the forward
and the backward apart). Optional too: absent, the heuristics (``config.qk_config``).

Choosing the table: ``TILEGYM_RMS_TUNING`` (read once, at the first launch) is a path to a table used on
every device, or ``off`` for the analytic heuristics everywhere; unset, the device's packaged table. In
Python, :func:`use_table` does the same at any time (and clears the host caches), as a setter or as a
context manager.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, fields, replace
from importlib import resources
from pathlib import Path

import torch

from .. import config
from ..config import BackwardCandidate, ForwardCandidate, QKCandidate

SCHEMA = 1
ENV = "TILEGYM_RMS_TUNING"
OPS = ("forward", "backward", "fused_forward", "qk")
# The ops the analytic table writes at every bucket; the others are optional, absent unless measured.
ANALYTIC_OPS = ("forward", "backward")
# Where an op's lookup goes when the table has no entry for it (then the analytic heuristics).
FALLBACK = {"fused_forward": "forward"}
FORWARD_OPS = ("forward", "fused_forward")  # ops whose winners are ForwardCandidates
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
CANDIDATE_TYPES = {
    "forward": ForwardCandidate,
    "backward": BackwardCandidate,
    "fused_forward": ForwardCandidate,
    "qk": QKCandidate,
}
# The first field of a winner, its kernel or plan, takes one of these; the qk winner has none.
KINDS = {"forward": config.FORWARD_KERNELS, "fused_forward": config.FORWARD_KERNELS, "backward": config.BACKWARD_PLANS}
N_BUCKETS = (
    (64, 96)
    + tuple(range(128, 8192 + 1, 128))
    + tuple(range(9216, 16384 + 1, 1024))
    + tuple(range(20480, 32768 + 1, 4096))
    + tuple(range(40960, 65536 + 1, 8192))
)
M_BUCKET_MAX = 1 << 22
M_BUCKETS = tuple(1 << i for i in range(23))
MAX_TILE_M = 64  # a sanity bound on table entries: the heuristics stay at 16
MAX_WARPS = 32
# A qk tile (rows x next_pow2(D)) holds at most this many elements: the widest tile the forward kernels keep
# in registers (Heuristics.fwd_max_single_tile_n); the heuristics stay at 16384.
QK_MAX_TILE_ELEMS = 32768


class TuningTableError(ValueError):
    """A tuning table that does not follow the schema (the message names the entry and the rule)."""


def n_bucket(n: int) -> int | None:
    """The bucket point an N rounds up to, or None above the widest bucket."""
    if n > N_BUCKETS[-1]:
        return None
    lo, hi = 0, len(N_BUCKETS) - 1
    while lo < hi:  # the first bucket >= n
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if N_BUCKETS[mid] < n else (lo, mid)
    return N_BUCKETS[lo]


def m_bucket(m: int) -> int:
    return min(config.m_bucket(m), M_BUCKET_MAX)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _qk_candidate_error(cand: QKCandidate, n_b: int, p: config.Heuristics) -> str | None:
    if n_b > p.qk_max_tile_n:
        return f"qk: no qk kernel takes head dims above {p.qk_max_tile_n} (bucket {n_b})"
    tile_n = config.next_pow2(n_b)
    for side in ("fwd", "bwd"):
        tile_m, blocks, occupancy = (getattr(cand, f"{side}_{k}") for k in ("tile_m", "blocks_per_sm", "occupancy"))
        if not _pow2(tile_m) or tile_m * tile_n > QK_MAX_TILE_ELEMS:
            return (
                f"qk: {side}_tile_m {tile_m} must be a power of two with {side}_tile_m x {tile_n} columns "
                f"<= {QK_MAX_TILE_ELEMS} elements"
            )
        if blocks < 1 or occupancy < 0:
            return f"qk: {side}_blocks_per_sm {blocks} must be >= 1 and {side}_occupancy {occupancy} >= 0"
    return None


def candidate_error(op: str, cand, n_b: int) -> str | None:
    """Why ``cand`` cannot serve every N of bucket ``n_b``, or None. The bounds are the hard limits of the
    kernels (registers of a row tile), from the default heuristics."""
    p = config.Heuristics()
    if op == "qk":
        return _qk_candidate_error(cand, n_b, p)
    hi = n_b
    hints_ok = cand.occupancy >= 0 and cand.num_worker_warps in (0, *(1 << i for i in range(6)))
    if not hints_ok or cand.num_worker_warps > MAX_WARPS:
        return f"occupancy {cand.occupancy} / num_worker_warps {cand.num_worker_warps}: >= 0, warps a power of two"
    if not (_pow2(cand.tile_m) and cand.tile_m <= MAX_TILE_M and _pow2(cand.tile_n)):
        return f"tile_m {cand.tile_m} and tile_n {cand.tile_n} must be powers of two (tile_m <= {MAX_TILE_M})"
    if cand.tail_n and not (_pow2(cand.tail_n) and cand.tail_n < cand.tile_n):
        return f"tail_n {cand.tail_n} must be 0 or a power of two narrower than tile_n"
    kind = cand.kernel if op in FORWARD_OPS else cand.plan
    if kind in ("gather", "direct"):
        if cand.blocks_per_sm or cand.tail_n:
            return f"{kind}: blocks_per_sm and tail_n must be 0 (one block per row or row tile)"
    elif cand.blocks_per_sm < 1:
        return f"{kind}: blocks_per_sm must be >= 1"
    if kind == "gather":
        widest = p.fwd_max_single_tile_n
        if cand.tile_m != 1 or cand.tile_n > widest:
            return f"gather: tile_m must be 1 and tile_n (one tile or a chunk) at most {widest}"
        return None
    if kind == "chunked":
        return None
    widest = p.fwd_max_persistent_tile_n if op in FORWARD_OPS else p.bwd_max_single_tile_n
    if cand.tile_n > widest:
        return f"{kind}: tile_n {cand.tile_n} wider than {widest}"
    if cand.tile_n + cand.tail_n < hi:
        return f"{kind}: tile_n + tail_n = {cand.tile_n + cand.tail_n} does not cover N = {hi}"
    return None


def _candidate(op: str, raw, where: str):
    cls = CANDIDATE_TYPES[op]
    names = [f.name for f in fields(cls)]
    if not isinstance(raw, dict) or set(raw) != set(names):
        raise TuningTableError(f"{where}: a {op} winner has exactly the fields {names}, got {raw!r}")
    kinds = KINDS.get(op)
    if kinds and raw[names[0]] not in kinds:
        raise TuningTableError(f"{where}: {names[0]} must be one of {kinds}, got {raw[names[0]]!r}")
    ints = names[1:] if kinds else names
    if not all(type(raw[k]) is int for k in ints):
        raise TuningTableError(f"{where}: {', '.join(ints)} must be integers, got {raw!r}")
    return cls(**raw)


class Table:
    """A validated tuning table: ``lookup`` gives the winner for an ``(m, n, dtype)`` or None."""

    def __init__(self, doc: dict, origin: str = "<dict>"):
        self.doc = doc
        self.origin = origin
        self.runs: dict[tuple[str, str, int], tuple[tuple[int, object], ...]] = {}
        self._parse()

    def _fail(self, msg: str):
        raise TuningTableError(f"tuning table {self.origin}: {msg}")

    def _parse(self):
        doc = self.doc
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            self._fail(f"'schema' must be {SCHEMA} (got {doc.get('schema') if isinstance(doc, dict) else doc!r})")
        device = doc.get("device")
        if not isinstance(device, dict) or not isinstance(device.get("key"), str):
            self._fail("'device' must be an object with a 'key' string")
        for op in OPS:
            by_dtype = doc.get(op, {})
            if not isinstance(by_dtype, dict) or not set(by_dtype) <= set(DTYPES):
                self._fail(f"{op!r} maps dtypes {sorted(DTYPES)} to N buckets")
            for dt, by_n in by_dtype.items():
                for key, runs in by_n.items():
                    where = f"{op}/{dt}/{key}"
                    if not key.isdigit() or int(key) not in N_BUCKETS:
                        self._fail(f"{where}: {key!r} is not an N bucket point (see tuning.N_BUCKETS)")
                    self.runs[(op, dt, int(key))] = self._parse_runs(op, int(key), runs, where)

    def _parse_runs(self, op, n_b, runs, where):
        if not isinstance(runs, list) or not runs:
            self._fail(f"{where}: a non-empty list of runs")
        parsed, last = [], 0
        for run in runs:
            m = run.get("m") if isinstance(run, dict) else None
            if m not in M_BUCKETS or m <= last:
                self._fail(f"{where}: run 'm' {m!r} must be a power of two up to 2**22, increasing")
            cand = _candidate(op, run.get("winner"), f"{self.origin}: {where}/m={m}")
            why = candidate_error(op, cand, n_b)
            if why:
                self._fail(f"{where}/m={m}: {why}")
            parsed.append((m, cand))
            last = m
        return tuple(parsed)

    @property
    def key(self) -> str:
        return self.doc["device"]["key"]

    def lookup(self, op: str, m: int, n: int, dtype: torch.dtype):
        """The winner for the buckets of ``(m, n, dtype)``: a config candidate, or None (no entry)."""
        n_b = n_bucket(n)
        runs = self.runs.get((op, DTYPE_NAMES.get(dtype), n_b)) if n_b is not None else None
        if not runs:
            return None
        m_b = m_bucket(m)
        return next((c for start, c in reversed(runs) if start <= m_b), runs[0][1])

    def winners(self, op: str, m: int, n: int, dtype: torch.dtype):
        """The winners for ``(m, n, dtype)`` along ``op``'s fallback chain (:data:`FALLBACK`: the fused
        forward's entry, then the forward's), ops without an entry skipped."""
        while op is not None:
            cand = self.lookup(op, m, n, dtype)
            if cand is not None:
                yield cand
            op = FALLBACK.get(op)


def load(source) -> Table:
    """A table from a path or a dict (validated)."""
    if isinstance(source, Table):
        return source
    if isinstance(source, dict):
        return Table(source)
    path = Path(source)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TuningTableError(f"tuning table {path}: cannot read it as JSON ({exc})") from exc
    return Table(doc, str(path))


def packaged_keys() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


@functools.cache
def packaged(key: str) -> Table | None:
    """The table shipped for a device class, or None."""
    res = resources.files(__name__) / f"{key}.json"
    return Table(json.loads(res.read_text()), f"{__name__}/{key}.json") if res.is_file() else None


def class_key(capability: tuple[int, int], sms: int) -> str:
    """The key of a device class, which names its table: ``sm90_132sm`` for capability (9, 0) and 132 SMs."""
    major, minor = capability
    return f"sm{major}{minor}_{sms}sm"


def card_key(class_key_: str, name: str) -> str:
    """The key of a card's table: its class's key, unless the class's shipped table was measured on another
    card (compute capability and SM count do not tell an H200 from an H100 SXM), then ``<class key>.<card>``
    (``sm90_132sm.nvidia-h200``), so that a sweep on that card makes a table of its own."""
    shipped = packaged(class_key_)
    if shipped is None or shipped.doc["device"].get("name") == name:
        return class_key_
    return f"{class_key_}.{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}"


def class_of(key: str) -> str:
    """The class key within a card key (:func:`card_key`); a class key is its own."""
    return key.split(".")[0]


def is_card_of(key: str, class_key_: str) -> bool:
    """Whether ``key`` is a card key (:func:`card_key`) of the class ``class_key_``, not the class key itself."""
    return key != class_key_ and class_of(key) == class_key_


def device_key(device_index: int) -> str:
    """The key of a device's table (:func:`card_key`)."""
    from ..launch import num_sms

    base = class_key(torch.cuda.get_device_capability(device_index), num_sms(device_index))
    return card_key(base, torch.cuda.get_device_name(device_index))


_PACKAGED = "packaged"  # the choice: each device's shipped table
_choice: object = None  # None until the first lookup reads the environment; then _PACKAGED, "off" or a Table


def _from_setting(value) -> object:
    if value is None or value == "off":
        return "off"
    if value == _PACKAGED:
        return _PACKAGED
    return load(value)


def _current() -> object:
    global _choice
    if _choice is None:
        _choice = _from_setting(os.environ.get(ENV) or _PACKAGED)
    return _choice


def table_for(device_index: int) -> Table | None:
    """The table the host uses on a device (None: the analytic heuristics)."""
    choice = _current()
    if choice == "off":
        return None
    if choice == _PACKAGED:
        key = device_key(device_index)
        # A card with no table of its own runs its class's (measured on another card of the class) rather than
        # the heuristics: the same chip, other memory.
        return packaged(key) or packaged(class_of(key))
    return choice


class use_table:  # noqa: N801 - used like a function, as torch.set_grad_enabled is
    """Sets the tuning table: a path, a dict, a :class:`Table`, ``None`` or ``"off"`` (analytic heuristics)
    or ``"packaged"`` (each device's shipped table, ignoring ``TILEGYM_RMS_TUNING``). Takes effect at once
    (the host caches are cleared); as a context manager it restores the previous choice on exit."""

    def __init__(self, table):
        self._previous = _current()
        _set(_from_setting(table))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _set(self._previous)


def _set(choice) -> None:
    global _choice
    _choice = choice
    from .. import clear_caches

    clear_caches()


# --- writing tables (the analytic table, the sweep) ---


def label(op: str, cand) -> str:
    """A candidate in one short string (the keys of a run's ``gbps``; a qk candidate: its two halves')."""
    if op == "qk":
        return " | ".join(qk_half_label(cand, side) for side in ("fwd", "bwd"))
    kind = cand.kernel if op in FORWARD_OPS else cand.plan
    tail = f"+{cand.tail_n}" if cand.tail_n else ""
    return f"{kind} {cand.tile_m}x{cand.tile_n}{tail} b{cand.blocks_per_sm} o{cand.occupancy} w{cand.num_worker_warps}"


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
    bucket: the other forward kernel (its analytic tiles), or the persistent backward plan in place of the
    direct one; twice the blocks per SM (only the grid changes: no compile); twice the rows per tile of a
    persistent tile, or twice the gather kernel's occupancy hint (one compiled variant each). Few on
    purpose: compiles dominate a sweep's time, see ``bench/tools/tune_table.py --plan``.

    ``wide`` reaches further where the quick neighbours left a gap to the peers: four times the blocks per
    SM (up to 64 times for the persistent forward), half the rows per tile, and occupancy hints of two and
    four times the analytic one (for qk on both halves; for the forward ops on both kernels); for a padded
    persistent forward row, the row as a tile plus a tail tile; and one-block-per-SM builds of each persistent
    tile shape, with eight warps and at occupancy 1 (:func:`_add_one_block_builds`)."""
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
        if wide:  # the plain norm's choice for rows of one head (its measured short-row settings)
            f = config.forward_candidate(m_b, n_b, dtype, sms, "persistent")
            b = config.backward_candidate(m_b, n_b, dtype, sms)
            add(replace(base, fwd_tile_m=f.tile_m, fwd_blocks_per_sm=f.blocks_per_sm, fwd_occupancy=f.occupancy))
            add(replace(base, bwd_tile_m=b.tile_m, bwd_blocks_per_sm=b.blocks_per_sm, bwd_occupancy=b.occupancy))
        return out
    if op in FORWARD_OPS:  # the fused forward tries the plain forward's candidates
        add(config.forward_candidate(m_b, n_b, dtype, sms))
        for kernel in config.FORWARD_KERNELS:
            try:
                base = config.forward_candidate(m_b, n_b, dtype, sms, kernel)
            except ValueError:
                continue  # persistent: rows too wide
            add(base)
            occupancies = [max(1, base.occupancy) * o for o in (2, 4)] if wide else [max(1, base.occupancy * 2)]
            if kernel == "gather":
                for occupancy in occupancies:
                    add(replace(base, occupancy=occupancy))
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
            # A padded row held as a tile plus a tail tile instead (config.split_row: 2304 = 2048 + 256), which
            # the analytic choice keeps for the widest rows only: fewer padded registers per row.
            tile_n, tail_n = config.split_row(n_b)
            if tail_n and not base.tail_n:
                for tile_m in (base.tile_m, base.tile_m * 2):
                    for occupancy in (base.occupancy, max(1, base.occupancy) * 2):
                        for b in (1, 2):
                            split = dict(tile_n=tile_n, tail_n=tail_n, tile_m=tile_m, occupancy=occupancy)
                            add(replace(base, **split, blocks_per_sm=base.blocks_per_sm * b))
        if wide:
            _add_one_block_builds(add, out, "kernel")
        return out
    base = config.backward_candidate(m_b, n_b, dtype, sms)
    add(base)
    if base.plan == "direct":  # what the direct plan replaced at this M
        base = config.backward_candidate(m_b, n_b, dtype, sms, replace(config.HEURISTICS, bwd_direct_max_rows_per_sm=0))
        add(base)
    for b in scales[1:]:
        add(replace(base, blocks_per_sm=base.blocks_per_sm * b))
    add(replace(base, tile_m=base.tile_m * 2))
    if wide:
        add(replace(base, tile_m=base.tile_m // 2))
        _add_one_block_builds(add, out, "plan")
    return out


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


def _reference_runs(doc: dict, op: str, dt: str, key: str) -> list[dict]:
    """The runs the host would follow for (op, dtype, N) in ``doc`` without a new measurement: the op's
    own entry, else its fallback's (:data:`FALLBACK`), else the analytic heuristics'."""
    while True:
        runs = doc.get(op, {}).get(dt, {}).get(key)
        if runs:
            return runs
        if op not in FALLBACK:
            return analytic_runs(op, DTYPES[dt], int(key), doc["device"]["sms"])
        op = FALLBACK[op]


def _incumbent_kept(op: str, run: dict, incumbent: dict, min_gain: float) -> dict:
    """A measured sweep ``run`` whose winner yields to ``incumbent`` (what the base launches at that M bucket)
    when the sweep timed the incumbent too and its winner beats it by less than ``min_gain``: as the sweep's
    own rule keeps the analytic choice (:func:`select_winner`), so a re-timed table keeps its choices within
    the noise. qk runs are timed by halves and stay as measured."""
    if op == "qk" or run["winner"] == incumbent:
        return run
    gbps = run["gbps"]
    mine = gbps.get(label(op, _candidate(op, incumbent, "incumbent")))
    theirs = gbps.get(label(op, _candidate(op, run["winner"], "winner")))
    if mine is None or theirs is None or theirs >= mine * (1 + min_gain):
        return run
    return {**run, "winner": incumbent}


def overlay(base: dict, sweep: dict, min_gain: float = 0.01) -> dict:
    """A sparse sweep (a few M buckets) laid over ``base`` (the analytic table, or a shipped table whose
    other entries must stay), M bucket by M bucket: a measured winner stands for the buckets above its own
    only while the base's choice there stays the one it was measured against (so M buckets where the
    heuristics switch kernel, e.g. to the gather forward at many rows, keep their switch), and buckets
    below the first measured one keep the base's choice. For an op without a base entry the base is what
    the host would fall back to: the fused forward the forward's entry (already overlaid), the qk op and
    the rest the analytic heuristics. Entries the sweep did not measure stay as in ``base``, and so do the
    base's own measured runs at M buckets the sweep did not measure: a sweep winner stands for the buckets
    above its own only up to the next bucket either table measured. At a bucket the sweep measured, the
    winner the base launched there stays unless the sweep's beats it by ``min_gain`` (:func:`_incumbent_kept`)."""
    out = merge(base, {**sweep, **{op: {} for op in OPS}})
    for op in OPS:  # in order: the forward is overlaid before the fused forward falls back to it
        for dt, by_n in sweep.get(op, {}).items():
            for key, measured_runs in by_n.items():
                ref_runs = _reference_runs(out, op, dt, key)
                measured_runs = [_incumbent_kept(op, r, _winner_at(ref_runs, r["m"]), min_gain) for r in measured_runs]
                points = {r["m"]: r for r in measured_runs}
                own = out.get(op, {}).get(dt, {}).get(key) or []  # not a fallback's: measured for another op
                base_points = {r["m"]: r for r in own if "gbps" in r and r["m"] not in points}
                runs: list[dict] = []
                for m_b in M_BUCKETS:
                    below = [r for r in measured_runs if r["m"] <= m_b]
                    ref = below[-1] if below else None
                    if ref is not None and any(ref["m"] < p <= m_b for p in base_points):
                        ref = None  # the base measured a bucket nearer to this one: its choice stands
                    if ref is not None and _winner_at(ref_runs, m_b) == _winner_at(ref_runs, ref["m"]):
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


def source_of(doc: dict) -> str:
    kinds = {measured(runs) for op in OPS for by_n in doc.get(op, {}).values() for runs in by_n.values()}
    return "mixed" if len(kinds) > 1 else ("measured" if kinds == {True} else "analytic")


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
    """Tokens (groups G of the ``(G, H, D)`` views) whose q and k rows together fall in M bucket ``m_b``,
    or 0 where none do (fewer than 32 rows)."""
    tokens = m_b // sum(QK_SWEEP_HEADS)
    return tokens if tokens and m_bucket(tokens * sum(QK_SWEEP_HEADS)) == m_b else 0


def sweep_points(dtypes: Iterable[str], ns: Iterable[int], ms: Iterable[int]):
    """Every (dtype, N bucket, M bucket) of a sweep, N outermost within a dtype (one input size at a time)."""
    return [(dt, n_b, m_b) for dt in dtypes for n_b in ns for m_b in ms]
