"""Tuning tables (tilegym_rms.cutile.tuning): the shipped tables, the product's lookup, the override hooks and
the card keys, all on the CPU. The sweep that writes the tables is tested in test_tuning_sweep.py."""

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tilegym_rms.cutile import config, tuning
from tilegym_rms.cutile.tuning import build

SMS = 132
BF16 = torch.bfloat16
REPO = Path(__file__).resolve().parents[1]

# The forward / backward configs of the 14-shape grid (bench.common.base.GRID_M x GRID_N) as the analytic
# heuristics choose them, pinned (H100: 132 SMs), through the host (forward: M's bucket,
# the grid following M). ForwardConfig: kernel, tile_m, tile_n, single_tile, grid, hints, tail_n.
# BackwardConfig: strategy, tile_m, tile_n, grid, num_chunks, hints, tail_n, strip_n, strip_m, and dw_per_row (added
# after the freeze: many-row tiles of at most Heuristics.bwd_dw_per_row_max_row columns).
O2, O8, O4 = (("occupancy", 2),), (("occupancy", 8),), (("occupancy", 4),)
W8O8 = (("num_worker_warps", 8), ("occupancy", 8))
W8O1 = (("num_worker_warps", 8), ("occupancy", 1))
BWD = {
    1024: ("persistent", 8, 1024, 264, 1, O2, 0, 0, 0, False),
    2048: ("persistent", 4, 2048, 264, 1, O2, 0, 0, 0, False),
    4096: ("persistent", 2, 4096, 264, 1, O2, 0, 0, 0, False),
    5120: ("persistent", 1, 4096, 264, 1, O2, 1024, 0, 0, False),
    7168: ("persistent", 2, 8192, 132, 1, W8O1, 0, 0, 0, False),
    8192: ("persistent", 2, 8192, 132, 1, W8O1, 0, 0, 0, False),
    16384: ("persistent", 1, 16384, 132, 1, W8O1, 0, 0, 0, False),
}
FWD_4096 = {
    1024: ("persistent", 16, 1024, True, 256, O2, 0),
    2048: ("persistent", 8, 2048, True, 264, O2, 0),
    4096: ("persistent", 4, 4096, True, 264, O2, 0),
    5120: ("persistent", 2, 8192, True, 264, (), 0),
    7168: ("persistent", 2, 8192, True, 264, (), 0),
    8192: ("persistent", 2, 8192, True, 264, (), 0),
    16384: ("gather", 1, 16384, True, 4096, O2, 0),
}
FWD_32768 = {
    1024: ("persistent", 16, 1024, True, 1056, O2, 0),
    2048: ("gather", 1, 2048, True, 32768, O8, 0),
    4096: ("gather", 1, 4096, True, 32768, W8O8, 0),
    5120: ("persistent", 2, 8192, True, 264, (), 0),  # fp32: gather 8192 (the 16-bit fill rule)
    7168: ("gather", 1, 8192, True, 32768, O4, 0),
    8192: ("gather", 1, 8192, True, 32768, O4, 0),
    16384: ("gather", 1, 16384, True, 32768, O2, 0),
}
FP32_32768_5120 = ("gather", 1, 8192, True, 32768, O4, 0)


def expected_grid():
    """{(dtype name, m, n): (forward, backward)} as frozen above."""
    out = {}
    for dt in ("bf16", "fp16", "fp32"):
        for m, fwd in ((4096, FWD_4096), (32768, FWD_32768)):
            for n in fwd:
                f = FP32_32768_5120 if (dt, m, n) == ("fp32", 32768, 5120) else fwd[n]
                out[(dt, m, n)] = (f, BWD[n])
    return out


GRID_SCRIPT = """
import json, sys
from tilegym_rms.cutile import host, launch, tuning
launch.num_sms = lambda index: 132
tuning.device_key = lambda index: "sm90_132sm"
out = {}
for dt, dtype in tuning.DTYPES.items():
    for m in (4096, 32768):
        for n in (1024, 2048, 4096, 5120, 7168, 8192, 16384):
            f, b = host.forward.cached_config(0, m, n, dtype, None), host.backward.cached_config(0, m, n, dtype)
            out[f"{dt} {m} {n}"] = [list(f.__dict__.values()), list(b.__dict__.values())]
print(json.dumps({"table": tuning.table_for(0) is not None, "configs": out}))
"""


def run_grid(env_value):
    env = {k: v for k, v in os.environ.items() if k != tuning.ENV}
    if env_value is not None:
        env[tuning.ENV] = env_value
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", GRID_SCRIPT], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def as_json(value):
    return json.loads(json.dumps(value))


@pytest.mark.parametrize("env_value", ["off", None])
def test_grid_configs_equal_the_heuristics_before_the_table(env_value):
    """``off`` (a fresh process: the variable is read once): the analytic fallback; unset: the shipped
    H100 table. Both give the frozen pre-table decisions on the grid, whose widths are bucket points,
    except where the table holds a measured sweep (there the winner rules: see the lookup tests)."""
    pytest.importorskip("cuda.tile")
    got = run_grid(env_value)
    assert got["table"] == (env_value is None)
    swept = set() if env_value == "off" else swept_dtypes(shipped()["sm90_132sm"])
    table = tuning.packaged("sm90_132sm")
    checked = 0
    for (dt, m, n), (f, b) in expected_grid().items():
        f_got, b_got = got["configs"][f"{dt} {m} {n}"]
        if dt not in swept:
            assert [f_got, b_got] == as_json([f, b]), (dt, m, n)
            checked += 1
        else:  # the fresh process launches the packaged table's winners (kernel and tiles of the bucket)
            win_f = next(table.winners("forward", m, n, tuning.DTYPES[dt]))
            win_b = table.lookup("backward", m, n, tuning.DTYPES[dt])
            assert (f_got[0], f_got[1]) == (win_f.kernel, win_f.tile_m), (dt, m, n)
            assert (b_got[0], b_got[1]) == (win_b.strategy, win_b.tile_m), (dt, m, n)
    assert checked >= len(expected_grid()) // 3 or env_value is None


