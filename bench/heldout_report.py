"""The performance targets on the held-out shapes (and, with ``--grid``, on the grid): ours against the best peer.

    python -m bench.heldout_report                         # bench/results/h100/heldout.json
    python -m bench.heldout_report --grid                  # plus the rms_norm.json beside it
    python -m bench.heldout_report PATH --grid OTHER.json --markdown   # a table for PERFORMANCE.md
    git show REV:bench/results/h100/rms_norm.json > /tmp/old.json
    python -m bench.heldout_report --grid --baseline /tmp/old.json    # plus: what regressed since REV

Per shape and op (the plain norm's forward, backward and full; the fused add's fused_add_fwd and fused_add_bwd):
ours (tilegym_rms-cutile) in GB/s with its share of the copy bandwidth measured in the same run, the best peer
(every provider that is not one of tilegym_rms's: torch, torch.compile, Liger, TileGym, quack), their ratio, and
each performance target: where M*N >= 2^22, a forward >= 0.98x and a backward >= 1.0x the best peer; where
M*N >= 2^25, >= 92% of the copy bandwidth (forwards and backwards; full is shown, not judged). With --grid the
fused_add measure's grid is judged beside the plain grid.
A target is "n/a" below its size or for an op it does not name, "no data" where ours or every peer is absent;
a failed float64 check of ours ('!') misses it. Expected peers that are absent are listed. With --baseline,
the last target too: no shape of both runs may lose more than 2% of ours' share of the copy bandwidth
(the share, not GB/s, so that two runs' cards and copy figures may differ a little). A report, not a gate:
the exit code is 0 whatever the numbers say.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import bench_rmsnorm
from bench.common import base, report
from bench.tools import make_results

OURS = "tilegym_rms-cutile"
EXPECTED_PEERS = ("torch", "torch.compile", "liger", "tilegym", "quack")
FUSED_ADD_PEERS = ("torch", "torch.compile", "liger", "quack")  # TileGym has no fused add
OPS = bench_rmsnorm.HELDOUT_OPS
SUITES = ("heldout", "grid", "fused_add")
# ours / best peer, where M*N >= PEER_MIN_ELEMS
PEER_TARGET = {"forward": 0.98, "backward": 1.0, "fused_add_fwd": 0.98, "fused_add_bwd": 1.0}
PEER_MIN_ELEMS = 1 << 22
COPY_TARGET = 0.92  # ours / copy bandwidth, for the ops of PEER_TARGET, where M*N >= COPY_MIN_ELEMS
COPY_MIN_ELEMS = 1 << 25
MET, MISSED, NA, NO_DATA = "met", "MISSED", "n/a", "no data"
DEFAULT_RESULTS = base.BENCH_DIR / "results" / "h100" / bench_rmsnorm.HELDOUT_JSON_NAME


@dataclass
class Value:
    gbps: float
    copy_bw: float | None
    ok: bool  # the float64 check of this point passed


@dataclass
class Row:
    """One shape and op: ours, the best peer and the verdict on each target."""

    suite: str
    dtype: str
    m: int
    n: int
    op: str
    ours: Value | None
    best_peer: str | None
    best: Value | None
    missing: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.ours.gbps / self.best.gbps if self.ours and self.best else None

    @property
    def copy_share(self) -> float | None:
        return self.ours.gbps / self.ours.copy_bw if self.ours and self.ours.copy_bw else None

    def _verdict(self, target: float | None, min_elems: int, value: float | None) -> str:
        if target is None or self.m * self.n < min_elems:
            return NA
        if value is None:
            return NO_DATA
        return MET if self.ours.ok and value >= target else MISSED

    @property
    def peer_verdict(self) -> str:
        return self._verdict(PEER_TARGET.get(self.op), PEER_MIN_ELEMS, self.ratio)

    @property
    def copy_verdict(self) -> str:
        target = COPY_TARGET if self.op in PEER_TARGET else None
        return self._verdict(target, COPY_MIN_ELEMS, self.copy_share)


def measurements(recs: list[dict]) -> dict[tuple, dict[str, Value]]:
    """(suite, dtype, M, N, op) -> provider -> its median GB/s, over the throughput records of the ops of
    :data:`OPS` in the held-out, grid and fused-add suites (other suites and metrics are left out)."""
    out: dict[tuple, dict[str, Value]] = {}
    for rec in recs:
        cfg = json.loads(rec["extra_benchmark_config_str"])
        if (
            rec["kernel_name"] != bench_rmsnorm.KERNEL_NAME
            or rec["metric_name"] != "throughput"
            or rec["kernel_operation_mode"] not in OPS
            or cfg.get("suite") not in SUITES
        ):
            continue
        bad = {json.dumps(x) for x in rec.get("mismatch_x_values", [])}
        for x, y in zip(rec["x_values"], rec["y_values_50"], strict=True):
            m, n = make_results.shape_of(rec, x)
            key = (cfg["suite"], cfg["dtype"], m, n, rec["kernel_operation_mode"])
            ok = json.dumps(x) not in bad
            out.setdefault(key, {})[rec["kernel_provider"]] = Value(y, rec.get("copy_bandwidth_GBps"), ok)
    return out


def report_rows(recs: list[dict]) -> list[Row]:
    """One row per shape and op of ``recs``: by suite, then size, dtype and op."""
    rows = []
    for (suite, dtype, m, n, op), by in measurements(recs).items():
        peers = {p: v for p, v in by.items() if not p.startswith("tilegym_rms-")}
        best_peer = max(peers, key=lambda p: peers[p].gbps, default=None)
        expected = FUSED_ADD_PEERS if op in bench_rmsnorm.FUSED_ADD_OPS else EXPECTED_PEERS
        missing = [p for p in expected if p not in peers]
        rows.append(Row(suite, dtype, m, n, op, by.get(OURS), best_peer, peers.get(best_peer), missing))

    def order(r: Row) -> tuple:
        return (SUITES.index(r.suite), r.m * r.n, r.m, r.n, r.dtype, OPS.index(r.op))

    return sorted(rows, key=order)


def _gbps(v: Value | None, with_copy: bool = True) -> str:
    if v is None:
        return make_results.MISSING
    text = f"{v.gbps:.0f}"
    if with_copy and v.copy_bw:
        text += f" ({100 * v.gbps / v.copy_bw:.1f}%)"
    return text + ("" if v.ok else "!")


def cells(r: Row) -> list[str]:
    peer = f"{r.best_peer} {_gbps(r.best, with_copy=False)}" if r.best else make_results.MISSING
    target = PEER_TARGET.get(r.op)
    return [
        f"{r.m} × {r.n}",
        r.dtype,
        r.suite,
        f"2^{math.log2(r.m * r.n):.1f}",
        r.op,
        _gbps(r.ours),
        peer,
        f"{r.ratio:.3f}×" if r.ratio is not None else make_results.MISSING,
        f"≥ {target}×: {r.peer_verdict}" if r.peer_verdict != NA else NA,
        f"≥ {100 * COPY_TARGET:.0f}%: {r.copy_verdict}" if r.copy_verdict != NA else NA,
        ", ".join(r.missing) or "",
    ]


HEADERS = ["M × N", "dtype", "suite", "M·N", "op", "ours GB/s (% copy)", "best peer GB/s", "ours / peer"]
HEADERS += ["vs best peer", "vs copy", "peers absent"]


def summary(rows: list[Row]) -> list[str]:
    """One line per target: how many shapes it was judged on, met, missed (named) and without data."""
    lines = []
    targets = [(f"{op} ≥ {t}× the best peer (M·N ≥ 2^22)", op, "peer_verdict") for op, t in PEER_TARGET.items()]
    targets += [(f"{op} ≥ {100 * COPY_TARGET:.0f}% of copy (M·N ≥ 2^25)", op, "copy_verdict") for op in PEER_TARGET]
    for title, op, attr in targets:
        judged = [r for r in rows if r.op == op and getattr(r, attr) != NA]
        met = sum(getattr(r, attr) == MET for r in judged)
        missed = [r for r in judged if getattr(r, attr) == MISSED]
        no_data = sum(getattr(r, attr) == NO_DATA for r in judged)
        line = f"{title}: met at {met} of {len(judged)} shapes"
        if missed:
            line += "; missed at " + ", ".join(f"{r.m} × {r.n} {r.dtype}" for r in missed)
        if no_data:
            line += f"; no data at {no_data}"
        lines.append(line)
    absent = sorted({p for r in rows for p in r.missing}, key=EXPECTED_PEERS.index)
    if absent:
        lines.append(f"peers absent from some rows: {', '.join(absent)} (the best peer is the best of those present)")
    return lines


REGRESSION_LIMIT = 0.98  # ours' share of copy now / in the baseline, below which a shape regressed


def regressions(recs: list[dict], baseline: list[dict]) -> tuple[int, list[tuple[tuple, float]]]:
    """``(shapes compared, [(key, now / before)])`` for every (suite, dtype, M, N, op) that ours measured in
    both with a copy figure, where ours' share of the copy bandwidth fell below REGRESSION_LIMIT times the
    baseline's; worst first."""
    now, before = measurements(recs), measurements(baseline)
    compared, worse = 0, []
    for key, by in now.items():
        a, b = by.get(OURS), before.get(key, {}).get(OURS)
        if not (a and b and a.copy_bw and b.copy_bw):
            continue
        compared += 1
        ratio = (a.gbps / a.copy_bw) / (b.gbps / b.copy_bw)
        if ratio < REGRESSION_LIMIT:
            worse.append((key, ratio))
    return compared, sorted(worse, key=lambda kv: kv[1])


