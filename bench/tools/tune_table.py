"""Write a cuTile tuning table (``tilegym_rms/cutile/tuning/<key>.json``): time candidates per bucket on a GPU.

For each (op, dtype, N bucket, M bucket) the sweep times the candidates of ``build.candidates`` (the analytic
choice first, then a few neighbours of each kernel or strategy) through the product's own host path, each
installed as a one-entry table (``tuning.use_table``), with the benchmarks' method: the sum of the op's kernels'
device time (torch.profiler) over inputs rotating through more than 4x the L2 cache, each first checked against
float64 on a few rows (``bench.tools.candidate_check``: a candidate with wrong values is not timed, and its run's
``"failed"`` says why; ``--no-check`` skips it). The winner is the fastest unless it beats the analytic choice by
less than ``--min-gain``; every candidate's GB/s is kept in the run of ``--out``, so that table documents itself.
``--slim`` also writes the table the package ships from it (``build.slim``: each run's winner and the winner's own
GB/s), whose lookups are the same; the full one goes with the card's results
(``bench/results/<gpu>/sweeps/table_<key>_candidates.json``). The files are rewritten after each (op, dtype, N),
so an interrupted sweep resumes with ``--merge`` on its ``--out``: points already measured are skipped.

    FULL=bench/results/h100/sweeps/table_sm90_132sm_candidates.json SHIP=tilegym_rms/cutile/tuning/sm90_132sm.json
    python -m bench.tools.tune_table --device cuda:0 --out $FULL --slim $SHIP         # the whole sweep
    python -m bench.tools.tune_table --quick --dtypes bf16 --out /tmp/t.json         # a smaller sweep
    python -m bench.tools.tune_table --estimate --sms 132                             # counts and estimate, no GPU
    python -m bench.tools.tune_table --ops fused_forward,qk --dtypes bf16 --quick --m 4096,32768 --out s.json
    python -m bench.tools.tune_table --ops forward --wide --dtypes bf16 --n 64,128,256 --m 65536 --out w.json
    python -m bench.tools.tune_table --overlay s.json --base $FULL --out $FULL --slim $SHIP  # into the shipped table
    python -m bench.tools.tune_table --overlay s.json --leave-out forward/bf16/8192 --base $FULL --out $FULL \\
        --slim $SHIP                                           # less an entry the A/B between buckets rejected
    python -m bench.tools.tune_table --overlay h200.json --base $FULL \\
        --out bench/results/h200/sweeps/table_sm90_132sm.nvidia-h200_candidates.json \\
        --slim tilegym_rms/cutile/tuning/sm90_132sm.nvidia-h200.json  # a card's first table, from its class's
    python -m bench.tools.tune_table --analytic --sms 132 --capability 9.0 --name "NVIDIA H100 80GB HBM3" \\
        --out $SHIP                                                                  # the analytic table, no GPU

``--after-forward`` times each backward candidate after the forward the device's table launches, as a training
step runs them: a backward can win alone and lose there (PERFORMANCE.md, "Backward", "In the training step").
Its runs record ``"timed"`` and the GB/s of the pair.

An overlay keeps a bucket's winner unless the sweep timed it and beat it by ``--min-gain`` (``build.overlay``).
The sweep's key is the device's (``tuning.device_key``): an H200's is ``sm90_132sm.nvidia-h200``, so its sweep
never lands in the H100's table. Overlaid with its class's table as ``--base``, it starts the card's own table
from the class's winners (``build.card_start``): buckets the card's sweep did not measure keep what the card ran
before its table shipped.

Ops (``--ops``, default forward,backward): ``forward`` and ``backward`` time ``cutile.forward`` /
``cutile.backward``; ``fused_forward`` the forward candidates through ``cutile.fused_add_forward(x, r, w,
..., mode="pre")`` (traffic: four streams per row); ``qk`` the qk candidates (each half of the heuristics'
choice with half, the same or twice the rows per tile and once or twice the blocks per SM) through
``cutile.qk_forward`` and ``cutile.qk_backward`` (with its dw reduction) on dense ``(G, 16, D)`` q and
``(G, 4, D)`` k, handed over as the views ``qk_rms_norm`` makes of them (``qk_product_views``), k a fifth of
the rows (M buckets below 32 rows skipped). The qk forward and backward are timed
apart: they are separate launches whose configs do not interact, so the best forward half and the best
backward half make the winner (11 candidates, 12 timings) where timing every pair would take 36; ``--qk-half
fwd`` (or ``bwd``) times one half alone, the winner keeping the other half of the launch the device's table
gives there. qk runs at head dims ``QK_N`` unless ``--n`` names others (at most ``Heuristics.qk_max_tile_n``).

``--span`` also times every candidate at 5/8 of each M bucket's rows (``build.span_rows``; forward, backward
and fused forward) and chooses the winner by the geometric mean of its GB/s at both points (``build.scores``):
a bucket's winner serves every row count from half its point up, and one timed at the point alone can lose
3-12% below it (PERFORMANCE.md, "Tuning tables", "Between bucket points"). Its runs record ``"span"``.

``--wide`` times more candidates per point (``build.candidates(wide=True)``: occupancy hints of 2x and 4x,
half tiles, up to 64x the blocks of the persistent forward, a padded forward row as tile plus tail, narrower
chunks for rows wider than one (the gather's at half, the split forward's at a half and a quarter), builds of
each persistent tile at one block per SM with eight warps and at occupancy 1 (the deepest ring of TMA load
stages, PERFORMANCE.md, "Toolchain"), the plain norm's choice for qk): about twice the compiles and several
times the timings, so it is meant for few widths at a time (``--estimate`` estimates a sweep's size and time;
PERFORMANCE.md, "Tuning tables", has some).

Shapes above ``MAX_ELEMENTS`` are not timed (their M run is the one below: the floor rule of the schema).
The tool lives in bench/tools/ because it needs the benchmarks' timer; the package holds the table format and
buckets (``tilegym_rms.cutile.tuning``) and the candidates, winner rule, merge and overlay
(``tilegym_rms.cutile.tuning.build``), so the sweep and the host share one definition.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import asdict, replace

import torch

from bench.common import base, timing, traffic
from bench.tools import candidate_check, tune_cutile
from tilegym_rms.cutile import config, tuning
from tilegym_rms.cutile.tuning import build
from tilegym_rms.ops import qk as qk_ops

M_DEFAULT = (1, 64, 512, 2048, 8192, 32768)
M_QUICK = (1, 512, 8192)
# Quick: every 512 columns up to 8192 and the coarse points (the dense 128-column steps are the slow part).
N_QUICK = tuple(n for n in tuning.N_BUCKETS if n <= 128 or n % 512 == 0)
QK_N = (64, 96, 128, 256)  # the head dims of the common models (as bench_rmsnorm.py --measure qk_norm, plus 96)
QK_HALVES = ("fwd", "bwd")  # the two halves of a qk candidate, timed apart (--qk-half: one of them)
MAX_ELEMENTS = 1 << 28  # 512 MiB of bf16 per tensor: the backward's inputs and outputs stay far below 80 GB
# The estimate's unit times (H100; the run prints its real pace): one compile, one timed candidate.
COMPILE_S = 3.0
TIMING_S = 0.15


def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.tune_table", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", help="the table to write, every candidate's GB/s kept")
    parser.add_argument(
        "--slim", metavar="TABLE", help="also write the table to ship: the winners of --out's (build.slim)"
    )
    parser.add_argument("--ops", default="forward,backward", help=f"some of {','.join(tuning.OPS)}")
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--n", type=parse_ints, help="N bucket points (default: all of tuning.N_BUCKETS)")
    parser.add_argument("--m", type=parse_ints, help=f"M buckets (default {M_DEFAULT})")
    parser.add_argument("--quick", action="store_true", help=f"N every 512 columns, M {M_QUICK}")
    parser.add_argument(
        "--wide", action="store_true", help="more candidates per point (build.candidates(wide=True)): slower"
    )
    parser.add_argument(
        "--span", action="store_true", help="also time each candidate at 5/8 of the bucket's rows; choose by both"
    )
    parser.add_argument(
        "--qk-half",
        choices=QK_HALVES,
        help="qk: time this half's candidates alone; the run keeps the other half the device's table launches",
    )
    parser.add_argument("--merge", help="an existing table: its measured points are kept and skipped")
    parser.add_argument("--reps", type=int, default=3, help="timed passes over the rotating inputs (median)")
    parser.add_argument(
        "--min-gain",
        type=float,
        default=0.01,
        help="a winner must beat the analytic choice (--overlay: the base's) by this",
    )
    parser.add_argument(
        "--after-forward",
        action="store_true",
        help="backward: time each candidate after the forward the device's table launches, as a training step "
        "runs it; the run's GB/s are then the forward + backward's (PERFORMANCE.md, 'In the training step')",
    )
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="time candidates without first checking their values against float64 (bench.tools.candidate_check)",
    )
    parser.add_argument("--estimate", action="store_true", help="print the counts and the time estimate; no GPU")
    parser.add_argument("--analytic", action="store_true", help="write the analytic heuristics' table; no GPU")
    parser.add_argument(
        "--overlay",
        metavar="SWEEP",
        help="lay a measured sweep over --base (build.overlay) and write --out; no GPU",
    )
    parser.add_argument(
        "--leave-out",
        metavar="OP/DTYPE[/N[/M]]",
        action="append",
        default=[],
        help="--overlay: a sweep entry not to lay over (e.g. forward/bf16/8192, one an A/B rejected), or every "
        "width of a dtype (fused_forward/fp32, one no A/B has timed yet), or one M bucket of a width "
        "(backward/bf16/1152/32768: the base's winner stays there, a qk winner's both halves, and the sweep's other "
        "buckets land); repeatable",
    )
    parser.add_argument(
        "--base",
        metavar="TABLE",
        help="--overlay: the table to keep and lay the sweep over, e.g. the shipped one (default: the analytic table)",
    )
    parser.add_argument("--sms", type=int, help="--estimate / --analytic: the SM count")
    parser.add_argument("--capability", default="9.0", help="--analytic: compute capability, e.g. 9.0")
    parser.add_argument("--name", default="", help="--analytic: the device's name")
    return parser


def write(doc: dict, args) -> None:
    """Writes ``doc`` to ``--out`` and its winners (:func:`build.slim`) to ``--slim``, if given."""
    build.write(doc, args.out)
    if args.slim:
        build.write(build.slim(doc), args.slim)


def sweep_args(args) -> tuple[list[str], dict[str, list[tuple[str, int, int]]]]:
    """The ops, and each op's (dtype, N bucket, M bucket) points."""
    ops = args.ops.split(",")
    dtypes = args.dtypes.split(",")
    ns = args.n or (N_QUICK if args.quick else tuning.N_BUCKETS)
    ms = args.m or (M_QUICK if args.quick else M_DEFAULT)
    bad = [n for n in ns if n not in tuning.N_BUCKETS] + [m for m in ms if m not in tuning.M_BUCKETS]
    if bad or not set(ops) <= set(tuning.OPS) or not set(dtypes) <= set(tuning.DTYPES):
        raise SystemExit(f"not bucket points, ops or dtypes of tilegym_rms.cutile.tuning: {bad or ops + dtypes}")
    points = {}
    for op in ops:
        op_ns, op_ms = ns, ms
        if op == "qk":
            op_ns = [n for n in (args.n or QK_N) if n <= config.HEURISTICS.qk_max_tile_n]
            op_ms = [m for m in ms if build.qk_sweep_tokens(m)]
        points[op] = [p for p in build.sweep_points(dtypes, op_ns, op_ms) if p[1] * p[2] <= MAX_ELEMENTS]
    return ops, points