def swept_dtypes(doc) -> set[str]:
    """The dtypes of a table with a measured run (a winner that may differ from the heuristics)."""
    return {
        dt
        for op in tuning.OPS
        for dt, by_n in doc.get(op, {}).items()
        for runs in by_n.values()
        if any("gbps" in r for r in runs)
    }


def test_an_invalid_table_in_the_environment_fails_with_its_path(tmp_path):
    pytest.importorskip("cuda.tile")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": 1, "device": {"key": "x"}, "forward": {"bf16": {"100": []}}}')
    env = {**os.environ, tuning.ENV: str(bad), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", GRID_SCRIPT], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "TuningTableError" in proc.stderr and str(bad) in proc.stderr and "'100' is not an N bucket" in proc.stderr


def shipped():
    return {
        key: json.loads((REPO / "tilegym_rms/cutile/tuning" / f"{key}.json").read_text())
        for key in tuning.packaged_keys()
    }


def test_shipped_tables_load_and_cover_every_bucket():
    tables = shipped()
    assert "sm90_132sm" in tables
    for key, doc in tables.items():
        table = tuning.packaged(key)
        assert table.key == key and doc["device"]["key"] == key
        for op in build.ANALYTIC_OPS:
            for dt in tuning.DTYPES:
                for n_b in tuning.N_BUCKETS:
                    runs = doc[op][dt][str(n_b)]
                    assert runs[0]["m"] == 1, (op, dt, n_b)  # every M bucket has a run


def test_no_shipped_table_launches_the_split_forward():
    """The split forward's blocks wait on each other, and one of its builds never finished in the GPU suite: it
    runs only when a caller names it, never from a table the package ships."""
    for key in tuning.packaged_keys():
        for (op, dt, n_b), runs in tuning.packaged(key).runs.items():
            if op in tuning.FORWARD_OPS:  # every winner a forward lookup returns is one of these runs'
                assert all(cand.kernel != "split" for _, cand in runs), (key, op, dt, n_b)


def sweep_evidence() -> dict[str, Path]:
    """The tables the sweeps wrote, every candidate's GB/s kept, by device key (bench/results/<gpu>/sweeps/)."""
    paths = sorted(REPO.glob("bench/results/*/sweeps/table_*_candidates.json"))
    return {json.loads(p.read_text())["device"]["key"]: p for p in paths}


def test_every_shipped_table_is_the_winners_of_its_sweeps_table():
    """The shipped table is what the writer makes of the sweep's full table (build.slim), and every lookup,
    at every (op, dtype, N bucket) entry and every M bucket, gives the same winner from both."""
    evidence = sweep_evidence()
    measured = {key for key, doc in shipped().items() if doc["source"] != "analytic"}
    assert measured and measured <= set(evidence), "a measured table ships without its sweep's table"
    checked = 0
    for key, path in evidence.items():
        full, table = tuning.load(path), tuning.packaged(key)
        assert table.doc == build.slim(full.doc), key
        assert set(table.runs) == set(full.runs), key
        for op, dt, n_b in full.runs:
            for m_b in tuning.M_BUCKETS:
                dtype = tuning.DTYPES[dt]
                assert table.lookup(op, m_b, n_b, dtype) == full.lookup(op, m_b, n_b, dtype), (key, op, dt, n_b, m_b)
                checked += 1
    assert checked > 10000


def test_slim_keeps_each_runs_winner_and_its_own_timing():
    """Of a measured run the shipped form keeps the winner's GB/s (a qk winner's two halves; with ``timed``,
    what they are of), so the run still reads as measured; analytic runs stay as they are."""
    fwd = config.ForwardCandidate("persistent", 2, 8192, 0, 3, 4, 8)
    other = config.ForwardCandidate("gather", 1, 8192, 0, 0, 8, 0)
    doc = one_entry("forward", "bf16", 4224, fwd)
    gbps = {build.label("forward", fwd): 2.0, build.label("forward", other): 1.0}
    build.set_runs(
        doc,
        "forward",
        "bf16",
        4224,
        [{"m": 1, "winner": asdict(other)}, {"m": 64, "winner": asdict(fwd), "gbps": gbps}],
    )
    halves = {build.qk_half_label(QK_ODD, side): 3.0 for side in ("fwd", "bwd")}
    qk_gbps = {**halves, "fwd 1r b1 o0": 1.0, "bwd 1r b1 o0": 1.0}
    build.set_runs(doc, "qk", "bf16", 64, [{"m": 4096, "winner": asdict(QK_ODD), "gbps": qk_gbps}])
    bwd = config.backward_candidate(4096, 4224, BF16, SMS)
    timed = {"m": 4096, "winner": asdict(bwd), "gbps": {build.label("backward", bwd): 5.0, "x": 6.0}, "timed": "pair"}
    build.set_runs(doc, "backward", "bf16", 4224, [timed])
    out = build.slim(doc)
    assert out["forward"]["bf16"]["4224"] == [
        {"m": 1, "winner": asdict(other)},
        {"m": 64, "winner": asdict(fwd), "gbps": {build.label("forward", fwd): 2.0}},
    ]
    assert out["qk"]["bf16"]["64"][0]["gbps"] == halves
    assert out["backward"]["bf16"]["4224"][0] == {**timed, "gbps": {build.label("backward", bwd): 5.0}}
    assert {k: v for k, v in out.items() if k not in tuning.OPS} == {
        k: v for k, v in doc.items() if k not in tuning.OPS
    }


def test_shipped_analytic_table_is_the_heuristics_at_every_bucket_point():
    doc = shipped()["sm90_132sm"]
    if doc["source"] != "analytic":
        pytest.skip("a measured table")
    table = tuning.packaged("sm90_132sm")
    for dtype in tuning.DTYPES.values():
        for n_b in tuning.N_BUCKETS[::7]:
            for m in (1, 512, 1024, 16384, 1 << 22):
                assert table.lookup("forward", m, n_b, dtype) == config.forward_candidate(m, n_b, dtype, SMS)
                assert table.lookup("backward", m, n_b, dtype) == config.backward_candidate(m, n_b, dtype, SMS)


@pytest.fixture
def host(monkeypatch):
    """The cuTile host modules (:mod:`tilegym_rms.cutile.host`) on an H100 with its packaged table."""
    pytest.importorskip("cuda.tile")
    from tilegym_rms.cutile import host, launch

    monkeypatch.setattr(launch, "num_sms", lambda index: SMS)
    monkeypatch.setattr(tuning, "device_key", lambda index: "sm90_132sm")
    with tuning.use_table("packaged"):
        yield host


def winner(doc, op, dt, n_b, m_b):
    """The run of an M bucket, read from the JSON by hand (the schema's floor rule)."""
    runs = doc[op][dt][str(n_b)]
    return [r for r in runs if r["m"] <= m_b][-1]["winner"] if runs[0]["m"] <= m_b else runs[0]["winner"]


SAMPLE = [(1, 64), (7, 96), (300, 1000), (513, 4100), (5000, 5120), (40000, 7000), (3000, 12000), (9, 40000)]


@pytest.mark.parametrize("m, n", SAMPLE)
def test_the_product_launches_the_tables_winner(host, m, n):
    doc = shipped()["sm90_132sm"]
    for dt, dtype in tuning.DTYPES.items():
        n_b, m_b = tuning.n_bucket(n), config.m_bucket(m)
        f = host.forward.cached_config(0, m, n, dtype, None)
        w = winner(doc, "forward", dt, n_b, m_b)
        assert (f.kernel, f.tile_m, f.tile_n, f.tail_n) == (w["kernel"], w["tile_m"], w["tile_n"], w["tail_n"])
        assert dict(f.hints) == {k: w[k] for k in ("occupancy", "num_worker_warps") if w[k]}
        b = host.backward.cached_config(0, m, n, dtype)
        w = winner(doc, "backward", dt, n_b, m_b)
        assert (b.strategy, b.tile_m, b.tile_n, b.tail_n) == (w["strategy"], w["tile_m"], w["tile_n"], w["tail_n"])


def one_entry(op, dt, n_b, cand, m=1):
    doc = build.new_doc("sm90_132sm", "test", (9, 0), SMS, "measured", "test")
    build.set_runs(doc, op, dt, n_b, [{"m": m, "winner": asdict(cand), "gbps": {}}])
    return doc


def test_use_table_overrides_and_restores(host):
    odd = config.ForwardCandidate("persistent", 2, 8192, 0, 3, 4, 8)  # no heuristic picks this
    before = host.forward.cached_config(0, 4096, 4096, BF16, None)
    with tuning.use_table(one_entry("forward", "bf16", 4224, odd)):
        cfg = host.forward.cached_config(0, 4096, 4100, BF16, None)  # 4100 rounds up to the 4224 bucket
        assert (cfg.tile_m, cfg.tile_n, cfg.grid) == (2, 8192, 3 * SMS)
        assert dict(cfg.hints) == {"occupancy": 4, "num_worker_warps": 8}
        assert host.forward.cached_config(0, 4096, 4096, BF16, None) == config.forward_config(4096, 4096, BF16, SMS)
        # A forced kernel other than the winner's: the heuristics for that kernel.
        assert host.forward.cached_config(0, 4096, 4100, BF16, "gather").kernel == "gather"
    assert host.forward.cached_config(0, 4096, 4096, BF16, None) == before
    tuning.use_table(None)  # as a setter
    assert tuning.table_for(0) is None
    tuning.use_table("packaged")
    assert tuning.table_for(0) is tuning.packaged("sm90_132sm")


@pytest.mark.parametrize(
    "op, cand",
    [
        ("forward", config.ForwardCandidate("persistent", 4, 4096, 1024, 4, 2, 0)),
        ("forward", config.ForwardCandidate("gather", 1, 8192, 0, 0, 4, 8)),
        ("backward", config.BackwardCandidate("persistent", 2, 8192, 0, 1, 1, 8)),
    ],
)
def test_a_label_parses_back_to_its_candidate(op, cand):
    assert build.parse_label(op, build.label(op, cand)) == cand


@pytest.mark.parametrize(
    "op, text, message",
    [
        ("forward", "persistent 2x8192 b8 o0", "is not a candidate label"),
        ("forward", "walker 2x8192 b8 o0 w0", "kernel must be one of"),
        ("backward", "gather 1x8192 b0 o4 w0", "strategy must be one of"),
        ("qk", "fwd 32r b8 o2", "two halves"),
    ],
)
def test_a_label_that_names_no_candidate_says_why(op, text, message):
    with pytest.raises(tuning.TuningTableError, match=message):
        build.parse_label(op, text)


def test_with_winner_changes_one_m_bucket_of_the_table(host):
    doc = shipped()["sm90_132sm"]
    odd = config.ForwardCandidate("persistent", 2, 8192, 0, 3, 4, 8)  # no table or heuristic picks this
    n, n_b = 5000, tuning.n_bucket(5000)
    changed = build.with_winner(doc, "forward", "bf16", 8192, n, odd)
    table, before = tuning.load(changed), tuning.load(doc)
    assert table.lookup("forward", 7000, n, BF16) == odd
    for m in (1, 2048, 4096, 16384, 32768, 1 << 22):  # every other bucket keeps its winner
        assert table.lookup("forward", m, n, BF16) == before.lookup("forward", m, n, BF16)
    assert table.lookup("forward", 7000, n + 512, BF16) == before.lookup("forward", 7000, n + 512, BF16)
    assert table.lookup("backward", 7000, n, BF16) == before.lookup("backward", 7000, n, BF16)
    assert doc["forward"]["bf16"][str(n_b)] == shipped()["sm90_132sm"]["forward"]["bf16"][str(n_b)]  # not mutated
    with tuning.use_table(changed):
        assert host.forward.cached_config(0, 7000, n, BF16, None).grid == 3 * SMS


def test_with_winner_refuses_a_candidate_its_bucket_cannot_run():
    narrow = config.ForwardCandidate("persistent", 4, 4096, 512, 2, 2, 0)  # 4608 columns: short of the bucket's
    with pytest.raises(tuning.TuningTableError, match="cannot serve N = 5000.*does not cover N = 5120"):
        build.with_winner(shipped()["sm90_132sm"], "forward", "bf16", 8192, 5000, narrow)


H100 = "NVIDIA H100 80GB HBM3"  # the card the shipped sm90_132sm table was measured on


@pytest.fixture
def card(monkeypatch):
    """A CUDA device as ``device_key`` asks it (capability, SM count, name), on the CPU; returns the setter."""
    from tilegym_rms.cutile import launch

    def set_card(name, capability=(9, 0), sms=SMS, peak_gbps=None):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: name)
        monkeypatch.setattr(launch, "num_sms", lambda index: sms)
        monkeypatch.setattr(tuning, "memory_gbps", lambda index: peak_gbps)

    with tuning.use_table("packaged"):
        yield set_card