def render_regressions(compared: int, worse: list[tuple[tuple, float]]) -> str:
    limit = f"{100 * (1 - REGRESSION_LIMIT):.0f}%"
    if not worse:
        return f"no shape lost more than {limit} against the baseline ({compared} shapes compared)"
    lines = [f"{len(worse)} of {compared} shapes lost more than {limit}"]
    lines += [
        f"{m} × {n} {dtype} {op} ({suite}): {ratio:.3f}× the baseline" for (suite, dtype, m, n, op), ratio in worse
    ]
    return "\n".join(lines)


def render(rows: list[Row], markdown: bool = False) -> str:
    if not rows:
        return "no held-out, grid or fused-add throughput records"
    body = [cells(r) for r in rows]
    if markdown:
        table = make_results.markdown_table(HEADERS, body)
        return table + "\n\n" + "\n".join(f"- {line}" for line in summary(rows))
    return report.format_table(HEADERS, body, left=5) + "\n\n" + "\n".join(summary(rows))


def load(paths: list[Path]) -> list[dict]:
    """The records of every readable file of ``paths``; each unreadable one is said on stderr and skipped."""
    recs = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"{path}: not read ({exc}); PERFORMANCE.md says how to run the held-out measure", file=sys.stderr)
            continue
        recs += data if isinstance(data, list) else []
    return recs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.heldout_report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "results", nargs="?", type=Path, default=DEFAULT_RESULTS, help="held-out results (default %(default)s)"
    )
    parser.add_argument(
        "--grid",
        nargs="?",
        const="",  # --grid alone
        default=None,
        help="also judge the grid shapes of this results file (alone: the rms_norm.json beside RESULTS)",
    )
    parser.add_argument("--markdown", action="store_true", help="a Markdown table and list, for PERFORMANCE.md")
    parser.add_argument(
        "--baseline", nargs="+", type=Path, help="earlier results files: list the shapes that regressed since"
    )
    args = parser.parse_args(argv)
    paths = [args.results]
    if args.grid is not None:
        paths.append(Path(args.grid) if args.grid else args.results.parent / bench_rmsnorm.JSON_NAME)
    recs = load(paths)
    print(render(report_rows(recs), args.markdown))
    if args.baseline:
        print("\n" + render_regressions(*regressions(recs, load(args.baseline))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