def timed_parts(op: str, cands, halves=QK_HALVES) -> set:
    """What the sweep times for ``cands``: each candidate, or each distinct half of a qk candidate among
    ``halves``."""
    if op != "qk":
        return {build.label(op, c) for c in cands}
    return {build.qk_half_label(c, side) for c in cands for side in halves}


def compiled_parts(op: str, dt: str, n_b: int, cands, halves=QK_HALVES) -> set:
    """The compiled variants ``cands`` need (blocks per SM only changes the grid)."""
    if op == "qk":
        return {
            (op, dt, n_b, side, getattr(c, f"{side}_tile_m"), getattr(c, f"{side}_occupancy"))
            for c in cands
            for side in halves
        }  # fmt: skip (the tile is one head wide: N's bucket sets it)
    return {(op, dt, *(v for k, v in asdict(c).items() if k != "blocks_per_sm")) for c in cands}


def estimate(ops, points, sms: int, done=frozenset(), wide: bool = False, span: bool = False, halves=QK_HALVES) -> dict:
    """What a sweep will do: points, timed candidates and distinct compiled variants, and the estimated
    time (``span``: the timings of :func:`spans` points twice; ``halves``: the qk halves timed)."""
    n_points = timings = 0
    variants = set()
    for op in ops:
        for dt, n_b, m_b in points[op]:
            if (op, dt, n_b, m_b) in done:
                continue
            cands = build.candidates(op, m_b, n_b, tuning.DTYPES[dt], sms, wide)
            n_points += 1
            timings += len(timed_parts(op, cands, halves)) * (2 if span and spans(op, m_b) else 1)
            variants.update(compiled_parts(op, dt, n_b, cands, halves))
    seconds = len(variants) * COMPILE_S + timings * TIMING_S
    return {"points": n_points, "timings": timings, "variants": len(variants), "estimate_s": seconds}


