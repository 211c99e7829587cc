"""Write a cuTile tuning table (``tilegym_rms/cutile/tuning/<key>.json``): time candidates per bucket on a GPU.

For each (op, dtype, N bucket, M bucket) the sweep times the candidates of ``tuning.candidates`` (the
analytic choice first, then a few neighbours of each kernel or plan) through the product's own host path,
each installed as a one-entry table (``tuning.use_table``), with the benchmarks' method: the sum of the
op's kernels' device time (torch.profiler) over inputs rotating through more than 4x the L2 cache. The
winner is the fastest unless it beats the analytic choice by less than ``--min-gain``; every candidate's
GB/s is kept in the run, so the table documents itself. The file is rewritten after each (op, dtype, N),
so an interrupted sweep resumes with ``--merge`` on its own output: points already measured are skipped.

    python bench/tune_table.py --device cuda:0 --out tilegym_rms/cutile/tuning/sm90_132sm.json
    python bench/tune_table.py --quick --dtypes bf16 --out /tmp/t.json         # a smaller sweep
    python bench/tune_table.py --plan --sms 132                                 # counts and estimate, no GPU
    python bench/tune_table.py --analytic --sms 132 --capability 9.0 --name "NVIDIA H100 80GB HBM3" \\
        --out tilegym_rms/cutile/tuning/sm90_132sm.json                       # the analytic table, no GPU

Shapes above ``MAX_ELEMENTS`` are not timed (their M run is the one below: the floor rule of the schema).
The tool lives in bench/ because it needs the benchmarks' timer; the package holds the table format,
buckets, candidates, winner rule and merge (``tilegym_rms.cutile.tuning``), so both share one definition.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict

import torch

try:  # imported as part of the bench package / namespace
    from . import base, timing, traffic, tune_cutile
except ImportError:  # run as a script: bench/ is on sys.path
    import base
    import timing
    import traffic
    import tune_cutile

from tilegym_rms.cutile import tuning

M_DEFAULT = (1, 64, 512, 2048, 8192, 32768)
M_QUICK = (1, 512, 8192)
# Quick: every 512 columns up to 8192 and the coarse points (the dense 128-column steps are the slow part).
N_QUICK = tuple(n for n in tuning.N_BUCKETS if n <= 128 or n % 512 == 0)
MAX_ELEMENTS = 1 << 28  # 512 MiB of bf16 per tensor: the backward's inputs and outputs stay far below 80 GB
# Plan estimate (H100; the run prints its real pace): one compile, one timed candidate.
COMPILE_S = 3.0
TIMING_S = 0.15


def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tune_table.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", help="the table to write")
    parser.add_argument("--ops", default="forward,backward", help="forward,backward")
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--n", type=parse_ints, help="N bucket points (default: all of tuning.N_BUCKETS)")
    parser.add_argument("--m", type=parse_ints, help=f"M buckets (default {M_DEFAULT})")
    parser.add_argument("--quick", action="store_true", help=f"N every 512 columns, M {M_QUICK}")
    parser.add_argument("--merge", help="an existing table: its measured points are kept and skipped")
    parser.add_argument("--reps", type=int, default=3, help="timed passes over the rotating inputs (median)")
    parser.add_argument("--min-gain", type=float, default=0.01, help="a winner must beat the analytic by this")
    parser.add_argument("--plan", action="store_true", help="print the counts and the time estimate; no GPU")
    parser.add_argument("--analytic", action="store_true", help="write the analytic heuristics' table; no GPU")
    parser.add_argument(
        "--overlay",
        metavar="SWEEP",
        help="lay a measured sweep over the analytic table of its device (tuning.overlay) and write --out; no GPU",
    )
    parser.add_argument("--sms", type=int, help="--plan / --analytic: the SM count")
    parser.add_argument("--capability", default="9.0", help="--analytic: compute capability, e.g. 9.0")
    parser.add_argument("--name", default="", help="--analytic: the device's name")
    return parser


def sweep_args(args) -> tuple[list[str], list[str], list[int], list[int]]:
    ops = args.ops.split(",")
    dtypes = args.dtypes.split(",")
    ns = args.n or (N_QUICK if args.quick else tuning.N_BUCKETS)
    ms = args.m or (M_QUICK if args.quick else M_DEFAULT)
    bad = [n for n in ns if n not in tuning.N_BUCKETS] + [m for m in ms if m not in tuning.M_BUCKETS]
    if bad or not set(ops) <= set(tuning.OPS) or not set(dtypes) <= set(tuning.DTYPES):
        raise SystemExit(f"not bucket points, ops or dtypes of tilegym_rms.cutile.tuning: {bad or ops + dtypes}")
    return ops, dtypes, list(ns), list(ms)


def plan(ops, dtypes, ns, ms, sms: int, done=frozenset()) -> dict:
    """What a sweep will do: points, timed candidates and distinct compiled variants (blocks per SM only
    changes the grid), and the estimated time."""
    points = timings = 0
    variants = set()
    for op in ops:
        for dt, n_b, m_b in tuning.sweep_points(dtypes, ns, ms):
            if m_b * n_b > MAX_ELEMENTS or (op, dt, n_b, m_b) in done:
                continue
            cands = tuning.candidates(op, m_b, n_b, tuning.DTYPES[dt], sms)
            points += 1
            timings += len(cands)
            variants.update((op, dt, *(v for k, v in asdict(c).items() if k != "blocks_per_sm")) for c in cands)
    estimate = len(variants) * COMPILE_S + timings * TIMING_S
    return {"points": points, "timings": timings, "variants": len(variants), "estimate_s": estimate}


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


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = "python bench/tune_table.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.overlay:
        if not args.out:
            parser.error("--overlay needs --out")
        sweep = json.loads(open(args.overlay).read())
        dev = sweep["device"]
        base = tuning.analytic_doc(dev["key"], dev["name"], dev["capability"], dev["sms"], command)
        tuning.write(tuning.overlay(base, sweep), args.out)
        print(f"wrote {args.out} ({dev['key']}, {args.overlay} over the analytic table)")
        return 0
    if args.analytic:
        if not (args.sms and args.out):
            parser.error("--analytic needs --sms and --out")
        cc = tuple(int(v) for v in args.capability.split("."))
        key = f"sm{cc[0]}{cc[1]}_{args.sms}sm"
        tuning.write(tuning.analytic_doc(key, args.name, cc, args.sms, command), args.out)
        print(f"wrote {args.out} ({key}, analytic)")
        return 0
    ops, dtypes, ns, ms = sweep_args(args)
    base_doc = json.loads(open(args.merge).read()) if args.merge else None
    done = measured_points(base_doc)
    if args.plan:
        p = plan(ops, dtypes, ns, ms, args.sms or 132, done)
        print(
            f"{p['points']} points, {p['timings']} timings, {p['variants']} variants; ~{p['estimate_s'] / 60:.0f} min"
        )
        return 0
    if not args.out:
        parser.error("--out is required")
    device = timing.cuda_device(parser.prog)
    if device is None:
        return 2
    return sweep(args, command, device, ops, dtypes, ns, ms, base_doc, done)


def sweep(args, command, device, ops, dtypes, ns, ms, base_doc, done) -> int:
    import tilegym_rms.cutile as cutile

    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    key = tuning.device_key(index)
    if base_doc is not None and base_doc["device"]["key"] != key:
        print(f"--merge table is for {base_doc['device']['key']}, this device is {key}", file=sys.stderr)
        return 2
    timer = timing.Timer(device, "profiler")
    print(timer.calibrate())
    copy_bw = traffic.summarize(timing.copy_bandwidth(timer, device, base.COPY_BYTES, 5)[0])[0]
    name = torch.cuda.get_device_name(index)
    cc = torch.cuda.get_device_capability(index)
    doc = tuning.new_doc(key, name, cc, sms, "measured", command)
    doc["copy_gbps"] = round(copy_bw, 1)
    if base_doc is not None:
        doc = tuning.merge(base_doc, doc)
    p = plan(ops, dtypes, ns, ms, sms, done)
    print(f"{name} ({key}), copy {copy_bw:.0f} GB/s: {p['points']} points, {p['timings']} timings, ")
    print(f"{p['variants']} compiled variants; estimate ~{p['estimate_s'] / 60:.0f} min", flush=True)
    reps = args.reps
    start, timed = time.monotonic(), 0
    for op in ops:
        for dt in dtypes:
            dtype = tuning.DTYPES[dt]
            for n_b in ns:
                runs = []
                for m_b in ms:
                    if m_b * n_b > MAX_ELEMENTS or (op, dt, n_b, m_b) in done:
                        continue
                    runs.append(time_point(cutile, timer, device, key, op, dtype, n_b, m_b, reps, args.min_gain))
                    timed += len(runs[-1]["gbps"])
                if not runs:
                    continue
                new = tuning.new_doc(key, name, cc, sms, "measured", command)
                tuning.set_runs(new, op, dt, n_b, runs)
                doc = tuning.merge(doc, new)
                tuning.write(doc, args.out)
                pace = (time.monotonic() - start) / max(timed, 1)
                left = (p["timings"] - timed) * pace
                print(f"  {op} {dt} N={n_b}: {timed}/{p['timings']} timed, ~{left / 60:.1f} min left", flush=True)
    print(f"wrote {args.out} ({doc['source']})")
    return 0


def time_point(cutile, timer, device, key, op, dtype, n_b, m_b, reps, min_gain) -> dict:
    """One run: every candidate at (m_b, n_b) timed through the product's host path; the winner."""
    sets, nbytes = tune_cutile._inputs(op, m_b, n_b, dtype, device)
    w = torch.randn(n_b, dtype=dtype, device=device)
    fn = tune_cutile._call(cutile, op, w)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    cands = tuning.candidates(op, m_b, n_b, dtype, sms)
    gbps = {}
    for cand in cands:
        one = tuning.new_doc(key, "", (0, 0), sms, "measured", "")
        tuning.set_runs(one, op, tuning.DTYPE_NAMES[dtype], n_b, [{"m": 1, "winner": asdict(cand)}])
        with tuning.use_table(one):
            try:
                us = tune_cutile._time_us(timer, fn, sets, reps)
                gbps[tuning.label(op, cand)] = round(traffic.gbps(nbytes, us), 1)
            except Exception as exc:  # noqa: BLE001 - a candidate that fails to compile is a result too
                print(f"    {op} {m_b}x{n_b} {tuning.label(op, cand)}: {base.short_error(exc)}", flush=True)
    winner = tuning.select_winner(gbps, tuning.label(op, cands[0]), min_gain)
    by_label = {tuning.label(op, c): c for c in cands}
    return {"m": m_b, "winner": asdict(by_label[winner]), "gbps": gbps}


if __name__ == "__main__":
    sys.exit(main())
