"""CPU checks of the benchmark machinery (no GPU needed): ``pytest bench/``."""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_rmsnorm
from bench.common import base, cli_args, gated, providers, records, report, session, timing, traffic
from bench.tools import kernel_resources as kr
from bench.tools import ncu_compare
from tilegym_rms import reference, testing


def test_bytes():
    m, n = 4096, 1024
    assert traffic.forward_bytes(m, n, 2) == 2 * m * n * 2 + n * 2
    assert traffic.backward_bytes(m, n, 2) == 3 * m * n * 2 + 2 * n * 2 + 4 * m
    assert traffic.full_bytes(m, n, 4) == traffic.forward_bytes(m, n, 4) + 4 * m + traffic.backward_bytes(m, n, 4)
    assert traffic.op_bytes("standalone", m, n, 2) == traffic.op_bytes("backward", m, n, 2)
    ws = 132 * n * 4
    minimal = traffic.backward_bytes(m, n, 2)
    assert traffic.workspace_share(minimal, ws) == pytest.approx(2 * ws / (minimal + 2 * ws))


def test_percentiles_match_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for size in (1, 2, 3, 10, 21):
        values = [rng.random() for _ in range(size)]
        for q in (20, 50, 80):
            assert traffic.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert traffic.summarize([1, 2, 3, 4, 5]) == (3, 1.8, 4.2)


def test_rotation():
    l2 = 50 * 2**20
    n, capped = traffic.rotation_sets(10 * 2**20, l2)
    assert n * 10 * 2**20 > 4 * l2 and (n - 1) * 10 * 2**20 <= 4 * l2 and not capped
    assert traffic.rotation_sets(5 * l2, l2) == (1, False)
    assert traffic.rotation_sets(10, l2) == (base.MAX_SETS, True)
    for sets in (1, 3, 13):
        calls = traffic.calls_per_pass(sets)
        assert calls % sets == 0 and calls >= base.MIN_CALLS_PER_PASS


@pytest.mark.parametrize(
    "name,slug",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
    ],
)
def test_gpu_slug(name, slug):
    assert session.gpu_slug(name) == slug


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_relative_errors(dtype):
    dt = base.DTYPES[dtype]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 96, generator=g).to(dt)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dt)
    dy = torch.randn(200, 96, generator=g).to(dt)
    xf, wf, dyf = x.float(), w.float(), dy.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    xhat = xf * rstd
    y = (xhat.to(dt).float() * wf).to(dt)
    gw = dyf * wf
    dx = (rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))).to(dt)
    dw = (dyf * xhat).sum(0).to(dt)
    errs = providers.relative_errors(x, w, 1e-6, {"y": y, "dx": dx, "dw": dw}, dy)
    assert providers.check_ok(errs, dtype), errs
    bad = providers.relative_errors(x, w, 1e-6, {"y": y.float() * 1.05, "dw": dw.float() * float("nan")}, dy)
    assert not providers.check_ok(bad, dtype)
    assert bad["y"] == pytest.approx(0.05, rel=0.05)


def _points(ns, ok_at=None):
    pts = []
    for n in ns:
        us = [10.0 + i for i in range(10)]
        p = records.Point("k", "forward", "grid", "prov", "bf16", 4096, n, "N", "hidden size N", n, {"M": 4096}, us=us)
        p.nbytes = traffic.forward_bytes(4096, n, 2)
        p.errs = {"y": 1e-3}
        p.ok = ok_at is None or n != ok_at
        pts.append(p)
    return pts


META = {"gpu_name": "g", "timestamp": "t", "tilegym_rms_version": "v", "copy_bandwidth_GBps": 3000.0}


def test_records_and_merge(tmp_path):
    recs = records.build_records(_points([1024, 2048, 4096], ok_at=2048), META)
    thr = next(r for r in recs if r["metric_name"] == "throughput")
    keys = {"kernel_name", "kernel_provider", "metric_name", "metric_unit", "gpu_name", "x_name", "x_label"}
    keys |= {"x_values", "y_values_50", "y_values_20", "y_values_80", "timestamp", "kernel_operation_mode"}
    keys |= {"extra_benchmark_config_str", "tilegym_rms_version"}
    assert keys <= set(thr)
    assert thr["x_values"] == [1024, 2048, 4096] and thr["mismatch_x_values"] == [2048]
    bands = zip(thr["y_values_20"], thr["y_values_50"], thr["y_values_80"], strict=True)
    assert all(lo <= mid <= hi for lo, mid, hi in bands)
    path = tmp_path / "r.json"
    records.write_json(path, records.build_records(_points([1024, 2048]), META))
    merged = records.write_json(path, records.build_records(_points([2048, 4096], ok_at=4096), META))
    thr = next(r for r in merged if r["metric_name"] == "throughput")
    assert thr["x_values"] == [1024, 2048, 4096] and thr["mismatch_x_values"] == [4096]
    assert json.loads(path.read_text()) == merged


def test_table_and_plot(tmp_path):
    pts = _points([1024, 2048], ok_at=2048)
    table = report.results_table(pts, ["prov"], 3000.0)
    assert "!" in table.splitlines()[-1] and "%" in table
    pytest.importorskip("matplotlib")
    recs = [r for r in records.build_records(pts, META) if r["metric_name"] == "throughput"]
    msg = report.plot_records(recs, tmp_path / "p.png", "t", 3000.0)
    assert (tmp_path / "p.png").stat().st_size > 0, msg


def test_split_by_markers():
    a = timing.Activity
    ev = [a(0, 1, "m", "kernel"), a(1, 10, "k", "kernel"), a(2, 1, "m", "kernel"), a(3, 20, "k", "kernel")]
    ev.append(a(4, 1, "m", "kernel"))
    seg = timing.split_by_markers(ev, "m", 2)
    assert [[e.dur_ns for e in s] for s in seg] == [[10], [20]]
    assert timing.split_by_markers(ev, "m", 3) is None


