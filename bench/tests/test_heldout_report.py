"""bench/heldout_report.py's verdicts on the performance targets, on made-up records (no GPU needed)."""

from __future__ import annotations

import json

import pytest

from bench import heldout_report as hr
from bench.common import records, traffic

COPY = 3000.0
META = {"gpu_name": "Test GPU", "timestamp": "t", "tilegym_rms_version": "v", "copy_bandwidth_GBps": COPY}


def point(provider, op, m, n, gbps, suite="heldout", ok=True, dtype="bf16"):
    """A point of ``provider`` at ``gbps`` GB/s, labelled as bench_rmsnorm.py labels ``suite``."""
    if suite == "heldout":
        label = ("shape", "M x N", f"{m}x{n}", {"dtype": dtype, "suite": suite})
    else:
        label = ("N", "hidden size N", n, {"M": m, "dtype": dtype, "suite": suite})
    p = records.Point("rms_norm", op, suite, provider, dtype, m, n, *label)
    p.nbytes = traffic.op_bytes(op, m, n, 2)
    p.us = [p.nbytes / (gbps * 1e3)] * 3
    p.errs, p.ok = {"y": 1e-3}, ok
    return p


def rows_of(points):
    return {(r.suite, r.m, r.n, r.op): r for r in hr.report_rows(records.build_records(points, META))}


def test_targets_met_missed_and_below_the_size_threshold():
    every_peer = ("torch", "torch.compile", "liger", "tilegym", "quack")
    pts = []
    # 2^23 elements: judged against the best peer only
    for op, ours, best in (("forward", 990.0, 1000.0), ("backward", 995.0, 1000.0), ("full", 500.0, 1000.0)):
        pts += [point("tilegym_rms-cutile", op, 2048, 4096, ours), point("liger", op, 2048, 4096, best)]
        pts += [point(p, op, 2048, 4096, best / 2) for p in every_peer if p != "liger"]
    # 2^25 elements: forward at 93% of copy, backward at 90%; both ahead of the peers
    pts += [point("tilegym_rms-cutile", "forward", 8192, 4096, 0.93 * COPY)]
    pts += [point("tilegym_rms-cutile", "backward", 8192, 4096, 0.90 * COPY)]
    pts += [point(p, op, 8192, 4096, 1000.0) for p in every_peer for op in ("forward", "backward")]
    # below 2^22: far behind, yet no target applies
    pts += [point("tilegym_rms-cutile", "forward", 1000, 1000, 10.0), point("torch", "forward", 1000, 1000, 900.0)]
    # a faster variant of ours is no peer
    pts += [point("tilegym_rms-triton", "forward", 2048, 4096, 5000.0)]
    rows = rows_of(pts)

    fwd = rows[("heldout", 2048, 4096, "forward")]
    assert fwd.best_peer == "liger" and fwd.ratio == pytest.approx(0.99)
    assert (fwd.peer_verdict, fwd.copy_verdict, fwd.missing) == (hr.MET, hr.NA, [])
    assert rows[("heldout", 2048, 4096, "backward")].peer_verdict == hr.MISSED  # 0.995x < 1.0x
    full = rows[("heldout", 2048, 4096, "full")]
    assert (full.peer_verdict, full.copy_verdict) == (hr.NA, hr.NA)  # reported, not judged
    big_f, big_b = rows[("heldout", 8192, 4096, "forward")], rows[("heldout", 8192, 4096, "backward")]
    assert big_f.copy_share == pytest.approx(0.93) and big_f.copy_verdict == hr.MET and big_f.peer_verdict == hr.MET
    assert big_b.copy_verdict == hr.MISSED and big_b.peer_verdict == hr.MET
    small = rows[("heldout", 1000, 1000, "forward")]
    assert small.ratio < 0.02 and (small.peer_verdict, small.copy_verdict) == (hr.NA, hr.NA)

    text = hr.render(hr.report_rows(records.build_records(pts, META)))
    assert "backward ≥ 1.0× the best peer (M·N ≥ 2^22): met at 1 of 2 shapes; missed at 2048 × 4096 bf16" in text
    assert "forward ≥ 92% of copy (M·N ≥ 2^25): met at 1 of 1 shapes" in text
    assert "backward ≥ 92% of copy (M·N ≥ 2^25): met at 0 of 1 shapes; missed at 8192 × 4096 bf16" in text


def test_missing_providers_and_a_failed_check():
    pts = [point("torch", "forward", 4096, 4096, 1000.0), point("liger", "backward", 4096, 4096, 1000.0)]
    pts += [point("tilegym_rms-cutile", "backward", 4096, 4096, 2000.0, ok=False)]  # fast but wrong
    pts += [point("tilegym_rms-cutile", "full", 4096, 4096, 2000.0)]  # no peer at all
    rows = rows_of(pts)
    fwd = rows[("heldout", 4096, 4096, "forward")]  # ours absent
    assert fwd.ours is None and fwd.peer_verdict == hr.NO_DATA
    assert fwd.missing == ["torch.compile", "liger", "tilegym", "quack"]
    assert rows[("heldout", 4096, 4096, "backward")].peer_verdict == hr.MISSED
    full = rows[("heldout", 4096, 4096, "full")]
    assert full.best is None and full.missing == list(hr.EXPECTED_PEERS)
    text = hr.render(list(rows.values()), markdown=True)
    assert text.startswith("| M × N | dtype |") and "2000 (66.7%)!" in text
    assert "- forward ≥ 0.98× the best peer (M·N ≥ 2^22): met at 0 of 1 shapes; no data at 1" in text
    assert "peers absent from some rows: torch, torch.compile, liger, tilegym, quack" in text