def qk_halves(args) -> tuple[str, ...]:
    """The qk halves a sweep times: ``--qk-half``'s, else both."""
    return (args.qk_half,) if args.qk_half else QK_HALVES


def spans(op: str, m_b: int) -> bool:
    """Whether ``--span`` times a second point in ``op``'s M bucket ``m_b`` (not qk: its M buckets count q's
    and k's rows together, and its halves are timed apart)."""
    return op != "qk" and build.span_rows(m_b) is not None


def measured_points(doc: dict | None) -> set:
    if doc is None:
        return set()
    return {
        (op, dt, int(n), r["m"])
        for op in tuning.OPS
        for dt, by_n in doc.get(op, {}).items()
        for n, runs in by_n.items()
        for r in runs
        if "gbps" in r
    }


def qk_winner(cands, gbps: dict[str, float], min_gain: float, untimed=None):
    """The qk winner from the halves' timings: the best forward half and the best backward half, each kept
    at the heuristics' (``cands[0]``) unless beaten by ``min_gain``; a half with no timing (``--qk-half``)
    is ``untimed``'s (the device table's winner; None: the heuristics')."""
    out = cands[0]
    for side in QK_HALVES:
        by_label = {build.qk_half_label(c, side): c for c in cands}
        mine = {k: v for k, v in gbps.items() if k in by_label}
        if not mine:
            best = untimed or cands[0]
        else:
            best = by_label[build.select_winner(mine, build.qk_half_label(cands[0], side), min_gain)]
        fields = (f"{side}_{k}" for k in ("tile_m", "blocks_per_sm", "occupancy"))
        out = replace(out, **{f: getattr(best, f) for f in fields})
    return out


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = "python -m bench.tools.tune_table " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.leave_out and not args.overlay:
        parser.error("--leave-out names entries of the sweep an --overlay lays over: give --overlay")
    if args.overlay:
        if not args.out:
            parser.error("--overlay needs --out")
        try:  # validated, in the current schema
            measured, keep_base = build.leave_out(tuning.load(args.overlay).doc, args.leave_out)
        except tuning.TuningTableError as e:
            parser.error(str(e))
        dev = measured["device"]
        if args.base:  # read before --out may overwrite it
            base = tuning.load(args.base).doc
            if build.is_card_of(dev["key"], base["device"]["key"]):
                base = build.card_start(base, dev)  # the card's first table, begun from its class's
        else:
            base = build.analytic_doc(dev["key"], dev["name"], dev["capability"], dev["sms"], command)
        write(build.overlay(base, measured, args.min_gain, keep_base), args)
        print(f"wrote {args.out} ({dev['key']}, {args.overlay} over {args.base or 'the analytic table'})")
        return 0
    if args.analytic:
        if not (args.sms and args.out):
            parser.error("--analytic needs --sms and --out")
        cc = tuple(int(v) for v in args.capability.split("."))
        key = tuning.class_key(cc, args.sms)
        write(build.analytic_doc(key, args.name, cc, args.sms, command), args)
        print(f"wrote {args.out} ({key}, analytic)")
        return 0
    ops, points = sweep_args(args)
    base_doc = tuning.load(args.merge).doc if args.merge else None
    done = measured_points(base_doc)
    if args.estimate:
        p = estimate(ops, points, args.sms or 132, done, args.wide, args.span, qk_halves(args))
        print(
            f"{p['points']} points, {p['timings']} timings, {p['variants']} variants; ~{p['estimate_s'] / 60:.0f} min"
        )
        return 0
    if not args.out:
        parser.error("--out is required")
    device = timing.cuda_device(parser.prog)
    if device is None:
        return 2
    return sweep(args, command, device, ops, points, base_doc, done)