def test_kernel_resources_reads_the_compilers_report():
    """One small variant compiled for sm_90: the report has a register count within the hardware's range."""
    pytest.importorskip("cuda.tile")
    from tilegym_rms import aot

    cuobjdump = kr.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton)")
    variants = aot.variants_for(8, 64, torch.float32, 132, kernels=(None,), every_path=False)
    names = [v.kernel_name for v in variants]
    assert names == ["rms_norm_fwd_gather", "rms_norm_bwd_direct"]
    use = kr.resource_usage(aot.cubin(variants[0], "sm_90"), cuobjdump)
    assert 0 < use["REG"] <= 255 and use["STACK"] >= 0 and use["SHARED"] >= 0


def test_kernel_resources_reports_the_build_a_launch_makes():
    """A launch on 16-byte aligned rows specializes the persistent forward into a TMA build that stages its row
    tiles in shared memory, with fewer registers; the build without that assumption, which the compile check
    makes, stages none. kernel_resources.py reports the first unless --generic."""
    pytest.importorskip("cuda.tile")
    from tilegym_rms import aot

    cuobjdump = kr.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton)")
    v = next(v for v in aot.variants_for(32768, 896, torch.bfloat16, 132, kernels=("persistent",), every_path=False))
    assert v.kernel_name == "rms_norm_fwd_persistent"
    tile_bytes = v.params[8] * v.params[9] * 2  # TILE_M x TILE_N bf16
    launched = kr.resource_usage(aot.cubin(v, "sm_90", as_launched=True), cuobjdump)
    generic = kr.resource_usage(aot.cubin(v, "sm_90"), cuobjdump)
    assert launched["SHARED"] >= tile_bytes > generic["SHARED"], (launched, generic)
    assert launched["REG"] < generic["REG"]


def test_kernel_resources_counts_a_builds_instructions():
    """``--sass``: the launched persistent forward loads its row tiles by TMA (``UTMALDG``) and reads them back
    from shared memory one 16-bit value a thread at a time (``LDS.U16``); the generic build issues no TMA load.
    The summary line names each memory opcode with its count."""
    pytest.importorskip("cuda.tile")
    from tilegym_rms import aot

    cuobjdump = kr.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton)")
    v = next(v for v in aot.variants_for(32768, 896, torch.bfloat16, 132, kernels=("persistent",), every_path=False))
    launched = kr.instruction_counts(aot.cubin(v, "sm_90", as_launched=True), cuobjdump)
    generic = kr.instruction_counts(aot.cubin(v, "sm_90"), cuobjdump)
    assert any(op.startswith("UTMALDG") for op in launched) and launched["LDS.U16"] > 0
    assert not any(op.startswith("UTMALDG") for op in generic) and sum(generic.values()) > 0
    line = kr.sass_summary(launched)
    assert line.startswith(f"{sum(launched.values())} instructions; ") and f"LDS.U16 {launched['LDS.U16']}" in line
    assert "FMUL" not in line  # arithmetic is counted in the total, not listed


def test_kernel_resources_reports_what_the_table_launches(monkeypatch, capsys):
    """On an H100's class the host launches the tuning table's winners, so the report shows those (bf16 32768 x
    1536: the table's 8-row backward tile, the heuristics' 4); ``--analytic`` shows the heuristics' instead."""
    pytest.importorskip("cuda.tile")
    from tilegym_rms import aot
    from tilegym_rms.cutile import config, tuning

    table, source = kr.chosen_table("sm_90", 132)
    assert table is tuning.packaged("sm90_132sm") and "sm90_132sm" in source
    assert kr.chosen_table("sm_90", 132, analytic=True) == (None, "the analytic heuristics")
    assert kr.chosen_table("sm_100", 148)[0] is None  # no table ships for that class
    m, n = 32768, 1536
    want = table.lookup("backward", m, n, torch.bfloat16).tile_m
    assert want != config.backward_candidate(m, n, torch.bfloat16, 132).tile_m  # the two differ here
    seen = []
    monkeypatch.setattr(kr, "find_cuobjdump", lambda: "cuobjdump")
    monkeypatch.setattr(aot, "cubin", lambda v, arch, as_launched: seen.append(v) or b"")
    monkeypatch.setattr(kr, "resource_usage", lambda cubin, tool: {"REG": 1, "STACK": 0, "SHARED": 0})
    for extra, tile_m in (([], want), (["--analytic"], config.backward_candidate(m, n, torch.bfloat16, 132).tile_m)):
        seen.clear()
        assert kr.main(["--shapes", f"{m}x{n}", *extra]) == 0
        bwd = next(v for v in seen if v.kernel_name == "rms_norm_bwd_persistent")
        assert bwd.params[8] == tile_m  # TILE_M follows x, dy, w, rstd, dx, dw_partial, dres and offset
    assert "analytic heuristics" in capsys.readouterr().out


@pytest.mark.parametrize(
    "use, fit",
    [
        ({"REG": 255, "SHARED": 181376, "THREADS": 256}, 1),  # 256 registers x 256 threads: the whole file
        ({"REG": 128, "SHARED": 103528, "THREADS": 256}, 2),  # registers and shared memory both allow 2
        ({"REG": 64, "SHARED": 50920, "THREADS": 256}, 4),  # registers: 4; shared memory 4 (52 KB each)
        ({"REG": 32, "SHARED": 17472, "THREADS": 384}, 5),  # 12 warps of 1024 registers: 5
        ({"REG": 26, "SHARED": 0, "THREADS": 256}, 8),  # threads: 2048 / 256
        ({"REG": 16, "SHARED": 0, "THREADS": 32}, 32),  # block slots
        ({"REG": 64, "SHARED": 112000, "THREADS": 128}, 2),  # shared memory
        # Launched sm_90 builds whose blocks per SM the driver counted (cuOccupancyMaxActiveBlocksPerMultiprocessor):
        # SHARED includes the per-block reserve, so it is not added again.
        ({"REG": 128, "SHARED": 115856, "THREADS": 256}, 2),  # two fit; with 1 KB added again, one
        ({"REG": 80, "SHARED": 115824, "THREADS": 384}, 2),
        ({"REG": 32, "SHARED": 28328, "THREADS": 256}, 8),
    ],
)
def test_blocks_that_fit_one_sm(use, fit):
    """The occupancy arithmetic of kernel_resources.py on an sm_90 SM: 64K registers allocated per warp in
    units of 256, 228 KB of shared memory (the report's SHARED counts the driver's 1 KB per-block reserve),
    2048 threads, 32 blocks."""
    assert kr.blocks_that_fit(use, "sm_90") == fit
    assert kr.blocks_that_fit(use, "sm_120") is None  # no limits recorded for that target
    assert kr.blocks_that_fit({**use, "THREADS": 0}, "sm_90") is None


