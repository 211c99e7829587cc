"""Tuning tables: the measured winner per shape bucket and device class, in JSON files of this package.

A device class is keyed by compute capability and SM count, ``sm{major}{minor}_{sms}sm`` (``sm90_132sm``: an
H100 SXM). ``<key>.json`` here is the table the host uses on such a device; a device without one, and a
shape outside a table's buckets, gets the analytic heuristics (:mod:`..config`). A class table names the card
it was measured on; another card of the class (an H200 has an H100 SXM's key) is keyed
``<key>.<card>`` (``sm90_132sm.nvidia-h200``, :func:`card_key`) and runs ``<key>.<card>.json`` where one ships,
else the class's shipped table whose card is nearest to it in memory bandwidth (:func:`nearest_table`: an
H200 NVL or a GH200 with HBM3e takes the H200's, an H800 or an H100 NVL the H100's).

Buckets. ``N``: 64 and 96 (QK-norm head dims), every multiple of 128 up to 8192, then multiples of 1024 up
to 16384, of 4096 up to 32768 and of 8192 up to 65536 (:data:`N_BUCKETS`); an N between two bucket points
takes the next one up, so the winner's tiles cover it (N above 65536: no entry). ``M``: powers of two
from 1 to 2**22 (M rounded up to one; larger M clamp to 2**22).

Schema (``"schema": 2``)::

    {
      "schema": 2,
      "device": {"key": "sm90_132sm", "name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "sms": 132},
      "source": "analytic" | "measured" | "mixed",
      "generated_by": "the command line that wrote it",
      "copy_gbps": 2990.0,                        # measured tables: the card's copy bandwidth
      "forward": {                                # and "backward", "fused_forward", same shape
        "bf16": {                                 # "bf16", "fp16", "fp32"
          "4096": [                               # an N bucket point
            {"m": 1, "winner": {...}},            # from M bucket 1 on ...
            {"m": 1024, "winner": {...},          # ... from 1024 on (until the next run's m)
             "gbps": {"persistent 4x4096+0 b2 o2 w0": 2710.0, ...}}   # measured: the sweep's GB/s
          ], ...}, ...}}

A measured run has ``gbps``: in the table a sweep writes, every candidate's (the evidence of the choice, kept
with the card's results, ``bench/results/<gpu>/sweeps/table_<key>_candidates.json``); in the table shipped
here, the winner's own (:func:`.build.slim`). Lookup reads only ``m`` and ``winner``; the compile check
(:mod:`tilegym_rms.aot`) builds the winners of the measured runs.

Runs are sorted by ``m``; the run for an M bucket is the last one whose ``m`` is at most it (M buckets below
the first run take the first run). A forward winner has the fields of :class:`..config.ForwardCandidate`
(``kernel``, ``tile_m``, ``tile_n``, ``tail_n``, ``blocks_per_sm``, ``occupancy``, ``num_worker_warps``), a
backward winner those of :class:`..config.BackwardCandidate` (``strategy`` instead of ``kernel``). Loading
checks every winner against every N of its bucket (tiles that cover the row, widths that fit a block) and
raises :class:`TuningTableError` saying which entry is wrong. Schema 1 differs only in naming the backward's
strategy ``plan``; such tables load as schema 2 (:func:`upgraded`).

Ops. ``forward`` and ``backward``: the plain norm (the analytic table writes both at every bucket).
``fused_forward``: the forward with the fused residual add (``fused_add_forward``, both modes), forward
winners measured with mode "pre" (twice the plain forward's traffic per row). Optional: where it has no
entry the host takes the other 16-bit dtype's ``fused_forward`` entry (fp16 and bf16), then the ``forward``
entry, then the heuristics (:func:`fallback_chain`); the analytic table never writes it (absence means "as the
plain forward"). ``qk``: the qk kernels (``qk_rms_norm``), keyed by the
head dim's N bucket (64, 96, 128, 256, ... up to ``Heuristics.qk_max_tile_n``) and by the M bucket of the
rows of q and k together; a winner has the fields of :class:`..config.QKCandidate` (``fwd_tile_m``,
``bwd_tile_m``, ``fwd_blocks_per_sm``, ``bwd_blocks_per_sm``, ``fwd_occupancy``, ``bwd_occupancy``), its
run's ``gbps`` keyed by each half's label (``"fwd 32r b8 o2"``, ``"bwd ..."``: the sweep times the forward
and the backward apart). Optional too: absent, the heuristics (``config.qk_config``).

Settings. ``heuristics`` (optional): ``{"fp8_tile_elems": 8192, ...}``, settings of :class:`..config.Heuristics`
this card runs with where the table has no entries to choose by: the FP8 output's (``fp8_*``) and the gated
norm's (``gated_*``) launches, whose settings are analytic rules rather than per-bucket winners. A sweep on the
card chooses them (``bench/tools/tune_cutile.py --set``), and they ship here rather than as new defaults where
another card of the family cannot be re-measured. Each name must be such a setting and each value of its
default's type; :func:`..config.override` still wins over them (a sweep times what it names).

Choosing the table: ``TILEGYM_RMS_TUNING`` (read once, at the first launch) is a path to a table used on
every device, or ``off`` for the analytic heuristics everywhere; unset, the device's packaged table. In
Python, :func:`use_table` does the same at any time (and clears the host caches), as a setter or as a
context manager.

This module is what a launch needs; writing tables (the analytic table, the sweep's candidates, merge and
overlay) is :mod:`.build`'s, which only ``bench/tools/tune_table.py`` and the tests import.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import re
from dataclasses import fields
from importlib import resources
from pathlib import Path

import torch

from .. import config
from ..config import BackwardCandidate, ForwardCandidate, QKCandidate

SCHEMA = 2
ENV = "TILEGYM_RMS_TUNING"
OPS = ("forward", "backward", "fused_forward", "qk")
# Where an op's lookup goes when the table has no entry for it (then the analytic heuristics).
FALLBACK = {"fused_forward": "forward"}
# The fused forward's entries one 16-bit dtype lends the other where that has none of its own at a width, before
# the plain forward's: the same bytes per element fit the same tiles (PERFORMANCE.md, "Fused add").
FUSED_PEER_DTYPE = {"bf16": "fp16", "fp16": "bf16"}
FORWARD_OPS = ("forward", "fused_forward")  # ops whose winners are ForwardCandidates
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def fallback_chain(op: str, dt: str, has_entry) -> tuple[tuple[str, str], ...]:
    """The ``(op, dtype)`` entries a lookup of ``(op, dt)`` at one width tries, in order, before the analytic
    heuristics: its own; for the fused forward without an entry of its own there (``has_entry(op, dt)``: whether
    the table holds one at that width), the other 16-bit dtype's fused entry (:data:`FUSED_PEER_DTYPE`); then the
    :data:`FALLBACK` op's of ``dt``. The one rule for the host's lookup, the overlay's reference and the compile
    check."""
    chain = [(op, dt)]
    if op == "fused_forward" and dt in FUSED_PEER_DTYPE and not has_entry(op, dt):
        chain.append((op, FUSED_PEER_DTYPE[dt]))
    if op in FALLBACK:
        chain.append((FALLBACK[op], dt))
    return tuple(chain)


def serving_entry(op: str, dt: str, has_entry) -> tuple[str, str] | None:
    """The ``(op, dtype)`` entry a lookup of ``(op, dt)`` at one width takes when no kernel is forced: the first
    along :func:`fallback_chain` that the table holds (``has_entry``), or None (the analytic heuristics)."""
    return next((step for step in fallback_chain(op, dt, has_entry) if has_entry(*step)), None)


CANDIDATE_TYPES = {
    "forward": ForwardCandidate,
    "backward": BackwardCandidate,
    "fused_forward": ForwardCandidate,
    "qk": QKCandidate,
}
# The first field of a winner, its kernel or strategy, takes one of these; the qk winner has none.
KINDS = {
    "forward": config.FORWARD_KERNELS,
    "fused_forward": config.FORWARD_KERNELS,
    "backward": config.BACKWARD_STRATEGIES,
}
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
        least = 0 if side == "fwd" else 1  # a forward of one tile per block (0); the backward's dw rows are blocks
        if blocks < least or occupancy < 0:
            return f"qk: {side}_blocks_per_sm {blocks} must be >= {least} and {side}_occupancy {occupancy} >= 0"
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
    kind = cand.kernel if op in FORWARD_OPS else cand.strategy
    if kind in ("gather", "direct", "split"):
        if cand.blocks_per_sm or cand.tail_n:
            return f"{kind}: blocks_per_sm and tail_n must be 0 (one block per row or row tile)"
    elif kind == "tiles":
        if cand.blocks_per_sm:
            return "tiles: blocks_per_sm must be 0 (one block per row tile)"
    elif cand.blocks_per_sm < 1:
        return f"{kind}: blocks_per_sm must be >= 1"
    if kind in ("gather", "split"):
        widest = p.fwd_max_single_tile_n
        if cand.tile_m != 1 or cand.tile_n > widest:
            return f"{kind}: tile_m must be 1 and tile_n (one tile or a chunk) at most {widest}"
        if kind == "split" and n_b <= cand.tile_n:
            return f"split: rows of bucket {n_b} fit one {cand.tile_n}-column chunk"
        if kind == "split" and cand.num_worker_warps:
            return "split: num_worker_warps must be 0 (a build with worker warps never finished its spin)"
        return None
    if kind == "chunked":
        return None
    widest = p.fwd_max_persistent_tile_n if op in FORWARD_OPS else p.bwd_max_single_tile_n
    if cand.tile_n > widest:
        return f"{kind}: tile_n {cand.tile_n} wider than {widest}"
    if cand.tile_n + cand.tail_n < hi:
        return f"{kind}: tile_n + tail_n = {cand.tile_n + cand.tail_n} does not cover N = {hi}"
    return None


def parse_winner(op: str, raw, where: str):
    """The config candidate a run's ``winner`` object describes (raises :class:`TuningTableError` at ``where``)."""
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


