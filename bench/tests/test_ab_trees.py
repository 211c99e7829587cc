"""bench/tools/ab_trees.py's comparison of two trees' runs, on records written as bench_rmsnorm.py writes them."""

from __future__ import annotations

import json

import pytest

from bench.common import records, traffic
from bench.tools import ab_trees

META = {"gpu_name": "Test GPU", "timestamp": "t", "tilegym_rms_version": "v", "copy_bandwidth_GBps": 3000.0}


def point(provider, m, n, gbps, dtype="bf16", op="forward"):
    p = records.Point("rms_norm", op, "grid", provider, dtype, m, n, "N", "hidden size N", n, {"M": m, "dtype": dtype})
    p.nbytes = traffic.op_bytes(op, m, n, 2)
    p.us = [p.nbytes / (gbps * 1e3)] * 3
    p.errs, p.ok = {"y": 1e-3}, True
    return p


def write_run(path, points):
    path.mkdir(parents=True)
    (path / "rms_norm.json").write_text(json.dumps(records.build_records(points, META)))
    return ab_trees.points(path)


def test_points_keep_ours_in_gbps_only(tmp_path):
    run = write_run(tmp_path / "r", [point("tilegym_rms-cutile", 4096, 1024, 2000.0),
                                     point("torch.compile", 4096, 1024, 2500.0),
                                     point("tilegym_rms-cutile", 4096, 2048, 2600.0, dtype="fp16")])  # fmt: skip
    assert sorted(round(v) for v in run.values()) == [2000, 2600]  # no peer, no timing in ms, no empty dtype slot
    assert {key[1] for key in run} == {"forward"}


def test_compare_takes_the_ratio_of_medians_over_points_every_run_has(tmp_path):
    base = [write_run(tmp_path / f"b{i}", [point("tilegym_rms-cutile", 4096, 1024, g),
                                           point("tilegym_rms-cutile", 4096, 2048, 1000.0)])
            for i, g in enumerate((2000.0, 2100.0, 1900.0))]  # fmt: skip
    new = [write_run(tmp_path / f"n{i}", [point("tilegym_rms-cutile", 4096, 1024, g)])
           for i, g in enumerate((2200.0, 2000.0, 2300.0))]  # fmt: skip
    rows = ab_trees.compare(base, new)
    assert len(rows) == 1  # N = 2048 ran in the base tree only
    assert rows[0]["ratio"] == pytest.approx(2200.0 / 2000.0, rel=1e-9)
    assert [round(g) for g in rows[0]["base_gbps"]] == [2000, 2100, 1900]


def test_main_refuses_a_base_without_the_benchmarks(tmp_path):
    with pytest.raises(SystemExit):
        ab_trees.main(["--base", str(tmp_path), "--out", str(tmp_path / "o"), "--", "--measure", "forward"])