def test_a_card_of_a_measured_class_gets_a_key_of_its_own(card):
    """An H200 has an H100 SXM's capability and SM count: its key names the card, so that its sweeps never
    land in the H100's table; the card the class table was measured on, and a class without a table, keep
    the class key."""
    assert tuning.packaged("sm90_132sm").doc["device"]["name"] == H100
    card(H100)
    assert tuning.device_key(0) == "sm90_132sm"
    card("NVIDIA H200")
    assert tuning.device_key(0) == "sm90_132sm.nvidia-h200"
    card("NVIDIA B200", (10, 0), 148)
    assert tuning.device_key(0) == "sm100_148sm"


def test_describe_names_the_table_and_the_cards_it_was_measured_on(card, tmp_path):
    """The line ``tilegym-rms`` prints for the cuTile backend: which table tunes the launches and where its
    entries were measured, or why the heuristics do."""
    card(H100)
    assert tuning.describe(0) == f"sm90_132sm (shipped; measured on {H100})"
    card("NVIDIA H200")
    assert tuning.describe(0) == (
        f"sm90_132sm.nvidia-h200 (shipped; measured on NVIDIA H200, entries not measured there from {H100})"
    )
    card("NVIDIA GH200 480GB")  # no table of its own, its peak unknown: the class's
    assert tuning.describe(0) == f"sm90_132sm (shipped, the class's; measured on {H100})"
    card("NVIDIA H200 NVL", peak_gbps=4800.0)
    assert tuning.describe(0) == (
        "sm90_132sm.nvidia-h200 (shipped, for the class's card nearest to this one's 4800 GB/s peak; "
        f"measured on NVIDIA H200, entries not measured there from {H100})"
    )
    card("NVIDIA B200", (10, 0), 148)
    assert tuning.describe(0) == "none for sm100_148sm: the analytic heuristics"
    path = tmp_path / "analytic.json"
    build.write(build.analytic_doc("sm100_148sm", "NVIDIA B200", (10, 0), 148, "test"), path)
    with tuning.use_table(str(path)):
        assert tuning.describe(0) == "sm100_148sm (set by the user; the analytic heuristics written out)"
    with tuning.use_table("off"):
        assert tuning.describe(0) == "off: the analytic heuristics"