def upgraded(doc):
    """``doc`` in the current schema: a schema-1 table, whose backward winners name their strategy ``plan``, as
    schema 2 (a copy); any other document as it is (validation judges it)."""
    if not isinstance(doc, dict) or doc.get("schema") != 1:
        return doc
    out = copy.deepcopy(doc)
    out["schema"] = SCHEMA
    by_dtype = out.get("backward")
    for by_n in by_dtype.values() if isinstance(by_dtype, dict) else ():
        for runs in by_n.values() if isinstance(by_n, dict) else ():
            for run in runs if isinstance(runs, list) else ():
                if isinstance(run, dict) and isinstance(run.get("winner"), dict):
                    run["winner"] = {("strategy" if k == "plan" else k): v for k, v in run["winner"].items()}
    return out


# The settings a table's ``heuristics`` may set: those of the ops without table entries (see the module doc).
HEURISTICS_PREFIXES = ("fp8_", "gated_")


class Table:
    """A validated tuning table: ``lookup`` gives the winner for an ``(m, n, dtype)`` or None; ``heuristics`` the
    settings it sets for the ops without entries (see the module doc). ``doc`` is the document in the current
    schema (:func:`upgraded`)."""

    def __init__(self, doc: dict, origin: str = "<dict>"):
        self.doc = upgraded(doc)
        self.origin = origin
        self.runs: dict[tuple[str, str, int], tuple[tuple[int, object], ...]] = {}
        self._parse()

    def _fail(self, msg: str):
        raise TuningTableError(f"tuning table {self.origin}: {msg}")

    def _parse_heuristics(self, raw) -> dict:
        if not isinstance(raw, dict):
            self._fail(f"'heuristics' maps settings of config.Heuristics to values, got {raw!r}")
        defaults = config.Heuristics()
        for name, value in raw.items():
            if not name.startswith(HEURISTICS_PREFIXES) or not hasattr(defaults, name):
                self._fail(
                    f"heuristics: {name!r} is not a setting a table may set (the settings of config.Heuristics "
                    f"that start with {' or '.join(HEURISTICS_PREFIXES)}: the other ops take the table's entries)"
                )
            want = type(getattr(defaults, name))
            if type(value) is not want:
                self._fail(f"heuristics/{name}: a {want.__name__} like its default, got {value!r}")
        return dict(raw)

    def _parse(self):
        doc = self.doc
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            got = doc.get("schema") if isinstance(doc, dict) else doc
            self._fail(f"'schema' must be {SCHEMA} (or 1, read as {SCHEMA}), got {got!r}")
        device = doc.get("device")
        if not isinstance(device, dict) or not isinstance(device.get("key"), str):
            self._fail("'device' must be an object with a 'key' string")
        self.heuristics = self._parse_heuristics(doc.get("heuristics", {}))
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
            cand = parse_winner(op, run.get("winner"), f"{self.origin}: {where}/m={m}")
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
        """The winners for ``(m, n, dtype)`` along ``op``'s fallback chain (:func:`fallback_chain`: the fused
        forward's entry, else the other 16-bit dtype's, then the forward's), entries the table lacks skipped; none
        for a dtype no table holds."""
        n_b = n_bucket(n)
        if dtype not in DTYPE_NAMES or n_b is None:
            return
        chain = fallback_chain(op, DTYPE_NAMES[dtype], lambda o, d: (o, d, n_b) in self.runs)
        for step_op, step_dt in chain:
            cand = self.lookup(step_op, m, n, DTYPES[step_dt])
            if cand is not None:
                yield cand


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