def host_incumbent(table, op: str, m_b: int, n_b: int, dtype: torch.dtype):
    """What the host launches at a point with ``table`` (None: no table, the heuristics): the first winner along
    the op's fallback chain (``Table.winners``: a fused forward without an entry may borrow another's), which the
    sweep times beside its candidates."""
    return next(table.winners(op, m_b, n_b, dtype), None) if table is not None else None


def sweep(args, command, device, ops, points, base_doc, done) -> int:
    import tilegym_rms.cutile as cutile

    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    key = tuning.device_key(index)
    if base_doc is not None and base_doc["device"]["key"] != key:
        print(f"--merge table is for {base_doc['device']['key']}, this device is {key}", file=sys.stderr)
        return 2
    device_table = tuning.table_for(index)
    # --after-forward: the forward the device's table launches (none: the heuristics'), as a training step runs it
    forward_doc = (device_table.doc if device_table is not None else {}) if args.after_forward else None
    timer = timing.Timer(device, "profiler")
    print(timer.calibrate())
    copy_bw = traffic.summarize(timing.copy_bandwidth(timer, device, base.COPY_BYTES, 5)[0])[0]
    name = torch.cuda.get_device_name(index)
    cc = torch.cuda.get_device_capability(index)
    doc = build.new_doc(key, name, cc, sms, "measured", command)
    doc["copy_gbps"] = round(copy_bw, 1)
    if base_doc is not None:
        doc = build.merge(base_doc, doc)
    p = estimate(ops, points, sms, done, args.wide, args.span, qk_halves(args))
    print(f"{name} ({key}), copy {copy_bw:.0f} GB/s: {p['points']} points, {p['timings']} timings, ")
    print(f"{p['variants']} compiled variants; estimate ~{p['estimate_s'] / 60:.0f} min", flush=True)
    reps = args.reps
    start, timed = time.monotonic(), 0
    for op in ops:
        by_entry: dict[tuple[str, int], list[int]] = {}
        for dt, n_b, m_b in points[op]:
            if (op, dt, n_b, m_b) not in done:
                by_entry.setdefault((dt, n_b), []).append(m_b)
        for (dt, n_b), ms in by_entry.items():
            dtype = tuning.DTYPES[dt]
            runs = []
            for m_b in ms:
                point = (cutile, timer, device, key, op, dtype, n_b, m_b, reps, args.min_gain)
                incumbent = host_incumbent(device_table, op, m_b, n_b, dtype)
                span = args.span and spans(op, m_b)
                runs.append(
                    time_point(
                        *point,
                        args.wide,
                        forward_doc,
                        span=span,
                        incumbent=incumbent,
                        check=not args.no_check,
                        halves=qk_halves(args),
                    )
                )
                timed += len(runs[-1]["gbps"]) + len(runs[-1].get("span", {}).get("gbps", {}))
            if runs:
                new = build.new_doc(key, name, cc, sms, "measured", command)
                build.set_runs(new, op, dt, n_b, runs)
                doc = build.merge(doc, new)
                write(doc, args)
            pace = (time.monotonic() - start) / max(timed, 1)
            left = (p["timings"] - timed) * pace
            print(f"  {op} {dt} N={n_b}: {timed}/{p['timings']} timed, ~{left / 60:.1f} min left", flush=True)
    print(f"wrote {args.out} ({doc['source']})")
    return 0