@pytest.mark.parametrize(
    "name,peak_gbps,key",
    [
        ("NVIDIA H200 NVL", 4800.0, "sm90_132sm.nvidia-h200"),  # an H200's chip and memory at another power
        ("NVIDIA GH200 144G HBM3e", 4900.0, "sm90_132sm.nvidia-h200"),
        ("NVIDIA GH200 480GB", 4000.0, "sm90_132sm"),  # HBM3 at 4 TB/s: nearer the H100's 3.35
        ("NVIDIA H100 NVL", 3900.0, "sm90_132sm"),
        ("NVIDIA H800", 3352.0, "sm90_132sm"),
        ("NVIDIA GH200 480GB", None, "sm90_132sm"),  # peak unknown: the class's table
    ],
)
def test_a_card_without_its_own_table_runs_the_nearest_in_memory_bandwidth(card, name, peak_gbps, key):
    """Of the tables shipped for the class, the one whose card's measured copy rate is nearest to what this card's
    peak predicts: the chip is the class's, the memory is what moves the winners."""
    card(name, peak_gbps=peak_gbps)
    assert tuning.table_for(0) is tuning.packaged(key) is not None
    copies = {k: tuning.packaged(k).doc["copy_gbps"] for k in ("sm90_132sm", "sm90_132sm.nvidia-h200")}
    assert copies["sm90_132sm.nvidia-h200"] > 1.3 * copies["sm90_132sm"]  # the two cards differ that much