def test_kernel_resources_reads_the_block_size_and_the_waves():
    """The launched persistent forward of 8192 x 5120 (the table's 2 x 8192 tile) requires 256 threads, holds
    one block per SM, and the launch line counts its waves from the grid the host makes."""
    pytest.importorskip("cuda.tile")
    from tilegym_rms import aot

    cuobjdump = kr.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton)")
    table, _ = kr.chosen_table("sm_90", 132)
    grids: dict = {}
    variants = aot.variants_for(8192, 5120, torch.bfloat16, 132, (None,), False, table, grids=grids)
    v = next(v for v in variants if v.kernel_name == "rms_norm_fwd_persistent")
    use = kr.resource_usage(aot.cubin(v, "sm_90", as_launched=True), cuobjdump)
    assert use["THREADS"] % 32 == 0 and use["THREADS"] >= 128
    fit = kr.blocks_that_fit(use, "sm_90")
    blocks = grids[v][0]
    waves = -(-blocks // (fit * 132))
    assert f"{fit} fit per SM: {waves} wave(s)" in kr.launch_shape(use, grids[v], "sm_90", 132)


def test_kernel_resources_sets_a_sweeps_timings_beside_their_waves():
    """--waves-of: each persistent forward (or backward) candidate a sweep timed, with the waves its launch makes
    (the same 2 x 8192 build at 8 blocks per SM runs more than one wave, at 1 one), and the summary per M bucket."""
    pytest.importorskip("cuda.tile")
    from dataclasses import asdict

    from tilegym_rms.cutile import config
    from tilegym_rms.cutile.tuning import build

    if kr.find_cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton)")
    doc = build.new_doc("sm90_132sm", "test", (9, 0), 132, "measured", "test")
    winner = config.ForwardCandidate("persistent", 2, 8192, 0, 8, 0, 0)
    gbps = {"persistent 2x8192 b8 o0 w0": 2400.0, "persistent 2x8192 b1 o0 w0": 2000.0, "gather 1x8192 b0 o4 w0": 1.0}
    build.set_runs(doc, "forward", "bf16", 5120, [{"m": 8192, "winner": asdict(winner), "gbps": gbps}])
    rows = {r["label"]: r for r in kr.sweep_waves(doc, "sm_90", 132)}
    assert set(rows) == {"persistent 2x8192 b8 o0 w0", "persistent 2x8192 b1 o0 w0"}
    many, one = rows["persistent 2x8192 b8 o0 w0"], rows["persistent 2x8192 b1 o0 w0"]
    assert (many["blocks"], one["blocks"]) == (8 * 132, 132) and many["fit"] == one["fit"] < 8
    assert one["waves"] == 1 and many["waves"] == -(-8 // many["fit"])
    summary = kr.waves_summary(list(rows.values()))
    assert summary[1].split() == ["8192", "1", "1.200", "1", "0"]
    # The backward's candidates, by the main kernel's launch (not the dw reduction's).
    winner = config.BackwardCandidate("persistent", 2, 4096, 0, 2, 2, 0)
    gbps = {"persistent 2x4096 b2 o2 w0": 2000.0, "persistent 2x4096 b8 o2 w0": 1900.0}
    build.set_runs(doc, "backward", "bf16", 4096, [{"m": 32768, "winner": asdict(winner), "gbps": gbps}])
    rows = {r["label"]: r for r in kr.sweep_waves(doc, "sm_90", 132, op="backward")}
    assert {r["blocks"] for r in rows.values()} == {2 * 132, 8 * 132}
    assert rows["persistent 2x4096 b8 o2 w0"]["waves"] == -(-8 // rows["persistent 2x4096 b8 o2 w0"]["fit"])


def test_untimed_records_keep_the_committed_layout():
    """Workspace records (sizes, not times) have no copy bandwidth or timing method, as in the committed JSON."""
    committed = json.loads((base.BENCH_DIR / "results" / "h100" / "rms_norm_backward.json").read_text())
    workspace = next(r for r in committed if r["metric_name"] == "workspace")
    rec = records.new_record(
        META, kernel_name="k", provider="p", metric="workspace", unit="bytes", op="standalone",
        extra={"M": 1}, x_name="N", x_label="hidden size N", timed=False,
    )  # fmt: skip
    assert list(rec) == list(workspace)


def test_session_checks_and_times_each_provider(tmp_path, monkeypatch):
    """Both loops (timed configurations and eager latency) check a working provider against float64 and time
    it, and record a failing one's error without stopping the run."""
    monkeypatch.setenv(base.CPU_ENV, "1")
    argv = ["--reps", "2", "--out", str(tmp_path), "--no-plot"]
    args = cli_args.finish_args(bench_rmsnorm.build_parser().parse_args(argv))
    run = session.Session(args, "k", "k.json")

    def broken(x, w):
        raise RuntimeError("no kernel for this shape")

    def torch_rms_norm(x, w):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, args.eps)

    run.providers = [providers.Provider("torch", torch_rms_norm), providers.Provider("broken", broken)]
    timed = run.run_configs("full", "grid", [("fp32", 4, 32)], session.grid_label("grid"))
    latency = run.run_latency("forward", [2], 32, "fp32", calls=2, warmup=1)
    for good, bad in (timed, latency):
        assert good.ok and set(good.errs) >= {"y"} and len(good.us) == 2 and not good.error
        assert bad.error == "RuntimeError: no kernel for this shape" and bad.ok is None and not bad.us
    assert set(timed[0].errs) == {"y", "dx", "dw"} and not run.aborted
    saved = json.loads((tmp_path / "k.json").read_text())
    assert {r["metric_name"] for r in saved} == {"throughput", "speed", "latency"}


def test_fused_add_bytes_and_check():
    m, n = 4096, 2048
    assert traffic.op_bytes("fused_add_fwd", m, n, 2) == 4 * m * n * 2 + n * 2 + 4 * m
    assert traffic.op_bytes("fused_add_bwd", m, n, 2) == 4 * m * n * 2 + 2 * n * 2 + 4 * m
    g = torch.Generator().manual_seed(0)
    x, r, dy, dres = (torch.randn(50, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    y, s = providers.eager_fused_add_rms_norm(1e-6)(x, r, w)
    errs = testing.fused_add_errors(x, r, w, 1e-6, {"y": y, "res": s}, chunk_elems=64 * 16)
    assert providers.check_ok(errs, "bf16"), errs
    assert not providers.check_ok(testing.fused_add_errors(x, r, w, 1e-6, {"res": s * 1.05}), "bf16")


def test_fused_add_measure_cpu_mode(tmp_path, monkeypatch, capsys):
    """--measure fused_add in the CPU test mode: forward and backward points, each checked ok."""
    monkeypatch.setenv(base.CPU_ENV, "1")
    argv = ["--measure", "fused_add", "--M", "64", "--N", "256", "--reps", "2", "--out", str(tmp_path)]
    argv += ["--providers", "tilegym_rms-torch,tilegym_rms-unfused,torch,quack", "--no-plot"]
    assert bench_rmsnorm.main(argv) == 0
    out = capsys.readouterr().out
    assert "backward (autograd)" in out and "fused add provider quack skipped" in out
    saved = [r for r in json.loads((tmp_path / "rms_norm.json").read_text()) if r["metric_name"] == "throughput"]
    assert {r["kernel_operation_mode"] for r in saved} == {"fused_add_fwd", "fused_add_bwd"}
    assert {r["kernel_provider"] for r in saved} == {"tilegym_rms-torch", "tilegym_rms-unfused", "torch"}
    for rec in saved:
        assert json.loads(rec["extra_benchmark_config_str"])["suite"] == "fused_add"
        assert rec["x_values"] == [256] and not rec.get("mismatch_x_values")
        assert all(0 <= e <= base.TOLERANCE["bf16"] for e in rec["rel_err"])


def test_qk_norm_bytes_count_q_and_k():
    m, n = 1 << 14, 128
    mk = m // base.QK_HEADS[0] * base.QK_HEADS[1]
    assert traffic.op_bytes("qk_fwd", m, n, 2) == 2 * (m + mk) * n * 2 + 2 * n * 2
    assert traffic.op_bytes("qk_bwd", m, n, 2) == 3 * (m + mk) * n * 2 + 4 * n * 2 + 4 * (m + mk)


def test_qk_norm_measure_cpu_mode(tmp_path, monkeypatch, capsys):
    """--measure qk_norm in the CPU test mode: forward and backward points of ours, of our plain norm and of a peer
    called on q and on k, each checked against float64 for q and for k."""
    monkeypatch.setenv(base.CPU_ENV, "1")
    argv = ["--measure", "qk_norm", "--M", "256", "--N", "64", "--reps", "2", "--out", str(tmp_path)]
    argv += ["--providers", "tilegym_rms-torch,tilegym_rms-unfused,torch", "--no-plot"]
    assert bench_rmsnorm.main(argv) == 0
    assert "QK-norm (q and k per head), backward (autograd)" in capsys.readouterr().out
    saved = [r for r in json.loads((tmp_path / "rms_norm.json").read_text()) if r["metric_name"] == "throughput"]
    assert {r["kernel_operation_mode"] for r in saved} == set(traffic.QK_OPS)  # both ways, every layout
    # tilegym_rms-unfused: the plain norm on q, then on k (the default backend, here the reference)
    assert {r["kernel_provider"] for r in saved} == {"tilegym_rms-torch", "tilegym_rms-unfused", "torch"}
    for rec in saved:
        assert json.loads(rec["extra_benchmark_config_str"])["suite"] == "qk_norm"
        assert rec["x_values"] == [64] and not rec.get("mismatch_x_values")
        assert all(0 <= e <= base.TOLERANCE["bf16"] for e in rec["rel_err"])


def test_our_plain_norm_on_q_and_k_is_a_qk_provider_only(monkeypatch):
    """tilegym_rms-unfused in the QK-norm comparison calls the package's rms_norm on q and on k (each with its own
    weight); the plain measures skip it, and mamba-torch, with the measures that take each."""
    import tilegym_rms

    calls = []
    real = tilegym_rms.rms_norm
    monkeypatch.setattr(tilegym_rms, "rms_norm", lambda x, w, *a, **kw: calls.append(x.shape) or real(x, w, *a, **kw))
    found, skipped = providers.discover_qk_providers(["tilegym_rms-unfused"], torch.device("cpu"), 1e-6, tilegym_rms)
    assert [p.name for p in found] == ["tilegym_rms-unfused"] and not skipped
    q, k, wq, wk = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(8), torch.randn(8)
    got = found[0].forward(q, k, wq, wk)
    assert calls == [q.shape, k.shape]
    for out, want in zip(got, tilegym_rms.qk_rms_norm(q, k, wq, wk, 1e-6), strict=True):
        torch.testing.assert_close(out, want)
    names = ["tilegym_rms-unfused", "mamba-torch"]
    _, skipped = providers.discover_providers(names, torch.device("cpu"), 1e-6, tilegym_rms)
    assert skipped == {
        "tilegym_rms-unfused": "a provider of --measure fused_add, qk_norm, fp8 or gated only",
        "mamba-torch": "a provider of --measure gated only",
    }


def test_qk_norm_measure_at_another_head_ratio(tmp_path, monkeypatch):
    """--qk-heads 8:1: q in 8 heads and k in 1 (k has M / 8 rows), the bytes counted for that ratio, each record
    naming it; a ratio M does not divide is refused before anything runs."""
    monkeypatch.setenv(base.CPU_ENV, "1")
    monkeypatch.setattr(base, "QK_HEADS", base.QK_HEADS)  # main sets the run's ratio; restored after the test
    argv = ["--measure", "qk_norm", "--M", "256", "--N", "64", "--reps", "2", "--out", str(tmp_path), "--no-plot"]
    assert bench_rmsnorm.main([*argv, "--providers", "tilegym_rms-torch", "--qk-heads", "8:1"]) == 0
    saved = [r for r in json.loads((tmp_path / "rms_norm.json").read_text()) if r["metric_name"] == "throughput"]
    assert saved and all(json.loads(r["extra_benchmark_config_str"])["heads"] == "8:1" for r in saved)
    assert all(not r.get("mismatch_x_values") for r in saved)
    assert traffic.qk_rows(256) == (256, 32)
    assert traffic.op_bytes("qk_fwd", 256, 64, 2) == 2 * (256 + 32) * 64 * 2 + 2 * 64 * 2
    sets = providers.InputSets(256, 64, torch.float32, "cpu", 1, 0, 1e-6, need_dy=False, qk="qkv")
    assert sets.x[0].shape[-2:] == (8, 64) and sets.k[0].shape[-2:] == (1, 64)
    assert bench_rmsnorm.main([*argv, "--qk-heads", "24:8"]) == 2  # 256 rows are not whole tokens of 24 heads


@pytest.mark.parametrize("text", ["8", "8:3", "8:0", "a:b", "-8:2"])
def test_qk_heads_take_hq_colon_a_dividing_hk(text):
    with pytest.raises(argparse.ArgumentTypeError, match="HQ:HK"):
        cli_args.parse_heads(text)
    assert cli_args.parse_heads("32:8") == (32, 8)


def test_qk_norm_check_sees_a_wrong_k():
    sets = providers.InputSets(64, 32, torch.float32, "cpu", 1, 0, 1e-6, need_dy=False, qk="separate")
    q, k, wq, wk = sets.x[0], sets.k[0], sets.w[0], sets.wk[0]
    f = torch.nn.functional.rms_norm
    good = {"y": f(q, (32,), wq, 1e-6), "y_k": f(k, (32,), wk, 1e-6)}
    assert providers.check_ok(providers.output_errors("qk_fwd", sets, 1e-6, good), "fp32")
    bad = good | {"y_k": good["y_k"] * 1.01}
    assert not providers.check_ok(providers.output_errors("qk_fwd", sets, 1e-6, bad), "fp32")


def test_qk_norm_layouts_are_the_ones_attention_hands_over():
    """separate: contiguous (tokens, heads, D); transposed: (B, H, S, D) transposes, gradients contiguous in
    them; qkv: slices of one fused projection, gradients (B, H, S, D)-contiguous tensors transposed back."""
    hq, hk = base.QK_HEADS
    m, d = 64 * hq, 8  # 64 tokens: two sequences of 32
    for layout in traffic.QK_LAYOUTS.values():
        sets = providers.InputSets(m, d, torch.float32, "cpu", 1, 0, 1e-6, qk=layout)
        q, k, dyq, dyk = sets.x[0], sets.k[0], sets.dy[0], sets.dyk[0]
        assert q.numel() == m * d and k.numel() == m // hq * hk * d
        assert dyq.shape == q.shape and dyk.shape == k.shape
        if layout == "separate":
            assert q.shape == (64, hq, d) and q.is_contiguous() and dyq.is_contiguous()
        elif layout == "transposed":
            assert q.shape == (2, hq, 32, d) and q.transpose(1, 2).is_contiguous() and dyq.is_contiguous()
        else:
            assert q.shape == (2, 32, hq, d) and q.stride(1) == (hq + 2 * hk) * d and k.data_ptr() > q.data_ptr()
            assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
            assert dyq.transpose(1, 2).is_contiguous() and dyk.transpose(1, 2).is_contiguous()


def test_quack_runs_qk_norm_on_the_rows_of_q_and_of_k(monkeypatch):
    """quack takes 2-D rows: the qk provider hands it each tensor's rows and views the result back."""
    import types

    def fake_rmsnorm(x, w, eps):
        assert x.dim() == 2
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)

    pkg, mod = types.ModuleType("quack"), types.ModuleType("quack.rmsnorm")
    mod.rmsnorm, pkg.rmsnorm = fake_rmsnorm, mod
    monkeypatch.setitem(sys.modules, "quack", pkg)
    monkeypatch.setitem(sys.modules, "quack.rmsnorm", mod)
    found, _ = providers.discover_qk_providers(["quack"], torch.device("cpu"), 1e-5)
    sets = providers.InputSets(64 * base.QK_HEADS[0], 8, torch.float32, "cpu", 1, 0, 1e-5, need_dy=False, qk="qkv")
    yq, yk = found[0].forward(sets.x[0], sets.k[0], sets.w[0], sets.wk[0])
    for x, w, y in ((sets.x[0], sets.w[0], yq), (sets.k[0], sets.wk[0], yk)):
        torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (8,), w, 1e-5))