def _inputs(op: str, m_b: int, n_b: int, dtype: torch.dtype, device: torch.device):
    """``(input sets, {timed part: (call, bytes)})`` of one point: the plain ops' from tune_cutile; the fused
    forward's (x, residual); the qk views' (q, k, their output gradients and rstd), one part per half."""
    if op in ("forward", "backward"):
        sets, nbytes = tune_cutile._inputs(op, m_b, n_b, dtype, device)
        return sets, {"": (nbytes, op)}
    elt = dtype.itemsize
    if op == "fused_forward":
        count, _ = traffic.rotation_sets(4 * m_b * n_b * elt, timing.l2_bytes(device))
        sets = [tuple(torch.randn(m_b, n_b, dtype=dtype, device=device) for _ in "xr") for _ in range(count)]
        return sets, {"": (traffic.fused_add_forward_bytes(m_b, n_b, elt), op)}
    tokens = build.qk_sweep_tokens(m_b)
    hq, hk = build.QK_SWEEP_HEADS
    count, _ = traffic.rotation_sets(3 * tokens * (hq + hk) * n_b * elt, timing.l2_bytes(device))
    sets = []
    for _ in range(count):
        q, k = (torch.randn(tokens, h, n_b, dtype=dtype, device=device) for h in (hq, hk))
        q, k = qk_product_views(q), qk_product_views(k)
        rq, rk = (torch.rand(t.shape[:3], device=device) + 0.5 for t in (q, k))
        sets.append((q, k, torch.randn_like(q), torch.randn_like(k), rq, rk))
    rows = tokens * hq  # traffic.qk_rows: q's rows, k's from base.QK_HEADS (the same 16 and 4 heads)
    return sets, {"fwd": (traffic.qk_forward_bytes(rows, n_b, elt), "qk_fwd"),
                  "bwd": (traffic.qk_backward_bytes(rows, n_b, elt), "qk_bwd")}  # fmt: skip