def test_nearest_table_keeps_the_class_table_without_measured_rates(monkeypatch):
    doc = build.analytic_doc("sm90_132sm", "test", (9, 0), SMS, "test")
    analytic = tuning.Table(doc)
    monkeypatch.setattr(tuning, "packaged_keys", lambda: ["sm90_132sm"])
    monkeypatch.setattr(tuning, "packaged", lambda key: analytic if key == "sm90_132sm" else None)
    assert "copy_gbps" not in doc
    assert tuning.nearest_table("sm90_132sm", 4800.0) is analytic
    assert tuning.nearest_table("sm100_148sm", 8000.0) is None


@pytest.mark.gpu
def test_the_peak_torch_reports_predicts_this_cards_copy_rate():
    """The bandwidth rule's premise on real hardware: the peak from the memory clock and bus width, times
    COPY_SHARE, lands near the copy rate the card's own table measured (where one ships)."""
    tuning.memory_gbps.cache_clear()
    peak = tuning.memory_gbps(0)
    assert peak is not None and 1000 < peak < 20000, peak
    table = tuning.packaged(tuning.device_key(0))
    if table is None or not table.doc.get("copy_gbps"):
        pytest.skip(f"no table of this card's own with a measured copy rate ({tuning.device_key(0)})")
    assert abs(math.log(table.doc["copy_gbps"] / (tuning.COPY_SHARE * peak))) < 0.08, (peak, table.doc["copy_gbps"])


def test_a_card_without_its_own_table_runs_its_classs(card, monkeypatch):
    card("NVIDIA GH200 480GB")  # an H100 SXM's capability and SM count, no table of its own
    assert tuning.table_for(0) is tuning.packaged("sm90_132sm")
    own = tuning.load(one_entry("forward", "bf16", 4224, config.ForwardCandidate("persistent", 2, 8192, 0, 3, 4, 8)))
    shipped = tuning.packaged
    monkeypatch.setattr(tuning, "packaged", lambda key: own if key == "sm90_132sm.nvidia-gh200-480gb" else shipped(key))
    assert tuning.table_for(0) is own
    monkeypatch.setattr(tuning, "packaged", shipped)
    card("NVIDIA H200")  # a card whose own table ships
    assert tuning.table_for(0) is shipped("sm90_132sm.nvidia-h200") is not None
    card(H100)
    assert tuning.table_for(0) is shipped("sm90_132sm")
    card("NVIDIA B200", (10, 0), 148)
    assert tuning.table_for(0) is None  # no table for the class: the heuristics


def test_use_table_reads_a_file(host, tmp_path):
    odd = config.BackwardCandidate("persistent", 4, 4096, 1024, 1, 0, 4)
    path = tmp_path / "t.json"
    build.write(one_entry("backward", "fp16", 5120, odd), path)
    with tuning.use_table(str(path)):
        b = host.backward.cached_config(0, 1 << 20, 5000, torch.float16)
        assert (b.tile_m, b.tile_n, b.tail_n, b.grid, b.hints) == (4, 4096, 1024, SMS, (("num_worker_warps", 4),))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema=3), "'schema' must be 2"),
        (lambda d: d["forward"]["bf16"].update({"4100": d["forward"]["bf16"].pop("4224")}), "not an N bucket"),
        (lambda d: d["forward"]["bf16"]["4224"][0]["winner"].update(tile_n=4096), "does not cover N = 4224"),
        (lambda d: d["forward"]["bf16"]["4224"][0]["winner"].update(tile_m=3), "powers of two"),
        (lambda d: d["forward"]["bf16"]["4224"][0]["winner"].update(kernel="fast"), "kernel must be one of"),
        (lambda d: d["forward"]["bf16"]["4224"][0]["winner"].pop("occupancy"), "exactly the fields"),
        (lambda d: d["forward"]["bf16"]["4224"][0].update(m=3), "power of two up to 2**22"),
        (lambda d: d["forward"]["bf16"]["4224"][0]["winner"].update(blocks_per_sm=0), "blocks_per_sm must be >= 1"),
    ],
)
def test_an_invalid_table_says_what_is_wrong(mutate, message):
    doc = one_entry("forward", "bf16", 4224, config.ForwardCandidate("persistent", 2, 8192, 0, 2, 2, 0))
    tuning.Table(doc)  # valid as built
    mutate(doc)
    with pytest.raises(tuning.TuningTableError, match=message.replace("*", r"\*").replace("(", r"\(")):
        tuning.Table(doc, "t.json")