def test_grid_file_and_exit_code(tmp_path, capsys):
    """--grid adds the grid shapes of rms_norm.json beside the results (its other suites stay out); a missing
    file is said, and the exit code is 0 either way."""
    held = [point("tilegym_rms-cutile", "forward", 4097, 3840, 2000.0), point("torch", "forward", 4097, 3840, 1900.0)]
    grid = [point("tilegym_rms-cutile", "forward", 32768, 4096, 2900.0, suite="grid")]
    grid += [point("liger", "forward", 32768, 4096, 2950.0, suite="grid")]
    grid += [point("tilegym_rms-cutile", "forward", 4096, 65536, 1.0, suite="large")]
    (tmp_path / "heldout.json").write_text(json.dumps(records.build_records(held, META)))
    (tmp_path / "rms_norm.json").write_text(json.dumps(records.build_records(grid, META)))
    assert hr.main([str(tmp_path / "heldout.json"), "--grid"]) == 0
    out = capsys.readouterr().out
    assert "4097 × 3840" in out and "32768 × 4096" in out and "65536" not in out
    assert "forward ≥ 0.98× the best peer (M·N ≥ 2^22): met at 2 of 2 shapes" in out  # 2900 / 2950 = 0.983
    assert hr.main([str(tmp_path / "absent.json")]) == 0
    captured = capsys.readouterr()
    assert "absent.json: not read" in captured.err and "no held-out, grid or fused-add" in captured.out


def test_regressions_compare_shares_of_copy_against_a_baseline():
    before = [point("tilegym_rms-cutile", "forward", 8192, 4096, 2900.0, suite="grid")]
    before += [point("tilegym_rms-cutile", "backward", 8192, 4096, 2700.0, suite="grid")]
    before += [point("tilegym_rms-cutile", "forward", 4096, 1024, 2000.0, suite="grid")]
    before += [point("liger", "forward", 2048, 2048, 2000.0, suite="grid")]  # a peer: never compared
    now = [point("tilegym_rms-cutile", "forward", 8192, 4096, 2800.0, suite="grid")]  # 0.966x: regressed
    now += [point("tilegym_rms-cutile", "backward", 8192, 4096, 2710.0, suite="grid")]  # 0.994x: within 2%
    now += [point("tilegym_rms-cutile", "forward", 16384, 4096, 100.0, suite="grid")]  # not in the baseline
    now += [point("liger", "forward", 2048, 2048, 100.0, suite="grid")]
    meta_before = {**META, "copy_bandwidth_GBps": COPY}
    meta_now = {**META, "copy_bandwidth_GBps": COPY * 1.01}  # a slightly faster copy: shares, not GB/s
    compared, worse = hr.regressions(records.build_records(now, meta_now), records.build_records(before, meta_before))
    assert compared == 2
    assert [key for key, _ in worse] == [("grid", "bf16", 8192, 4096, "forward")]
    assert worse[0][1] == pytest.approx((2800.0 / 1.01) / 2900.0)
    assert "1 of 2 shapes lost more than 2%" in hr.render_regressions(compared, worse)


def test_the_fused_add_is_judged_as_a_forward_and_a_backward():
    """The fused add's ops on a held-out shape and on the fused_add measure's grid: its forward against 0.98x the
    best peer and its backward against 1.0x, both against 92% of copy from 2^25 elements; TileGym, which has no
    fused add, is not expected beside it."""
    fused_peers = ("torch", "torch.compile", "liger", "quack")
    pts = []
    for suite in ("heldout", "fused_add"):
        for op, ours in (("fused_add_fwd", 990.0), ("fused_add_bwd", 995.0)):
            pts += [point("tilegym_rms-cutile", op, 2048, 4096, ours, suite=suite)]
            pts += [point(p, op, 2048, 4096, 1000.0 if p == "quack" else 500.0, suite=suite) for p in fused_peers]
    pts += [point("tilegym_rms-unfused", "fused_add_fwd", 2048, 4096, 2000.0)]  # ours, unfused: no peer
    pts += [
        point("tilegym_rms-cutile", "fused_add_fwd", 8192, 4096, 0.91 * COPY),
        point("torch", "fused_add_fwd", 8192, 4096, 100.0),
    ]
    rows = rows_of(pts)
    for suite in ("heldout", "fused_add"):
        fwd, bwd = rows[(suite, 2048, 4096, "fused_add_fwd")], rows[(suite, 2048, 4096, "fused_add_bwd")]
        assert fwd.best_peer == "quack" and fwd.ratio == pytest.approx(0.99) and fwd.peer_verdict == hr.MET
        assert bwd.ratio == pytest.approx(0.995) and bwd.peer_verdict == hr.MISSED
        assert fwd.missing == [] and fwd.copy_verdict == hr.NA
    big = rows[("heldout", 8192, 4096, "fused_add_fwd")]
    assert big.peer_verdict == hr.MET and big.copy_verdict == hr.MISSED
    assert big.missing == ["torch.compile", "liger", "quack"]
    lines = hr.summary(list(rows.values()))
    assert any(line.startswith("fused_add_fwd ≥ 92% of copy (M·N ≥ 2^25): met at 0 of 1 shapes") for line in lines)