def test_quack_is_a_plain_rmsnorm_provider(monkeypatch):
    """quack runs the plain RMSNorm measures through quack.rmsnorm.rmsnorm(x, w, eps=...), where it imports."""
    import types

    seen = {}

    def fake_rmsnorm(x, w, eps):
        seen["eps"] = eps
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)

    pkg, mod = types.ModuleType("quack"), types.ModuleType("quack.rmsnorm")
    mod.rmsnorm, pkg.rmsnorm = fake_rmsnorm, mod
    monkeypatch.setitem(sys.modules, "quack", pkg)
    monkeypatch.setitem(sys.modules, "quack.rmsnorm", mod)
    found, skipped = providers.discover_providers(["quack"], torch.device("cpu"), 1e-5)
    assert [p.name for p in found] == ["quack"] and not skipped
    x, w = torch.randn(4, 32), torch.rand(32) + 0.5
    torch.testing.assert_close(found[0].forward(x, w), torch.nn.functional.rms_norm(x, (32,), w, 1e-5))
    assert seen["eps"] == 1e-5
    monkeypatch.setitem(sys.modules, "quack", None)  # not importable: skipped with the import error
    monkeypatch.setitem(sys.modules, "quack.rmsnorm", None)
    found, skipped = providers.discover_providers(["quack"], torch.device("cpu"), 1e-5)
    assert not found and "ModuleNotFoundError" in skipped["quack"]


