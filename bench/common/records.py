"""Results: one :class:`Point` per provider and configuration, turned into Liger-format JSON records and merged
point by point into the results file, so that a grid can be split across runs."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import base, traffic

# The per-x columns of a record, kept in step when points are sorted or merged.
COLUMNS = ("x_values", "y_values_50", "y_values_20", "y_values_80", "rel_err")


@dataclass
class Point:
    """One provider on one configuration."""

    kernel_name: str
    op: str  # kernel_operation_mode
    suite: str
    provider: str
    dtype: str
    m: int
    n: int
    x_name: str
    x_label: str
    x_value: object
    extra: dict
    nbytes: int = 0
    us: list[float] = field(default_factory=list)
    metric: str = "throughput"  # or "latency"
    ok: bool | None = None
    errs: dict = field(default_factory=dict)
    error: str = ""
    note: str = ""
    kernels_per_call: float = float("nan")
    n_sets: int = 0
    capped: bool = False
    method: str = ""

    @property
    def valid(self) -> bool:
        return not self.error and bool(self.us)

    def time_stats(self) -> tuple[float, float, float]:
        return traffic.summarize(self.us)

    def gbps_stats(self) -> tuple[float, float, float]:
        return traffic.summarize([traffic.gbps(self.nbytes, u) for u in self.us])

    @property
    def max_err(self) -> float | None:
        return max(self.errs.values()) if self.errs else None


def extra_str(extra: dict) -> str:
    return json.dumps(extra, sort_keys=True)


def point_values(p: Point) -> dict[str, tuple[str, tuple[float, float, float]]]:
    """metric_name -> (unit, (p50, p20, p80)) for a valid point."""
    if p.metric == "latency":
        return {"latency": ("us", p.time_stats())}
    t50, t20, t80 = p.time_stats()
    return {"throughput": ("GB/s", p.gbps_stats()), "speed": ("ms", (t50 / 1000, t20 / 1000, t80 / 1000))}


def new_record(
    meta: dict,
    *,
    kernel_name: str,
    provider: str,
    metric: str,
    unit: str,
    op: str,
    extra: dict,
    x_name: str,
    x_label: str,
    timed: bool = True,
) -> dict:
    """A Liger-format record without points. ``meta``: gpu_name, timestamp, tilegym_rms_version and, for a
    ``timed`` record, copy_bandwidth_GBps and timing_method (records of sizes, not times, carry neither)."""
    rec = {
        "kernel_name": kernel_name,
        "kernel_provider": provider,
        "metric_name": metric,
        "metric_unit": unit,
        "gpu_name": meta["gpu_name"],
        "x_name": x_name,
        "x_label": x_label,
        "x_values": [],
        "y_values_50": [],
        "y_values_20": [],
        "y_values_80": [],
        "timestamp": meta["timestamp"],
        "kernel_operation_mode": op,
        "extra_benchmark_config_str": extra_str(extra),
        "tilegym_rms_version": meta["tilegym_rms_version"],
    }
    if timed:
        rec["copy_bandwidth_GBps"] = meta.get("copy_bandwidth_GBps")
        rec["timing_method"] = meta.get("timing_method", "")
    rec["rel_err"] = []
    rec["mismatch_x_values"] = []
    return rec


def build_records(points: list[Point], meta: dict) -> list[dict]:
    """Liger-format records: one per (kernel, provider, op mode, metric, extra config), x over the points.
    ``meta``: gpu_name, timestamp, tilegym_rms_version, copy_bandwidth_GBps, timing_method."""
    groups: dict[tuple, dict] = {}
    for p in points:
        if not p.valid:
            continue
        for metric, (unit, (y50, y20, y80)) in point_values(p).items():
            key = (p.kernel_name, p.provider, metric, p.op, extra_str(p.extra), p.x_name)
            rec = groups.get(key)
            if rec is None:
                rec = groups[key] = new_record(
                    meta, kernel_name=p.kernel_name, provider=p.provider, metric=metric, unit=unit, op=p.op,
                    extra=p.extra, x_name=p.x_name, x_label=p.x_label,
                )  # fmt: skip
            rec["x_values"].append(p.x_value)
            rec["y_values_50"].append(y50)
            rec["y_values_20"].append(y20)
            rec["y_values_80"].append(y80)
            rec["rel_err"].append(p.max_err)
            if p.ok is False:
                rec["mismatch_x_values"].append(p.x_value)
    for rec in groups.values():
        _put_rows(rec, zip(*(rec[c] for c in COLUMNS), strict=True))
    return list(groups.values())


def x_sort_key(x) -> tuple:
    if isinstance(x, (int, float)):
        return (0, float(x))
    parts = re.findall(r"\d+", str(x))
    return (1, tuple(int(v) for v in parts), str(x))


def _put_rows(rec: dict, rows) -> list[tuple]:
    """Store ``rows`` (one tuple of :data:`COLUMNS` values per x) into ``rec`` sorted by x; returns them sorted."""
    rows = sorted(rows, key=lambda r: x_sort_key(r[0]))
    for i, c in enumerate(COLUMNS):
        rec[c] = [r[i] for r in rows]
    return rows


def record_key(rec: dict) -> tuple:
    return (
        rec["kernel_name"],
        rec["kernel_provider"],
        rec["metric_name"],
        rec["kernel_operation_mode"],
        rec["extra_benchmark_config_str"],
        rec["x_name"],
    )


def merge_records(old: list[dict], new: list[dict]) -> list[dict]:
    """Point-wise merge: a new point replaces the old point with the same key and x; other old points stay, under
    the new record's run metadata (timestamp, copy bandwidth: one per record), as RESULTS.md says."""
    merged: dict[tuple, dict] = {record_key(r): r for r in old}
    for rec in new:
        key = record_key(rec)
        prev = merged.get(key)
        if prev is None:
            merged[key] = rec
            continue
        n_prev = len(prev["x_values"])
        prev_err = prev.get("rel_err") or [None] * n_prev
        pts = {
            json.dumps(x): (x, prev["y_values_50"][i], prev["y_values_20"][i], prev["y_values_80"][i], prev_err[i])
            for i, x in enumerate(prev["x_values"])
        }
        bad = {json.dumps(x) for x in prev.get("mismatch_x_values", [])}
        for i, x in enumerate(rec["x_values"]):
            k = json.dumps(x)
            pts[k] = (x, rec["y_values_50"][i], rec["y_values_20"][i], rec["y_values_80"][i], rec["rel_err"][i])
            bad.discard(k)
        bad |= {json.dumps(x) for x in rec.get("mismatch_x_values", [])}
        out = dict(rec)
        rows = _put_rows(out, pts.values())
        out["mismatch_x_values"] = [r[0] for r in rows if json.dumps(r[0]) in bad]
        merged[key] = out
    return list(merged.values())


def _old_records(path: Path) -> list[dict]:
    """The record list at ``path`` that a write merges into; empty (with a warning) if absent or unreadable."""
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        base.log(f"warning: {path} unreadable ({exc}); it will be overwritten")
        return []
    return old if isinstance(old, list) else []


def write_json(path: Path, records: list[dict]) -> list[dict]:
    """Merge ``records`` into the JSON list at ``path`` (created if absent); returns the merged list."""
    merged = merge_records(_old_records(path), records)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(merged, indent=1))
    tmp.replace(path)
    return merged
