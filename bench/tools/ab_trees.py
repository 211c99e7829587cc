"""One benchmark command in two trees of this repository, alternately on one machine: ours before and after a change.

A decision within 1-2% needs both builds timed in the same run (PERFORMANCE.md, "How to measure"). This runs
``python -m bench.bench_rmsnorm ARGS --out DIR`` in the baseline tree (``--base``: an unpacked ``git archive``
of the older commit, outside any folder a device call replaces) and in this one, ``--rounds`` times in the order
base, new, base, new, ..., then compares tilegym_rms-cutile's GB/s point by point (median over rounds):

    git archive HEAD~1 tilegym_rms bench pyproject.toml | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python -m bench.tools.ab_trees --base /tmp/base --out /tmp/ab -- --measure forward --M 4096 --N 1024,2048

It prints one line per point and writes ``DIR/ab.json`` (each point's GB/s per tree and round, and the ratio of
the medians). The command's other providers, if any are asked for, run in both trees and are not compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

OURS = "tilegym_rms-cutile"
REPO = Path(__file__).resolve().parents[2]


def points(out_dir: Path, provider: str = OURS) -> dict[tuple, float]:
    """``{(op, config, x): GB/s}`` of ``provider`` in the result files a bench run wrote under ``out_dir``."""
    found = {}
    for path in sorted(out_dir.glob("*.json")):
        records = json.loads(path.read_text())
        if not isinstance(records, list):
            continue
        for r in records:
            if r.get("kernel_provider") != provider or r.get("metric_unit") != "GB/s":
                continue
            key = (r["kernel_name"], r["kernel_operation_mode"], r.get("extra_benchmark_config_str", ""))
            for x, y in zip(r["x_values"], r["y_values_50"], strict=True):
                if y and y > 0:  # a dtype's record lists every shape of the suite, its own timed
                    found[(*key, str(x))] = float(y)
    return found


def compare(base_runs: list[dict], new_runs: list[dict]) -> list[dict]:
    """One row per point timed in every round of both trees: the GB/s of each round and the ratio of the medians
    (new / base)."""
    keys = set.intersection(*(set(run) for run in base_runs + new_runs))
    rows = []
    for key in sorted(keys):
        base = [run[key] for run in base_runs]
        new = [run[key] for run in new_runs]
        rows.append({
            "kernel": key[0], "op": key[1], "config": key[2], "x": key[3], "base_gbps": base, "new_gbps": new,
            "ratio": statistics.median(new) / statistics.median(base),
        })  # fmt: skip
    return rows


def _run(tree: Path, bench_args: list[str], out: Path) -> None:
    cmd = [sys.executable, "-m", "bench.bench_rmsnorm", *bench_args, "--out", str(out)]
    log = out.with_suffix(".log")
    out.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        done = subprocess.run(cmd, cwd=tree, stdout=f, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {tree} (exit {done.returncode}); see {log}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.ab_trees", description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the baseline tree (holds bench/ and tilegym_rms/)")
    parser.add_argument("--out", type=Path, required=True, help="a folder for each run's results and ab.json")
    parser.add_argument("--rounds", type=int, default=2, help="runs per tree, alternating (default 2)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_rmsnorm's arguments")
    args = parser.parse_args(argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if "--out" in bench_args:
        parser.error("give --out to ab_trees, not to the bench command")
    if not (args.base / "bench" / "bench_rmsnorm.py").is_file():
        parser.error(f"{args.base} holds no bench/bench_rmsnorm.py")
    runs = {"base": [], "new": []}
    for i in range(args.rounds):
        for name, tree in (("base", args.base.resolve()), ("new", REPO)):
            out = args.out.resolve() / f"{name}_{i}"
            _run(tree, bench_args, out)
            runs[name].append(points(out))
    rows = compare(runs["base"], runs["new"])
    if not rows:
        raise SystemExit(f"no point of {OURS} was timed in every run (see the logs under {args.out})")
    for r in rows:
        base, new = statistics.median(r["base_gbps"]), statistics.median(r["new_gbps"])
        where = f"{r['op']:<14} {r['config'][:40]:<40} {r['x']:>14}"
        print(f"{where}  base {base:7.0f}  new {new:7.0f} GB/s  x{r['ratio']:.3f}")
    (args.out / "ab.json").write_text(
        json.dumps({"bench_args": bench_args, "rounds": args.rounds, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