def _heldout_plan(argv):
    args = cli_args.finish_args(bench_rmsnorm.build_parser().parse_args(argv))
    bench_rmsnorm.split_providers(args)
    return args, bench_rmsnorm.plan(args)


def test_heldout_measure_plans_exactly_the_heldout_shapes(capsys):
    """forward, backward and full, and the fused add both ways, on each shape of bench/heldout.json with its own
    dtype (--dtype/--M/--N do not reach it), beside quack; every input rotation streams from HBM (> 4x L2)
    without being capped."""
    shapes = json.loads((Path(__file__).resolve().parents[1] / "heldout.json").read_text())["shapes"]
    expected = [(s["dtype"], s["m"], s["n"]) for s in shapes]
    for extra in ([], ["--dtype", "fp32", "--M", "64", "--N", "128"], ["--quick"]):
        args, steps = _heldout_plan(["--measure", "heldout", *extra])
        assert [(measure, op, suite) for measure, op, suite, _ in steps] == [
            ("heldout", op, "heldout") for op in ("forward", "backward", "full", "fused_add_fwd", "fused_add_bwd")
        ]
        assert all(configs == expected for *_, configs in steps)
    assert "quack" in args.rms_providers and "quack" not in _heldout_plan(["--measure", "forward"])[0].rms_providers
    assert "quack" in args.fused_providers and "tilegym_rms-unfused" in args.fused_providers
    assert not _heldout_plan(["--measure", "forward"])[0].fused_providers
    assert "quack" in _heldout_plan(["--measure", "large"])[0].rms_providers
    for l2 in (50 * 2**20, 60 * 2**20):  # H100, H200
        for _, op, _, configs in steps:
            for dtype, m, n in configs:
                one = traffic.read_bytes(op, m, n, base.DTYPES[dtype].itemsize)
                sets, capped = traffic.rotation_sets(one, l2)
                assert not capped and sets * one > base.L2_FACTOR * l2 and (sets - 1) * one <= base.L2_FACTOR * l2
    assert bench_rmsnorm.main(["--measure", "heldout", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "bf16 M=2500 N=16384" in out and "fp16 M=700001 N=128" in out and "total configurations: 80" in out


def test_heldout_measure_writes_its_own_file(tmp_path, monkeypatch, capsys):
    """In one run with a grid measure, the held-out points go to heldout.json (each shape with its dtype) and
    the grid's to rms_norm.json."""
    monkeypatch.setenv(base.CPU_ENV, "1")
    heldout = tmp_path / "shapes.json"
    shapes = [{"m": 24, "n": 64, "dtype": "fp32"}, {"m": 40, "n": 96, "dtype": "bf16"}]
    heldout.write_text(json.dumps({"shapes": shapes}))
    monkeypatch.setattr(base, "HELDOUT_FILE", heldout)
    argv = ["--measure", "forward,heldout", "--M", "8", "--N", "32", "--dtype", "fp32", "--reps", "2"]
    argv += ["--providers", "tilegym_rms-torch,torch", "--out", str(tmp_path / "out"), "--no-plot"]
    assert bench_rmsnorm.main(argv) == 0
    assert f"JSON: {tmp_path / 'out' / 'heldout.json'}" in capsys.readouterr().out

    def throughput(name):
        recs = json.loads((tmp_path / "out" / name).read_text())
        return [r for r in recs if r["metric_name"] == "throughput"]

    held, grid = throughput("heldout.json"), throughput("rms_norm.json")
    assert {json.loads(r["extra_benchmark_config_str"])["suite"] for r in held} == {"heldout"}
    assert {json.loads(r["extra_benchmark_config_str"])["suite"] for r in grid} == {"grid"}
    measured = {
        (r["kernel_operation_mode"], json.loads(r["extra_benchmark_config_str"])["dtype"], x)
        for r in held
        for x in r["x_values"]
    }
    ops = ("forward", "backward", "full", "fused_add_fwd", "fused_add_bwd")
    assert measured == {(op, s["dtype"], f"{s['m']}x{s['n']}") for op in ops for s in shapes}
    assert {r["kernel_provider"] for r in held} == {"tilegym_rms-torch", "torch"}
    assert all(not r["mismatch_x_values"] for r in held)


def test_ncu_compare_profiles_one_checked_call_per_provider():
    """Only the third call of each provider runs between the profiler's start and stop, in provider order, and a
    provider with wrong outputs is reported and counted."""
    events = []
    right = providers.Provider(
        "right", lambda x, w: (events.append("right"), providers.llama_rms_norm(x, w, base.EPS))[1]
    )
    wrong = providers.Provider(
        "wrong", lambda x, w: (events.append("wrong"), 2 * providers.llama_rms_norm(x, w, base.EPS))[1]
    )
    [(line, failed)] = ncu_compare.profile_calls(
        [right, wrong],
        "forward",
        [(8, 64)],
        "fp32",
        torch.device("cpu"),
        lambda: events.append("start"),
        lambda: events.append("stop"),
    )
    assert events == ["right"] * 2 + ["start", "right", "stop"] + ["wrong"] * 2 + ["start", "wrong", "stop"]
    assert failed == 1
    assert line.startswith("8x64 fp32 forward: right (ok") and "wrong (WRONG" in line


def test_fp8_bytes():
    """Read x (and r) and w; write y_q (1 byte), the fp32 scales (read: the static one) and the sum over r."""
    m, n = 4096, 5120
    assert traffic.op_bytes("fp8_token", m, n, 2) == 2 * m * n + m * n + 2 * n + 4 * m
    assert traffic.op_bytes("fp8_group", m, n, 2) == 2 * m * n + m * n + 2 * n + 4 * m * 40
    assert traffic.op_bytes("fp8_group", m, 1000, 2) == 3 * m * 1000 + 2 * 1000 + 4 * m * 8  # a narrow last group
    assert traffic.op_bytes("fp8_static", m, n, 2) == 2 * m * n + m * n + 2 * n + 4
    assert traffic.op_bytes("fp8_add_token", m, n, 2) == (2 + 2 + 2) * m * n + m * n + 2 * n + 4 * m
    assert traffic.read_bytes("fp8_token", m, n, 2) == 2 * m * n + 2 * n
    assert traffic.read_bytes("fp8_add_token", m, n, 2) == 4 * m * n + 2 * n


def test_fp8_measure_plans_its_grid_ops_and_providers(capsys):
    """fp8 runs its four ops on its own bf16 grid (quick: 4096 x 4096) with ours, the compiled reference and the
    unfused pair; latency adds the per-row op at its decode sizes, with the same providers."""
    args, steps = _heldout_plan(["--measure", "fp8"])
    grid = [("bf16", m, n) for m in (4096, 32768) for n in (2048, 4096, 5120, 8192)]
    assert [(measure, op, suite) for measure, op, suite, _ in steps] == [
        ("fp8", op, "fp8") for op in ("fp8_token", "fp8_group", "fp8_static", "fp8_add_token")
    ]
    assert all(configs == grid for *_, configs in steps)
    assert args.fp8_providers == ["tilegym_rms-cutile", "torch.compile", "tilegym_rms-unfused"]
    assert args.rms_providers == [] and args.fused_providers == [] and args.qk_providers == []
    _, steps = _heldout_plan(["--measure", "fp8", "--quick"])
    assert all(configs == [("bf16", 4096, 4096)] for *_, configs in steps)
    _, steps = _heldout_plan(["--measure", "fp8", "--M", "8", "--N", "96", "--dtype", "fp16"])
    assert all(configs == [("fp16", 8, 96)] for *_, configs in steps)
    args, steps = _heldout_plan(["--measure", "latency"])
    assert [op for _, op, _, _ in steps] == ["forward", "full", "fp8_token"]
    assert steps[2][3] == [("bf16", m, 4096) for m in (1, 8, 64, 512)]
    assert args.fp8_providers == list(base.FP8_PROVIDERS_DEFAULT) and "liger" in args.rms_providers
    assert bench_rmsnorm.main(["--measure", "fp8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    mb = traffic.op_bytes("fp8_add_token", 32768, 8192, 2) / 1e6
    assert "-- fp8 / fp8_add_token: 8 configurations" in out and f"bf16 M=32768 N=8192: {mb:.1f} MB/call" in out
    assert "total configurations: 32" in out


def test_fp8_check_dequantizes_against_float64():
    """A correct quantization passes at each granularity; a scale a quarter off, or the scales of another row
    group, fail; the fused add's sum is checked against x + r as built."""
    sets = providers.InputSets(32, 320, torch.bfloat16, "cpu", 1, 0, 1e-6, need_dy=False, need_residual=True)
    ref = reference.rms_norm_fp8_reference
    for op in traffic.FP8_OPS:
        add = traffic.FP8_OPS[op][1]
        y_q, scales, s = ref(sets.x[0], sets.w[0], 1e-6, residual=sets.r[0] if add else None,
                             **providers.fp8_quant(op, "cpu"))  # fmt: skip
        good = {"y_q": y_q, "scales": scales} | ({"res": s} if add else {})
        errs = providers.output_errors(op, sets, 1e-6, good)
        assert providers.check_ok(errs, "bf16") and set(errs) == {"y_q"} | ({"res"} if add else set()), (op, errs)
        assert not providers.check_ok(providers.output_errors(op, sets, 1e-6, good | {"scales": scales * 1.25}), "bf16")
        if add:
            assert not providers.check_ok(providers.output_errors(op, sets, 1e-6, good | {"res": s + 0.05}), "bf16")
    y_q, scales, _ = ref(sets.x[0], sets.w[0], 1e-6, **providers.fp8_quant("fp8_group", "cpu"))
    swapped = {"y_q": y_q, "scales": scales.flip(-1)}  # each group scaled by another's amax
    assert not providers.check_ok(providers.output_errors("fp8_group", sets, 1e-6, swapped), "bf16")


def test_fp8_measure_cpu_mode(tmp_path, monkeypatch, capsys):
    """--measure fp8 in the CPU test mode: every op of every provider checked ok, ours and the unfused pair adding
    into the same residuals in place (each first call is checked against them as built); a peer without an FP8
    output is skipped with the reason."""
    monkeypatch.setenv(base.CPU_ENV, "1")
    argv = ["--measure", "fp8", "--M", "64", "--N", "384", "--reps", "2", "--out", str(tmp_path)]
    argv += ["--providers", "tilegym_rms-torch,tilegym_rms-unfused,torch,liger", "--no-plot"]
    assert bench_rmsnorm.main(argv) == 0
    out = capsys.readouterr().out
    assert "fp8 provider liger skipped: no RMSNorm with FP8 output in liger" in out
    assert "RMSNorm with FP8 output (e4m3fn), residual add in place, per-row scales" in out
    saved = [r for r in json.loads((tmp_path / "rms_norm.json").read_text()) if r["metric_name"] == "throughput"]
    assert {r["kernel_operation_mode"] for r in saved} == set(traffic.FP8_OPS)
    assert {r["kernel_provider"] for r in saved} == {"tilegym_rms-torch", "tilegym_rms-unfused", "torch"}
    for rec in saved:
        assert json.loads(rec["extra_benchmark_config_str"])["suite"] == "fp8"
        assert rec["x_values"] == [384] and not rec.get("mismatch_x_values")
        assert all(0 < e <= base.FP8_TOLERANCE for e in rec["rel_err"])


def test_latency_times_the_fp8_op_with_the_fp8_providers(tmp_path, monkeypatch):
    """The latency loop runs an FP8 op with the FP8 providers, each call checked against float64."""
    monkeypatch.setenv(base.CPU_ENV, "1")
    argv = ["--reps", "2", "--out", str(tmp_path), "--no-plot"]
    args = cli_args.finish_args(bench_rmsnorm.build_parser().parse_args(argv))
    run = session.Session(args, "k", "k.json")
    names = ["tilegym_rms-unfused", "torch"]
    run.fp8_providers, skipped = providers.discover_fp8_providers(names, run.device, args.eps, run.mod)
    assert not skipped
    run.providers = [providers.Provider("plain", lambda x, w: x)]  # not an FP8 provider: never called
    points = run.run_latency("fp8_token", [1, 8], 256, "bf16", calls=2, warmup=1)
    assert [(p.provider, p.m) for p in points] == [
        (name, m) for m in (1, 8) for name in ("tilegym_rms-unfused", "torch")
    ]
    assert all(p.ok and set(p.errs) == {"y_q"} and len(p.us) == 2 for p in points)


def test_gated_bytes_count_the_gate_and_the_group_rstd():
    m, n = 4096, 2048  # 8 groups
    assert traffic.op_bytes("gated_fwd_before_bf16gate", m, n, 2) == 3 * m * n * 2 + n * 2
    assert traffic.op_bytes("gated_fwd_after_fp32gate", m, n, 2) == m * n * (2 * 2 + 4) + n * 2
    assert traffic.op_bytes("gated_bwd_after_fp32gate", m, n, 2) == m * n * (3 * 2 + 2 * 4) + 2 * n * 2 + 4 * m * 8
    assert traffic.op_bytes("gated_bwd_before_bf16gate", m, 128, 2) == m * 128 * 5 * 2 + 2 * 128 * 2 + 4 * m


def test_gated_measure_cpu_mode(tmp_path, monkeypatch, capsys):
    """--measure gated in the CPU test mode: every op of ours and of the torch peers, checked against float64
    at one group and at eight."""
    monkeypatch.setenv(base.CPU_ENV, "1")
    argv = ["--measure", "gated", "--M", "16", "--N", "128,1024", "--reps", "1", "--out", str(tmp_path)]
    argv += ["--providers", "tilegym_rms-torch,tilegym_rms-unfused,mamba-torch,liger", "--no-plot"]
    assert bench_rmsnorm.main(argv) == 0
    out = capsys.readouterr().out
    assert "gated provider liger skipped: no gated RMSNorm" in out
    assert "Gated RMSNorm, backward (autograd), gate before norm, in groups, float32 gate" in out
    saved = [r for r in json.loads((tmp_path / "rms_norm.json").read_text()) if r["metric_name"] == "throughput"]
    assert {r["kernel_operation_mode"] for r in saved} == set(gated.OPS)
    assert {r["kernel_provider"] for r in saved} == {"tilegym_rms-torch", "tilegym_rms-unfused", "mamba-torch"}
    for rec in saved:
        assert rec["x_values"] == [128, 1024] and not rec.get("mismatch_x_values")
        assert all(0 <= e <= base.TOLERANCE["bf16"] for e in rec["rel_err"])


def test_gated_measure_with_whole_rows_as_one_group(tmp_path, monkeypatch):
    """--gated-groups 1: rows of 1024 columns or more are one group (Mamba2 models of one group), every provider
    checked against float64 in that layout, the backward's bytes counting one rstd a row, each record naming the
    count; a count that does not divide N is refused before anything runs."""
    monkeypatch.setenv(base.CPU_ENV, "1")
    monkeypatch.setattr(gated, "GROUPS", gated.GROUPS)  # main sets the run's count; restored after the test
    argv = ["--measure", "gated", "--M", "16", "--N", "1024", "--reps", "1", "--out", str(tmp_path), "--no-plot"]
    argv += ["--providers", "tilegym_rms-torch,mamba-torch"]
    assert bench_rmsnorm.main([*argv, "--gated-groups", "1"]) == 0
    assert gated.group_size(1024) is None
    assert gated.op_bytes("gated_bwd_after_bf16gate", 16, 1024, 2) == 16 * 1024 * 5 * 2 + 2 * 1024 * 2 + 4 * 16
    saved = [r for r in json.loads((tmp_path / "rms_norm.json").read_text()) if r["metric_name"] == "throughput"]
    assert {r["kernel_operation_mode"] for r in saved} == set(gated.OPS)
    for rec in saved:
        assert json.loads(rec["extra_benchmark_config_str"])["groups"] == 1 and not rec.get("mismatch_x_values")
        assert all(0 <= e <= base.TOLERANCE["bf16"] for e in rec["rel_err"])
    assert bench_rmsnorm.main([*argv, "--gated-groups", "3"]) == 2  # 1024 columns are not 3 groups


def test_gated_check_sees_a_wrong_gate_gradient():
    sets = providers.InputSets(8, 1024, torch.float32, "cpu", 1, 0, 1e-6, gate_dtype=torch.float32)
    mamba = providers.Provider("mamba-torch", functools.partial(gated.mamba_torch, eps=1e-6))
    call, _ = providers.build_call("gated_bwd_after_fp32gate", mamba, sets)
    out = call(0)
    assert providers.check_ok(providers.output_errors("gated_bwd_after_fp32gate", sets, 1e-6, out), "fp32")
    bad = out | {"dz": out["dz"] * 1.01}
    assert not providers.check_ok(providers.output_errors("gated_bwd_after_fp32gate", sets, 1e-6, bad), "fp32")