def test_a_schema_1_table_loads_as_schema_2():
    """Schema 1 named the backward's strategy "plan": a table written then (a TILEGYM_RMS_TUNING file) loads
    with the same winners, its document in the current schema; the caller's document is left as it was."""
    cand = config.BackwardCandidate("persistent", 4, 4096, 1024, 1, 0, 4)
    doc = one_entry("backward", "fp16", 5120, cand)
    old = json.loads(json.dumps(doc))
    old["schema"] = 1
    runs = old["backward"]["fp16"]["5120"]
    runs[0]["winner"] = {("plan" if k == "strategy" else k): v for k, v in runs[0]["winner"].items()}
    table = tuning.load(old)
    assert table.lookup("backward", 1 << 20, 5000, torch.float16) == cand
    assert table.doc == doc and old["schema"] == 1 and "plan" in runs[0]["winner"]


def test_buckets():
    assert [tuning.n_bucket(n) for n in (1, 64, 65, 96, 97, 128, 4097, 8192, 8193, 16385, 40000, 65536)] == [
        64, 64, 96, 96, 128, 128, 4224, 8192, 9216, 20480, 40960, 65536,
    ]  # fmt: skip
    assert tuning.n_bucket(65537) is None
    assert all(n % 128 == 0 for n in tuning.N_BUCKETS[2:]) and list(tuning.N_BUCKETS) == sorted(set(tuning.N_BUCKETS))
    assert set(range(128, 8193, 128)) <= set(tuning.N_BUCKETS)
    assert [tuning.m_bucket(m) for m in (1, 3, 4096, 4097, 1 << 30)] == [1, 4, 4096, 8192, 1 << 22]