def qk_product_views(t: torch.Tensor) -> torch.Tensor:
    """The ``(A, G, H, D)`` view ``qk_rms_norm`` hands the cuTile host for ``t`` (ops merges the dims of dense
    layouts: a contiguous ``(tokens, heads, D)`` becomes ``(1, 1, tokens * heads, D)``). The kernels split a tile
    by the view's shape, so a sweep on other views would tune a walk the product does not run."""
    return qk_ops._qk_views([t])[0][0]


AFTER_FORWARD = "backward after the forward"  # --after-forward: what a backward run timed


def _call(cutile, kind: str, w):
    """The product host call timed for ``kind`` (an op, :data:`AFTER_FORWARD`, or "qk_fwd" / "qk_bwd"),
    weights ``w`` (both)."""
    if kind in ("forward", "backward"):
        return tune_cutile._call(cutile, kind, w)
    if kind == AFTER_FORWARD:  # a training step's order: the forward's rstd feeds the backward
        forward, backward = (tune_cutile._call(cutile, op, w) for op in ("forward", "backward"))
        return lambda s: backward((s[0], s[1], forward(s)[1]))
    if kind == "fused_forward":
        return lambda s: cutile.fused_add_forward(s[0], s[1], w, 1e-6, 0.0, "llama", mode="pre")
    if kind == "qk_fwd":
        return lambda s: cutile.qk_forward(s[0], s[1], w, w, 1e-6, 0.0, "llama")
    return lambda s: cutile.qk_backward(s[0], s[1], s[2], s[3], w, w, s[4], s[5], 0.0, "llama")


def candidate_table(key: str, sms: int, op: str, dtype: torch.dtype, n_b: int, cand, forward_doc=None) -> dict:
    """The table a candidate is timed with: its one entry, plus ``forward_doc``'s forward entries when the
    backward is timed after the forward (so that forward is the one the device's table launches)."""
    one = build.new_doc(key, "", (0, 0), sms, "measured", "")
    if forward_doc is not None:
        one["forward"] = forward_doc.get("forward", {})
    build.set_runs(one, op, tuning.DTYPE_NAMES[dtype], n_b, [{"m": 1, "winner": asdict(cand)}])
    return one