@functools.cache
def packaged_keys() -> tuple[str, ...]:
    """The keys of the tables this package ships, listed once per process: :func:`nearest_table` asks at every
    launch configuration a card without its own table builds."""
    return tuple(sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".json")))


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


# A copy kernel's share of the DRAM peak on the cards the shipped tables were measured on (H100 SXM: 3016 of
# 3352 GB/s, 0.90; H200: 4269 of 4800, 0.89): what a card of a given peak is expected to copy.
COPY_SHARE = 0.89


@functools.cache
def memory_gbps(device_index: int) -> float | None:
    """A CUDA device's DRAM peak in GB/s, from its memory clock (kHz) and bus width (bits), double data rate;
    None where torch does not report them."""
    props = torch.cuda.get_device_properties(device_index)
    khz, bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * khz * bits / 8 / 1e6 if khz and bits else None


def nearest_table(class_key_: str, peak_gbps: float | None) -> Table | None:
    """For a card without a table of its own: of the tables shipped for its class (the class's and its cards'),
    the one whose card copies nearest, by ratio, to what a card of ``peak_gbps`` would (``COPY_SHARE`` of it).
    A class shares the chip; what differs is the memory, and with it which launches win (an H200 copies 40%
    faster than an H100 SXM, and its table differs at most widths: PERFORMANCE.md, "Tuning tables"). The
    class's own table where the peak is unknown."""
    own = packaged(class_key_)
    if peak_gbps is None:
        return own
    tables = [packaged(k) for k in packaged_keys() if class_of(k) == class_key_]
    measured = [t for t in tables if t is not None and t.doc.get("copy_gbps")]
    if not measured:
        return own
    want = COPY_SHARE * peak_gbps
    return min(measured, key=lambda t: (abs(math.log(t.doc["copy_gbps"] / want)), t.key))


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
        # A card with no table of its own runs one measured on another card of its class rather than the
        # heuristics: the same chip, other memory.
        return packaged(key) or nearest_table(class_of(key), memory_gbps(device_index))
    return choice


def describe(device_index: int) -> str:
    """One line on what tunes the cuTile launches on a device: the table's key and the card its entries were
    measured on (a card's table: also the card its class's entries come from), or why it is the heuristics."""
    choice = _current()
    if choice == "off":
        return "off: the analytic heuristics"
    table = table_for(device_index)
    if table is None:
        return f"none for {device_key(device_index)}: the analytic heuristics"
    doc = table.doc
    if doc.get("source") == "analytic":
        where = "the analytic heuristics written out"
    else:
        where = f"measured on {doc['device'].get('name') or 'an unnamed card'}"
        if doc.get("based_on"):
            where += f", entries not measured there from {doc['based_on'].get('name') or doc['based_on']['key']}"
    how = "set by the user"
    if choice == _PACKAGED:
        how = "shipped"
        if table.key != device_key(device_index):  # another card's (nearest_table)
            peak = memory_gbps(device_index)
            how += f", for the class's card nearest to this one's {peak:.0f} GB/s peak" if peak else ", the class's"
    return f"{table.key} ({how}; {where})"


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