def test_a_winner_serves_every_n_of_its_bucket():
    """The analytic candidate at a bucket point, built for each N of the bucket, covers the row."""
    for n_b in tuning.N_BUCKETS:
        i = tuning.N_BUCKETS.index(n_b)
        lo = tuning.N_BUCKETS[i - 1] + 1 if i else 1
        for m in (1, 1 << 20):
            for n in {lo, (lo + n_b) // 2, n_b}:
                b = config.build_backward(config.backward_candidate(m, n_b, BF16, SMS), m, n, SMS)
                f = config.build_forward(config.forward_candidate(m, n_b, BF16, SMS), m, n, SMS)
                assert b.tile_n + b.tail_n >= n or b.strategy == "chunked"
                assert f.tile_n + f.tail_n >= n or not f.single_tile


# --- the fused add's forward: its own entry, then the plain forward's, then the heuristics ---


def launched(host, m, n, add, dtype=BF16):
    """(kernel name, constants, hints) of the forward the host launches (``add``: the kernels' ADD)."""
    launch = host.forward.cached_launch(0, m, n, dtype, None, "llama", True, True, add)
    gather = launch.kernel is host.common.kernels().rms_norm_fwd_gather
    return ("rms_norm_fwd_gather" if gather else "rms_norm_fwd_persistent"), launch.constants, launch.hints


def expected_launch(cand, m, n, add):
    """The same triple built by hand from a candidate (the kernels' constant order, see cutile/kernels/)."""
    cfg = config.build_forward(cand, config.m_bucket(m), n, SMS)
    hints = tuple(
        sorted((k, v) for k, v in (("occupancy", cand.occupancy), ("num_worker_warps", cand.num_worker_warps)) if v)
    )
    if cand.kernel == "gather":
        return "rms_norm_fwd_gather", (cand.tile_n, 0, True, cfg.single_tile, True, add), hints
    walk = cand.kernel == "persistent"
    return (
        "rms_norm_fwd_persistent",
        (cand.tile_m, cand.tile_n, cand.tail_n, 0, True, add, n == cand.tile_n, walk),
        hints,
    )


def test_fused_forward_takes_its_entry_then_the_forward_entry_then_the_heuristics(host):
    m, n = 4096, 4100  # bucket 4224
    fused = config.ForwardCandidate("gather", 1, 8192, 0, 0, 16, 4)  # neither the heuristics' nor the forward's
    plain = config.ForwardCandidate("persistent", 2, 8192, 0, 3, 4, 8)
    doc = one_entry("forward", "bf16", 4224, plain)
    build.set_runs(doc, "fused_forward", "bf16", 4224, [{"m": 1, "winner": asdict(fused), "gbps": {}}])
    pre, post = host.forward.ADD_MODES["pre"], host.forward.ADD_MODES["post"]
    with tuning.use_table(doc):
        # plain first, then fused, from one cache: the two configs must not be confused
        assert launched(host, m, n, host.forward.ADD_NONE) == expected_launch(plain, m, n, 0)
        assert launched(host, m, n, pre) == expected_launch(fused, m, n, pre)
        assert launched(host, m, n, post) == expected_launch(fused, m, n, post)
        assert launched(host, m, n, host.forward.ADD_NONE) == expected_launch(plain, m, n, 0)
        assert host.forward.cached_config(0, m, n, BF16, None).kernel == "persistent"
        # a forced kernel other than the fused winner's: the forward entry's, which is of that kernel
        cfg = host.forward.cached_config(0, m, n, BF16, "persistent", "fused_forward")
        assert (cfg.kernel, cfg.tile_m, cfg.grid) == ("persistent", 2, 3 * SMS)
    with tuning.use_table(one_entry("forward", "bf16", 4224, plain)):  # no fused entry: the forward's
        assert launched(host, m, n, pre) == expected_launch(plain, m, n, pre)
    with tuning.use_table(one_entry("backward", "bf16", 4224, config.backward_candidate(m, 4224, BF16, SMS))):
        analytic = config.forward_candidate(config.m_bucket(m), n, BF16, SMS)  # neither: the heuristics
        assert launched(host, m, n, pre) == expected_launch(analytic, m, n, pre)
        assert analytic not in (plain, fused)


def test_a_16_bit_fused_forward_takes_the_other_16_bit_dtypes_fused_entry(host):
    """fp16's fused forward with no entry of its own takes bf16's fused entry (the same bytes per element), ahead
    of fp16's forward entry; fp32 takes its forward entry; with an fp16 fused entry of its own it borrows nothing,
    not even for a kernel its own entry lacks. The host launches what the lookup gives, and an overlay measures a
    sweep against it."""
    m, n = 4096, 4100  # bucket 4224
    fused = config.ForwardCandidate("gather", 1, 8192, 0, 0, 16, 4)
    plain = config.ForwardCandidate("persistent", 2, 8192, 0, 3, 4, 8)
    own = config.ForwardCandidate("gather", 1, 8192, 0, 0, 8, 0)
    doc = one_entry("fused_forward", "bf16", 4224, fused)
    for dt in ("fp16", "fp32"):
        build.set_runs(doc, "forward", dt, 4224, [{"m": 1, "winner": asdict(plain), "gbps": {}}])
    table = tuning.load(doc)
    assert list(table.winners("fused_forward", m, n, torch.float16)) == [fused, plain]
    assert list(table.winners("fused_forward", m, n, torch.float32)) == [plain]
    assert list(table.winners("forward", m, n, torch.float16)) == [plain]
    assert list(table.winners("fused_forward", m, n, torch.float64)) == []  # no table holds fp64
    with tuning.use_table(doc):
        cfg = host.forward.cached_config(0, m, n, torch.float16, None, "fused_forward")
        assert (cfg.kernel, dict(cfg.hints).get("occupancy")) == ("gather", 16)
        assert host.forward.cached_config(0, m, n, torch.float32, None, "fused_forward").kernel == "persistent"
    own = config.ForwardCandidate("tiles", 1, 8192, 0, 0, 8, 0)
    build.set_runs(doc, "fused_forward", "fp16", 4224, [{"m": 1, "winner": asdict(own), "gbps": {}}])
    assert list(tuning.load(doc).winners("fused_forward", m, n, torch.float16)) == [own, plain]
    with tuning.use_table(doc):  # a forced gather: the forward entry's kernel does not match, the heuristics'
        cfg = host.forward.cached_config(0, m, n, torch.float16, "gather", "fused_forward")
        assert dict(cfg.hints).get("occupancy") != 16  # not bf16's fused gather


def test_an_invalid_fused_forward_entry_says_what_is_wrong():
    doc = one_entry("fused_forward", "bf16", 4224, config.ForwardCandidate("persistent", 2, 8192, 0, 2, 2, 0))
    tuning.Table(doc)
    doc["fused_forward"]["bf16"]["4224"][0]["winner"]["kernel"] = "direct"
    with pytest.raises(tuning.TuningTableError, match=r"t.json: fused_forward/bf16/4224/m=1: kernel must be one of"):
        tuning.Table(doc, "t.json")


# --- qk: an entry per head dim bucket and rows bucket of q and k together ---

QK_ODD = config.QKCandidate(512, 8, 3, 1, 0, 4)  # no heuristic picks these


def test_the_hosts_qk_config_follows_the_qk_entry_and_is_the_heuristics_without_one(host):
    m_q, m_k, d = 16 * 1024, 4 * 1024, 64  # 20480 rows: bucket 32768
    doc = one_entry("qk", "bf16", 64, QK_ODD, m=32768)
    analytic = config.qk_config((1, 1, m_q), (1, 1, m_k), d, BF16, SMS)
    shipped = tuning.packaged("sm90_132sm").lookup("qk", 32768, 64, BF16)
    if shipped is not None:  # the shipped table's measured entry is what the host launches
        c = host.qk.cached_config(0, (1, 1, m_q), (1, 1, m_k), d, BF16)
        assert (c.fwd_tile_m, c.bwd_tile_m) == (shipped.fwd_tile_m, shipped.bwd_tile_m)
    with tuning.use_table(doc):
        c = host.qk.cached_config(0, (1, 1, m_q), (1, 1, m_k), d, BF16)
        assert (c.fwd_head, c.fwd_tile_m, c.bwd_tile_m) == ((64, 0), 512, 8)
        assert (c.fwd_grid, c.bwd_grid) == (32 + 8, SMS)  # 3 blocks per SM, capped by the row tiles of 512
        assert (c.fwd_hints, c.bwd_hints) == ((), (("occupancy", 4),))
        assert host.qk.cached_config(0, (1, 1, m_q), (1, 1, m_k), 128, BF16) == config.qk_config(
            (1, 1, m_q), (1, 1, m_k), 128, BF16, SMS
        )  # other D
        assert host.qk.cached_config(0, (1, 1, m_q), (1, 1, m_k), d, torch.float16) == config.qk_config(
            (1, 1, m_q), (1, 1, m_k), d, BF16, SMS
        )
        # below the entry's first run the floor rule gives the first run; a D of the same bucket shares it
        assert host.qk.cached_config(0, (1, 1, 64), (1, 1, 16), 33, BF16).fwd_tile_m == 512
    with tuning.use_table(None):
        assert host.qk.cached_config(0, (1, 1, m_q), (1, 1, m_k), d, BF16) == analytic


def test_a_qk_entry_of_one_forward_tile_per_block(host):
    """fwd_blocks_per_sm 0: the forward's grid is every tile of q and k, its WALK constant off, eight warps
    (qk_fwd_tiles_worker_warps); the backward as the entry says."""
    m_q, m_k, d = 16 * 1024 + 5, 4 * 1024 + 1, 128
    entry = config.QKCandidate(32, 64, 0, 2, 8, 2)
    with tuning.use_table(one_entry("qk", "bf16", 128, entry, m=16384)):
        c = host.qk.cached_config(0, (1, 1, m_q), (1, 1, m_k), d, BF16)
        assert c.fwd_grid == config.cdiv(m_q, 32) + config.cdiv(m_k, 32) and not c.fwd_walk
        assert dict(c.fwd_hints) == {"occupancy": 8, "num_worker_warps": config.HEURISTICS.qk_fwd_tiles_worker_warps}
        assert c.bwd_grid == 2 * SMS
        launch = host.qk.forward_launch(host.common.target(0), (1, 1, m_q), (1, 1, m_k), d, BF16, "llama", True, True)
        assert launch.grid == (c.fwd_grid,) and launch.constants[-1] is False
    walked = host.qk.forward_launch(host.common.target(0), (1, 1, m_q), (1, 1, m_k), d, BF16, "llama", True, True)
    assert walked.constants[-1] is True


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fwd_tile_m": 48}, "fwd_tile_m 48 must be a power of two"),
        ({"bwd_tile_m": 1024}, "bwd_tile_m 1024 must be a power of two with bwd_tile_m x 64 columns <= 32768"),
        ({"fwd_blocks_per_sm": -1}, "fwd_blocks_per_sm -1 must be >= 0"),
        ({"bwd_blocks_per_sm": 0}, "bwd_blocks_per_sm 0 must be >= 1"),
        ({"bwd_occupancy": -1}, "bwd_occupancy -1 >= 0"),
        ({"fwd_tile_m": "32"}, "must be integers"),
    ],
)
def test_an_invalid_qk_entry_says_what_is_wrong(change, message):
    doc = one_entry("qk", "bf16", 64, QK_ODD)
    tuning.Table(doc)
    doc["qk"]["bf16"]["64"][0]["winner"].update(change)
    with pytest.raises(tuning.TuningTableError, match=r"t\.json: .*qk/bf16/64.*" + message.replace("(", r"\(")):
        tuning.Table(doc, "t.json")
    wide = one_entry("qk", "bf16", 2048, config.QKCandidate(8, 8, 1, 1, 0, 0))
    with pytest.raises(tuning.TuningTableError, match="no qk kernel takes head dims above 1024"):
        tuning.Table(wide)
    missing = one_entry("qk", "bf16", 64, QK_ODD)
    del missing["qk"]["bf16"]["64"][0]["winner"]["bwd_occupancy"]
    with pytest.raises(tuning.TuningTableError, match="a qk winner has exactly the fields"):
        tuning.Table(missing)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"fwd_tile_elems": 8192}, "'fwd_tile_elems' is not a setting a table may set"),
        ({"fp8_no_such_setting": 1}, "'fp8_no_such_setting' is not a setting a table may set"),
        ({"fp8_tile_elems": 8192.0}, "heuristics/fp8_tile_elems: a int like its default"),
        ({"fp8_add_gather": 1}, "heuristics/fp8_add_gather: a bool like its default"),
        ({"gated_occupancy": True}, "heuristics/gated_occupancy: a int like its default"),
        ([("fp8_tile_elems", 8192)], "'heuristics' maps settings of config.Heuristics to values"),
    ],
)
def test_a_tables_settings_are_checked_on_load(settings, message):
    """A table's ``heuristics`` name FP8 and gated settings of config.Heuristics, each with its default's type; a
    table naming anything else does not load, and says which setting is wrong."""
    doc = {**shipped()["sm90_132sm"], "heuristics": settings}
    with pytest.raises(tuning.TuningTableError, match=message):
        tuning.Table(doc)


def test_a_tables_settings_survive_slim_and_write(tmp_path):
    """The writer keeps a table's settings: the shipped form of a sweep's table and the file it writes."""
    from tilegym_rms.cutile.tuning import build

    doc = {**shipped()["sm90_132sm"], "heuristics": {"fp8_tile_elems": 8192, "gated_worker_warps": 0}}
    path = tmp_path / "table.json"
    build.write(build.slim(doc), path)
    assert tuning.load(path).heuristics == {"fp8_tile_elems": 8192, "gated_worker_warps": 0}