def time_point(
    cutile,
    timer,
    device,
    key,
    op,
    dtype,
    n_b,
    m_b,
    reps,
    min_gain,
    wide=False,
    forward_doc=None,
    span=False,
    incumbent=None,
    check=True,
    halves=QK_HALVES,
) -> dict:
    """One run: every candidate at (m_b, n_b) timed through the product's host path (each half of a qk
    candidate once), and ``incumbent`` (the device's table's winner there) where the candidates lack it, so
    that an overlay can weigh the new winner against it; the winner. With ``forward_doc`` (``--after-forward``)
    a backward candidate is timed after the forward of that table, its GB/s those of the pair, and the run
    records ``"timed"``. With ``span`` every candidate is timed at ``build.span_rows(m_b)`` rows too (the run's
    ``"span"``) and the winner chosen by ``build.scores``. With ``check`` each candidate first computes its op
    against float64 (:mod:`.candidate_check`); one whose values are wrong is not timed, and the run's
    ``"failed"`` records its errors. A qk point times the halves in ``halves`` only; the other half of its
    winner is ``incumbent``'s."""
    after = op == "backward" and forward_doc is not None
    w = torch.randn(n_b, dtype=dtype, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    cands = build.candidates(op, m_b, n_b, dtype, sms, wide)
    if incumbent is not None and incumbent not in cands:
        cands.append(incumbent)
    failed = {}
    if check:  # a candidate whose values are wrong is not timed: a fast wrong launch must not win
        for cand in cands:
            with tuning.use_table(candidate_table(key, sms, op, dtype, n_b, cand)):
                try:
                    errs = candidate_check.errors(cutile, op, dtype, n_b, w)
                except Exception:  # noqa: BLE001 - a candidate that fails to compile: the timing reports it
                    continue
            bad = candidate_check.beyond_tolerance(errs, tuning.DTYPE_NAMES[dtype])
            if bad:
                what = build.label(op, cand)
                failed[what] = {k: round(v, 6) for k, v in bad.items()}
                print(f"    {op} {n_b} {what}: wrong values {failed[what]}")
        cands = [c for c in cands if build.label(op, c) not in failed]
        if not cands:
            raise RuntimeError(f"{op} {tuning.DTYPE_NAMES[dtype]} {m_b}x{n_b}: every candidate computed wrong values")

    def time_all(m: int) -> dict[str, float]:
        sets, parts = _inputs(op, m, n_b, dtype, device)
        if op == "qk":
            parts = {side: part for side, part in parts.items() if side in halves}
        if after:
            parts = {"": (traffic.full_bytes(m, n_b, dtype.itemsize), AFTER_FORWARD)}
        gbps = {}
        for cand in cands:
            one = candidate_table(key, sms, op, dtype, n_b, cand, forward_doc if after else None)
            for side, (nbytes, kind) in parts.items():
                what = build.qk_half_label(cand, side) if op == "qk" else build.label(op, cand)
                if what in gbps:
                    continue  # a qk half already timed with another candidate
                with tuning.use_table(one):
                    try:
                        call = _call(cutile, kind if op == "qk" or after else op, w)
                        us = tune_cutile._time_us(timer, call, sets, reps)
                        gbps[what] = round(traffic.gbps(nbytes, us), 1)
                    except Exception as exc:  # noqa: BLE001 - a candidate that fails to compile is a result too
                        print(f"    {op} {m}x{n_b} {what}: {base.short_error(exc)}", flush=True)
        return gbps

    run = {"m": m_b, "gbps": time_all(m_b)}
    if op == "qk":
        run = {"m": m_b, "winner": asdict(qk_winner(cands, run["gbps"], min_gain, incumbent)), "gbps": run["gbps"]}
    else:
        if span:
            m_span = build.span_rows(m_b)
            run["span"] = {"m": m_span, "gbps": time_all(m_span)}
        winner = build.select_winner(build.scores(run), build.label(op, cands[0]), min_gain)
        by_label = {build.label(op, c): c for c in cands}
        run = {"m": m_b, "winner": asdict(by_label[winner]), **{k: v for k, v in run.items() if k != "m"}}
    if failed:
        run["failed"] = failed
    return {**run, "timed": AFTER_FORWARD} if after else run


if __name__ == "__main__":
    sys.exit(main())
