"""The sweep and the overlay (bench/tools/tune_table.py, tilegym_rms.cutile.tuning.build): candidates, timing
runs on fake timings, winners, merging and laying sweeps over a table, all on the CPU. The product's lookup of
the tables it ships is tested in test_tuning.py."""

import json
from dataclasses import asdict, replace

import pytest
import torch
from test_tuning import BF16, H100, QK_ODD, REPO, SMS, one_entry, shipped, sweep_evidence

from tilegym_rms.cutile import config, tuning
from tilegym_rms.cutile.tuning import build


def test_overlay_keeps_the_heuristics_switches_and_applies_measured_winners():
    """A sweep at M buckets 4096 and 32768 (different winners) laid over the analytic table: below 4096 and
    wherever the heuristics change their choice between measured buckets the analytic choice stays;
    elsewhere the measured winner holds, including above the last measured bucket."""
    sms, n, dtype = 132, 4096, torch.bfloat16
    base = build.analytic_doc("sm90_132sm", "test", (9, 0), sms, "test")
    sweep = build.new_doc("sm90_132sm", "test", (9, 0), sms, "measured", "sweep")
    fancy = {m: asdict(config.forward_candidate(m, n, dtype, sms, "persistent")) for m in (4096, 32768)}
    fancy = {m: {**c, "blocks_per_sm": c["blocks_per_sm"] * (2 if m == 4096 else 4)} for m, c in fancy.items()}
    build.set_runs(sweep, "forward", "bf16", n, [{"m": m, "winner": c, "gbps": {"x": 1.0}} for m, c in fancy.items()])
    table = tuning.load(build.overlay(base, sweep))
    analytic = {m: asdict(config.forward_candidate(m, n, dtype, sms)) for m in tuning.M_BUCKETS}
    for m in tuning.M_BUCKETS:
        got = asdict(table.lookup("forward", m, n, dtype))
        ref = max([b for b in (4096, 32768) if b <= m], default=None)
        if ref is None or analytic[m] != analytic[ref]:
            assert got == analytic[m], m
        else:
            assert got == fancy[ref], m
    # the heuristics switch to the gather kernel at 16384 rows here, so 16384 must stay analytic
    assert analytic[16384] != analytic[4096] and asdict(table.lookup("forward", 16384, n, dtype)) == analytic[16384]
    assert asdict(table.lookup("forward", 1 << 22, n, dtype)) == fancy[32768]
    assert table.lookup("forward", 4096, 1024, dtype) == config.forward_candidate(4096, 1024, dtype, sms)


def test_overlay_keeps_a_winner_two_measured_buckets_agree_on():
    """The same winner measured at 4096 and 32768 rows holds between them, where the heuristics would switch
    to the gather kernel (at 16384): the sweep timed that kernel at 32768 too and it lost. Below the first
    measured bucket the analytic choice stays."""
    sms, n, dtype = 132, 4096, torch.bfloat16
    base = build.analytic_doc("sm90_132sm", "test", (9, 0), sms, "test")
    sweep = build.new_doc("sm90_132sm", "test", (9, 0), sms, "measured", "sweep")
    winner = asdict(config.forward_candidate(4096, n, dtype, sms, "persistent"))
    winner = {**winner, "blocks_per_sm": winner["blocks_per_sm"] * 2}
    build.set_runs(sweep, "forward", "bf16", n, [{"m": m, "winner": winner, "gbps": {"x": 1.0}} for m in (4096, 32768)])
    table = tuning.load(build.overlay(base, sweep))
    assert config.forward_candidate(16384, n, dtype, sms).kernel == "gather"
    for m in tuning.M_BUCKETS:
        got = asdict(table.lookup("forward", m, n, dtype))
        assert got == (winner if m >= 4096 else asdict(config.forward_candidate(m, n, dtype, sms))), m


def test_overlay_keeps_the_bases_measurements_nearer_than_the_sweeps():
    """The base measured M bucket 2**20, the sweep 2**15: the sweep's winner holds from 2**15 up to 2**19
    (the base chose the same there as at 2**15), the base's measured run from 2**20 on, timings and all.
    (A sweep winner at 2**15 that replaced a 2**20 measurement slowed 2**21 rows by 8%: PERFORMANCE.md, "Tuning
    tables".)"""
    sms, n, dtype = 132, 96, torch.float16  # 96: the heuristics keep the persistent kernel up to 2**20 rows
    base = build.analytic_doc("sm90_132sm", "test", (9, 0), sms, "test")
    analytic = asdict(config.forward_candidate(1 << 15, n, dtype, sms, "persistent"))
    measured_far = {**analytic, "blocks_per_sm": 128}
    base_runs = [r for r in base["forward"]["fp16"][str(n)] if r["m"] < 1 << 20]
    base_far = {"m": 1 << 20, "winner": measured_far, "gbps": {"far": 2.0}}
    build.set_runs(base, "forward", "fp16", n, [*base_runs, base_far])
    swept = {**analytic, "tile_m": analytic["tile_m"] * 2}
    sweep = build.new_doc("sm90_132sm", "test", (9, 0), sms, "measured", "sweep")
    build.set_runs(sweep, "forward", "fp16", n, [{"m": 1 << 15, "winner": swept, "gbps": {"near": 1.0}}])
    out = build.overlay(base, sweep)
    table = tuning.load(out)
    before = tuning.load(base)
    for m in tuning.M_BUCKETS:
        got = asdict(table.lookup("forward", m, n, dtype))
        if m < 1 << 15:
            assert got == asdict(before.lookup("forward", m, n, dtype)), m
        elif m < 1 << 20:
            assert got == swept, m
        else:
            assert got == measured_far, m
    assert base_far in out["forward"]["fp16"][str(n)]


def test_candidates_start_with_the_heuristics_and_are_valid():
    for op in ("forward", "backward", "fused_forward"):
        for n_b in (64, 1024, 4224, 5120, 12288, 40960):
            for m_b in (1, 4096, 65536):
                cands = build.candidates(op, m_b, n_b, BF16, SMS)
                analytic = (config.forward_candidate if op in tuning.FORWARD_OPS else config.backward_candidate)(
                    m_b, n_b, BF16, SMS
                )
                assert cands[0] == analytic and len(set(cands)) == len(cands) and 2 <= len(cands) <= 6
                assert all(tuning.candidate_error(op, c, n_b) is None for c in cands)
    kinds = {c.kernel for c in build.candidates("forward", 4096, 4096, BF16, SMS)}
    assert kinds == {"gather", "persistent", "tiles"}
    strategies = {c.strategy for c in build.candidates("backward", 8, 1024, BF16, SMS)}
    assert strategies == {"direct", "persistent"}


@pytest.mark.parametrize("kernel", ["persistent", "tiles"])
def test_the_wide_set_splits_padded_rows_into_a_tile_and_a_tail(kernel):
    """A padded row (640 = 512 + 128) gets tile-plus-tail candidates of both walking and one-tile-per-block
    kernels in the wide set, valid for the bucket and covering it exactly; a power-of-two row (1024) none."""
    padded = build.candidates("forward", 65536, 640, BF16, SMS, wide=True)
    split = [c for c in padded if c.kernel == kernel and c.tail_n]
    assert split and all((c.tile_n, c.tail_n) == (512, 128) for c in split)
    assert all(tuning.candidate_error("forward", c, 640) is None for c in split)
    if kernel == "tiles":  # one tile per block: no walk, and the winners' taller tiles at half the hint
        tiles = config.forward_candidate(65536, 640, BF16, SMS, "tiles")
        assert {c.blocks_per_sm for c in split} == {0}
        assert replace(tiles, tile_n=512, tail_n=128, tile_m=tiles.tile_m * 4, occupancy=tiles.occupancy // 2) in split
    assert not [c for c in build.candidates("forward", 65536, 1024, BF16, SMS, wide=True) if c.tail_n]


def test_select_winner_keeps_the_analytic_choice_within_the_noise():
    assert build.select_winner({"a": 100.0, "b": 100.5}, "a") == "a"
    assert build.select_winner({"a": 100.0, "b": 102.0}, "a") == "b"
    assert build.select_winner({"a": 100.0, "b": 102.0}, "a", min_gain=0.05) == "a"
    assert build.select_winner({"b": 90.0, "c": 95.0}, "a") == "c"  # the analytic one failed to run
    with pytest.raises(ValueError):
        build.select_winner({}, "a")


def test_merge_and_write(tmp_path):
    analytic = build.analytic_doc("sm90_132sm", "x", (9, 0), SMS, "test")
    cand = config.ForwardCandidate("persistent", 8, 2048, 0, 4, 2, 0)
    sweep1 = build.new_doc("sm90_132sm", "x", (9, 0), SMS, "measured", "sweep 1")
    build.set_runs(sweep1, "forward", "bf16", 2048, [{"m": 1, "winner": asdict(cand), "gbps": {"l": 1.0}}])
    merged = build.merge(analytic, sweep1)
    assert merged["source"] == "mixed" and merged["generated_by"] == "sweep 1"
    assert merged["forward"]["bf16"]["2048"] == sweep1["forward"]["bf16"]["2048"]  # measured replaces analytic
    assert merged["forward"]["bf16"]["4096"] == analytic["forward"]["bf16"]["4096"]
    sweep2 = build.new_doc("sm90_132sm", "x", (9, 0), SMS, "measured", "sweep 2")
    later = [{"m": 1, "winner": asdict(cand), "gbps": {"l": 2.0}}, {"m": 64, "winner": asdict(cand), "gbps": {}}]
    build.set_runs(sweep2, "forward", "bf16", 2048, later)
    runs = build.merge(merged, sweep2)["forward"]["bf16"]["2048"]
    assert [(r["m"], r["gbps"]) for r in runs] == [(1, {"l": 2.0}), (64, {})]  # by M, the newer wins
    with pytest.raises(tuning.TuningTableError, match="cannot merge"):
        build.merge(analytic, build.new_doc("sm100_148sm", "y", (10, 0), 148, "measured", ""))
    path = tmp_path / "t.json"
    build.write(merged, path)
    assert json.loads(path.read_text()) == merged and tuning.load(path).lookup("forward", 1, 2000, BF16) == cand
    bad = json.loads(json.dumps(merged))
    bad["forward"]["bf16"]["2048"][0]["winner"]["tile_n"] = 1024
    with pytest.raises(tuning.TuningTableError):
        build.write(bad, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_a_sweep_on_another_card_of_the_same_key_is_refused(tune_table, tmp_path):
    """An H200 has an H100 SXM's key (sm90, 132 SMs): its sweep must not be merged or overlaid into the H100's
    shipped table (PERFORMANCE.md, "Tuning tables"). The tool refuses it; the same card's sweep still lands."""
    cand = config.ForwardCandidate("persistent", 8, 2048, 0, 4, 2, 0)
    shipped_doc = shipped()["sm90_132sm"]
    sweeps = {}
    for card in ("NVIDIA H200", shipped_doc["device"]["name"]):
        sweep = build.new_doc("sm90_132sm", card, (9, 0), SMS, "measured", "sweep")
        build.set_runs(sweep, "forward", "bf16", 2048, [{"m": 8192, "winner": asdict(cand), "gbps": {"l": 1.0}}])
        sweeps[card] = tmp_path / f"{len(sweeps)}.json"
        build.write(sweep, sweeps[card])
    base = REPO / "tilegym_rms" / "cutile" / "tuning" / "sm90_132sm.json"
    out = tmp_path / "table.json"
    with pytest.raises(tuning.TuningTableError, match="measured on 'NVIDIA H200'"):
        tune_table.main(["--overlay", str(sweeps["NVIDIA H200"]), "--base", str(base), "--out", str(out)])
    assert not out.exists()
    assert (
        tune_table.main(
            ["--overlay", str(sweeps[shipped_doc["device"]["name"]]), "--base", str(base), "--out", str(out)]
        )
        == 0
    )
    assert tuning.load(out).lookup("forward", 8192, 2048, BF16) == cand


def test_a_cards_first_table_starts_from_its_classs(tune_table, tmp_path):
    """An H200's sweep (its own key, sm90_132sm.nvidia-h200) laid over the class's table: a bucket it measured
    takes its winner where that beats the class's, and every bucket it did not measure keeps the class's
    winner, which the card ran before its table shipped, not the heuristics'. The file names the card, and the
    card the inherited winners were measured on, without that card's timings."""
    base = REPO / "tilegym_rms/cutile/tuning/sm90_132sm.json"
    class_table = tuning.load(base)
    n, m = 4096, 32768
    incumbent = class_table.lookup("backward", m, n, BF16)
    challenger = config.BackwardCandidate("persistent", 4, 4096, 0, 1, 1, 8)
    assert challenger != incumbent
    h200 = {"key": "sm90_132sm.nvidia-h200", "name": "NVIDIA H200", "capability": [9, 0], "sms": SMS}
    sweep = build.new_doc(h200["key"], h200["name"], (9, 0), SMS, "measured", "h200 sweep")
    gbps = {build.label("backward", incumbent): 3000.0, build.label("backward", challenger): 3300.0}
    build.set_runs(sweep, "backward", "bf16", n, [{"m": m, "winner": asdict(challenger), "gbps": gbps}])
    sweep_path, out = tmp_path / "h200.json", tmp_path / "sm90_132sm.nvidia-h200.json"
    build.write(sweep, sweep_path)
    assert tune_table.main(["--overlay", str(sweep_path), "--base", str(base), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == h200 and doc["based_on"]["name"] == H100
    table = tuning.load(doc)
    assert table.lookup("backward", m, n, BF16) == challenger
    assert table.lookup("backward", m // 2, n, BF16) == class_table.lookup("backward", m // 2, n, BF16)
    analytic = tuning.load(build.analytic_doc("sm90_132sm", "test", (9, 0), SMS, "test"))
    points = [(op, dt, nb, mb) for op in ("forward", "backward") for dt in (BF16, torch.float32)
              for nb in (896, 2304, 6144) for mb in (1, 8192, 32768)]  # fmt: skip
    for op, dt, nb, mb in points:
        assert table.lookup(op, mb, nb, dt) == class_table.lookup(op, mb, nb, dt), (op, dt, nb, mb)
    # the check has teeth: at these points the class's measured winners are not all the heuristics'
    assert any(class_table.lookup(op, mb, nb, dt) != analytic.lookup(op, mb, nb, dt) for op, dt, nb, mb in points)
    assert all("gbps" not in r for r in doc["forward"]["bf16"]["2304"])
    with pytest.raises(tuning.TuningTableError, match="not the key of a card of class"):
        build.card_start(class_table.doc, {**h200, "key": "sm100_148sm.nvidia-b200"})


def test_a_sweep_times_the_launch_the_host_borrows(tune_table):
    """The incumbent a sweep times beside its candidates is what the host launches: for an fp16 fused forward
    without an entry of its own, bf16's fused winner, not fp16's plain forward entry."""
    n, m = 4096, 4096
    fused = config.ForwardCandidate("gather", 1, 4096, 0, 0, 16, 8)
    plain = config.ForwardCandidate("persistent", 4, 4096, 0, 2, 2, 0)
    doc = one_entry("fused_forward", "bf16", n, fused)
    build.set_runs(doc, "forward", "fp16", n, [{"m": 1, "winner": asdict(plain), "gbps": {}}])
    table = tuning.load(doc)
    assert tune_table.host_incumbent(table, "fused_forward", m, n, torch.float16) == fused
    assert tune_table.host_incumbent(table, "forward", m, n, torch.float16) == plain
    assert tune_table.host_incumbent(None, "fused_forward", m, n, torch.float16) is None


def test_an_overlay_measures_each_16_bit_dtype_against_the_table_before_it():
    """A sweep with fused entries of both 16-bit dtypes over a table with neither: each dtype's incumbent is what
    its host ran before (the plain forward's entry), not the other dtype's winner of the same sweep, so the
    result does not depend on the order the sweep lists them in."""
    n, m = 4096, 4096
    plain = config.ForwardCandidate("persistent", 4, 4096, 0, 2, 2, 0)
    near = {o: config.ForwardCandidate("gather", 1, 4096, 0, 0, o, 8) for o in (8, 16)}
    base = build.new_doc("sm90_132sm", "test", (9, 0), SMS, "measured", "base")
    for dt in ("bf16", "fp16"):
        build.set_runs(base, "forward", dt, n, [{"m": 1, "winner": asdict(plain), "gbps": {}}])
    gbps = {
        build.label("forward", plain): 1.0,
        build.label("forward", near[8]): 2.0,
        build.label("forward", near[16]): 2.01,
    }
    wins = {"bf16": near[16], "fp16": near[8]}  # fp16's best is within --min-gain of bf16's
    gbps_of = {"bf16": gbps, "fp16": {**gbps, build.label("forward", near[8]): 2.02}}
    got = []
    for order in (("bf16", "fp16"), ("fp16", "bf16")):
        sweep = build.new_doc("sm90_132sm", "test", (9, 0), SMS, "measured", "sweep")
        for dt in order:
            run = {"m": m, "winner": asdict(wins[dt]), "gbps": gbps_of[dt]}
            build.set_runs(sweep, "fused_forward", dt, n, [run])
        table = tuning.load(build.overlay(base, sweep, min_gain=0.02))
        got.append({dt: table.lookup("fused_forward", m, n, tuning.DTYPES[dt]) for dt in ("bf16", "fp16")})
    assert got[0] == got[1] == wins


def test_the_analytic_table_writes_no_fused_forward_entry():
    doc = build.analytic_doc("sm90_132sm", "x", (9, 0), SMS, "test")
    assert "fused_forward" in tuning.OPS and not doc["fused_forward"]
    assert tuning.load(doc).lookup("fused_forward", 4096, 4096, BF16) is None
    assert '"fused_forward"' in build.dumps(doc)  # empty but present: the sweep fills it


def test_overlay_of_a_fused_sweep_follows_the_forward_entry_elsewhere():
    """A fused sweep at 4096 and 32768 rows laid over a table with a measured forward entry: below 4096 and
    where the forward's choice changes, the fused entry repeats the forward's (what the fallback gave); the
    forward entry is untouched."""
    n = 4096
    base = build.analytic_doc("sm90_132sm", "test", (9, 0), SMS, "test")
    fwd_sweep = build.new_doc("sm90_132sm", "test", (9, 0), SMS, "measured", "sweep 1")
    measured_fwd = {**asdict(config.forward_candidate(4096, n, BF16, SMS)), "occupancy": 4}
    build.set_runs(fwd_sweep, "forward", "bf16", n, [{"m": 4096, "winner": measured_fwd, "gbps": {"a": 1.0}}])
    shipped_like = build.overlay(base, fwd_sweep)
    sweep = build.new_doc("sm90_132sm", "test", (9, 0), SMS, "measured", "sweep 2")
    fused = {m: asdict(config.forward_candidate(m, n, BF16, SMS, "persistent")) for m in (4096, 32768)}
    fused = {m: {**c, "tile_m": 8 if m == 4096 else 16} for m, c in fused.items()}  # two winners: no agreement
    build.set_runs(
        sweep, "fused_forward", "bf16", n, [{"m": m, "winner": c, "gbps": {"b": 1.0}} for m, c in fused.items()]
    )
    out = build.overlay(shipped_like, sweep)
    assert out["forward"] == shipped_like["forward"] and out["backward"] == base["backward"]
    table, before = tuning.load(out), tuning.load(shipped_like)
    for m in tuning.M_BUCKETS:
        got = asdict(table.lookup("fused_forward", m, n, BF16))
        fwd_here = asdict(before.lookup("forward", m, n, BF16))
        ref = max([b for b in fused if b <= m], default=None)
        if ref is None or fwd_here != asdict(before.lookup("forward", ref, n, BF16)):
            assert got == fwd_here, m
        else:
            assert got == fused[ref], m
    assert asdict(table.lookup("fused_forward", 4096, n, BF16)) == fused[4096]
    assert asdict(table.lookup("forward", 4096, n, BF16)) == measured_fwd
    assert asdict(table.lookup("fused_forward", 16384, n, BF16))["kernel"] == "gather"  # the forward's switch


def test_qk_candidates_vary_each_half_around_the_heuristics():
    for d, m_b in ((64, 4096), (128, 32768), (256, 1 << 20), (1024, 1 << 22)):
        base = config.qk_candidate(m_b, d, BF16, SMS)
        cands = build.candidates("qk", m_b, d, BF16, SMS)
        assert cands[0] == base and len(set(cands)) == len(cands) == 11
        assert all(tuning.candidate_error("qk", c, d) is None for c in cands)
        for side, other in (("fwd", "bwd"), ("bwd", "fwd")):
            t, b = getattr(base, f"{side}_tile_m"), getattr(base, f"{side}_blocks_per_sm")
            varied = {(getattr(c, f"{side}_tile_m"), getattr(c, f"{side}_blocks_per_sm")) for c in cands}
            assert varied == {(tm, bb) for tm in (t // 2, t, 2 * t) for bb in (b, 2 * b)}
            # a candidate varies one half only: the other keeps the heuristics' choice
            assert all(
                getattr(c, f"{other}_tile_m") == getattr(base, f"{other}_tile_m")
                for c in cands
                if getattr(c, f"{side}_tile_m") != t
            )
    assert build.label("qk", QK_ODD) == "fwd 512r b3 o0 | bwd 8r b1 o4"


def test_overlay_of_a_qk_sweep_keeps_the_heuristics_where_they_change():
    base = build.analytic_doc("sm90_132sm", "test", (9, 0), SMS, "test")
    assert not base["qk"]  # absence means the heuristics
    sweep = build.new_doc("sm90_132sm", "test", (9, 0), SMS, "measured", "sweep")
    odd = {4096: QK_ODD, 1 << 20: replace(QK_ODD, bwd_occupancy=2)}  # two winners: no agreement between them
    runs = [{"m": m, "winner": asdict(c), "gbps": {"fwd 1r b1 o0": 1.0}} for m, c in odd.items()]
    build.set_runs(sweep, "qk", "bf16", 64, runs)
    table = tuning.load(build.overlay(base, sweep))
    for m in tuning.M_BUCKETS:
        got, analytic = table.lookup("qk", m, 64, BF16), config.qk_candidate(m, 64, BF16, SMS)
        ref = max([r for r in odd if r <= m], default=None)
        stays = ref is not None and analytic == config.qk_candidate(ref, 64, BF16, SMS)
        assert got == (odd[ref] if stays else analytic), m
    assert table.lookup("qk", 8192, 64, BF16) != QK_ODD  # the heuristics' tile grows with the rows there
    assert table.lookup("qk", 1 << 22, 64, BF16) == odd[1 << 20]


# --- the sweep script (bench/tools/tune_table.py): its arguments, runs on fake timings, its overlays ---


@pytest.fixture
def tune_table(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench.tools import tune_table

    return tune_table


def test_the_sweep_estimates_the_new_ops_points_and_timings(tune_table):
    args = tune_table.build_parser().parse_args(
        ["--ops", "forward,fused_forward,qk", "--dtypes", "bf16", "--quick", "--m", "1,4096,32768"]
    )
    ops, points = tune_table.sweep_args(args)
    assert points["fused_forward"] == points["forward"]  # the same buckets, the plain forward's candidates
    qk_ms = (4096, 32768)  # a single row is no q and k of 16 and 4 heads
    assert points["qk"] == [("bf16", d, m) for d in tune_table.QK_N for m in qk_ms]
    assert build.qk_sweep_tokens(4096) * 20 in range(2049, 4097) and build.qk_sweep_tokens(16) == 0
    got = {op: tune_table.estimate([op], points, SMS) for op in ops}
    assert got["fused_forward"]["timings"] == got["forward"]["timings"]
    assert got["fused_forward"]["points"] == got["forward"]["points"]
    assert got["qk"]["points"] == len(tune_table.QK_N) * len(qk_ms)
    assert got["qk"]["timings"] == 12 * got["qk"]["points"]  # 6 forward halves + 6 backward halves
    default = tune_table.sweep_args(tune_table.build_parser().parse_args([]))[0]
    assert default == ["forward", "backward"]
    # --span times the plain ops' points twice (each bucket from 8 rows has a span point), qk's once
    spanned = {op: tune_table.estimate([op], points, SMS, span=True) for op in ops}
    one_row = tune_table.estimate(["forward"], {"forward": [p for p in points["forward"] if p[2] == 1]}, SMS)
    assert spanned["forward"]["timings"] == 2 * got["forward"]["timings"] - one_row["timings"]
    assert spanned["qk"]["timings"] == got["qk"]["timings"]


def fake_sweep(monkeypatch, tune_table, n_b, time_us, errors=None):
    """tune_table.time_point without a GPU: each candidate's table installed records its label, timed as
    ``time_us(label, rows)`` µs; ``errors(label)`` (None: every candidate correct) its value check's errors."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    current = {}

    @contextmanager
    def use_table(doc):
        current["label"] = build.label(
            "forward", tuning.parse_winner("forward", doc["forward"]["bf16"][str(n_b)][0]["winner"], "t")
        )
        yield

    monkeypatch.setattr(tune_table.tuning, "use_table", use_table)
    monkeypatch.setattr(
        tune_table.torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=SMS)
    )
    monkeypatch.setattr(tune_table, "_inputs", lambda op, m, n, dtype, device: ([m], {"": (m * n * 4, op)}))
    monkeypatch.setattr(tune_table, "_call", lambda cutile, kind, w: None)
    monkeypatch.setattr(
        tune_table.tune_cutile, "_time_us", lambda timer, call, sets, reps: time_us(current["label"], sets[0])
    )
    monkeypatch.setattr(tune_table.torch, "randn", lambda *a, **k: None)
    check = errors or (lambda label: {"y": 1e-3, "rstd": 1e-6})
    monkeypatch.setattr(tune_table.candidate_check, "errors", lambda *a, **k: check(current["label"]))


@pytest.mark.parametrize("span", [False, True])
def test_a_point_is_timed_at_its_span_and_won_over_both(tune_table, monkeypatch, span):
    """time_point with fake timings (no GPU): every candidate and the table's incumbent timed at the bucket
    point, and with ``span`` at ``build.span_rows`` rows too, through the table of that candidate alone; the
    winner is the best at the point alone, or over both points with the span."""
    m_b, n_b = 8192, 5120
    cands = build.candidates("forward", m_b, n_b, BF16, SMS)
    labels = [build.label("forward", c) for c in cands]
    at_point, inside = labels[1], labels[2]  # the point's best; the best over the bucket's rows
    us = {(lab, m): 100.0 for lab in labels for m in (m_b, build.span_rows(m_b))}
    us[(at_point, m_b)], us[(at_point, build.span_rows(m_b))] = 90.0, 130.0
    us[(inside, m_b)], us[(inside, build.span_rows(m_b))] = 95.0, 92.0
    fake_sweep(monkeypatch, tune_table, n_b, lambda label, m: us.get((label, m), 100.0))
    incumbent = config.ForwardCandidate("persistent", 2, 8192, 0, 8, 0, 0)  # the table's, not a candidate
    assert build.label("forward", incumbent) not in labels
    labels.append(build.label("forward", incumbent))
    run = tune_table.time_point(
        None, None, "cpu", "sm90_132sm", "forward", BF16, n_b, m_b, 1, 0.01, span=span, incumbent=incumbent
    )
    assert set(run["gbps"]) == set(labels)  # the incumbent timed beside the candidates
    assert run["gbps"][at_point] > run["gbps"][inside]
    if span:
        assert run["span"]["m"] == build.span_rows(m_b) and set(run["span"]["gbps"]) == set(labels)
    else:
        assert "span" not in run
    assert build.label("forward", tuning.parse_winner("forward", run["winner"], "t")) == (inside if span else at_point)


def test_a_sweep_times_no_candidate_whose_values_are_wrong(tune_table, monkeypatch):
    """The fastest candidate computes wrong values (bench/tools/candidate_check.py): it is not timed, cannot
    win, and the run records its errors; without the check it would have won."""
    m_b, n_b = 8192, 5120
    labels = [build.label("forward", c) for c in build.candidates("forward", m_b, n_b, BF16, SMS)]
    fast_and_wrong, next_best = labels[1], labels[2]
    us = {fast_and_wrong: 80.0, next_best: 90.0}
    errors = {fast_and_wrong: {"y": 0.5, "rstd": 1e-6}}
    fake_sweep(monkeypatch, tune_table, n_b, lambda label, m: us.get(label, 100.0),
               lambda label: errors.get(label, {"y": 1e-3, "rstd": 1e-6}))  # fmt: skip
    point = (None, None, "cpu", "sm90_132sm", "forward", BF16, n_b, m_b, 1, 0.01)
    run = tune_table.time_point(*point)
    assert set(run["gbps"]) == set(labels) - {fast_and_wrong}
    assert run["failed"] == {fast_and_wrong: {"y": 0.5}}
    assert build.label("forward", tuning.parse_winner("forward", run["winner"], "t")) == next_best
    unchecked = tune_table.time_point(*point, check=False)
    assert "failed" not in unchecked
    assert build.label("forward", tuning.parse_winner("forward", unchecked["winner"], "t")) == fast_and_wrong


def test_the_qk_winner_takes_the_best_half_each_way_on_fake_timings(tune_table):
    cands = build.candidates("qk", 32768, 128, BF16, SMS)
    base = cands[0]
    gbps = {label: 100.0 for c in cands for label in tune_table.timed_parts("qk", [c])}
    fast_fwd = next(
        c for c in cands if c.fwd_tile_m == 2 * base.fwd_tile_m and c.fwd_blocks_per_sm == base.fwd_blocks_per_sm
    )
    fast_bwd = next(
        c for c in cands if c.bwd_tile_m == base.bwd_tile_m // 2 and c.bwd_blocks_per_sm == 2 * base.bwd_blocks_per_sm
    )
    gbps[build.qk_half_label(fast_fwd, "fwd")] = 110.0
    gbps[build.qk_half_label(fast_bwd, "bwd")] = 100.5  # within the 1% margin: the heuristics' half stays
    won = tune_table.qk_winner(cands, gbps, 0.01)
    assert (won.fwd_tile_m, won.fwd_blocks_per_sm) == (2 * base.fwd_tile_m, base.fwd_blocks_per_sm)
    assert (won.bwd_tile_m, won.bwd_blocks_per_sm) == (base.bwd_tile_m, base.bwd_blocks_per_sm)
    gbps[build.qk_half_label(fast_bwd, "bwd")] = 120.0
    won = tune_table.qk_winner(cands, gbps, 0.01)
    assert (won.bwd_tile_m, won.bwd_blocks_per_sm) == (base.bwd_tile_m // 2, 2 * base.bwd_blocks_per_sm)
    assert won not in cands  # a pair never timed together: the halves are independent launches
    tuning.Table(one_entry("qk", "bf16", 128, won, m=32768))  # a valid table entry


def test_a_backward_timed_after_the_forward_runs_the_devices_forward(tune_table):
    """``--after-forward``: each backward candidate is timed with the forward the device's table launches (the
    shipped table's entries, not the heuristics'), that forward's rstd feeding the backward, as in training."""
    shipped = tuning.packaged("sm90_132sm")
    cand = config.BackwardCandidate("persistent", 4, 2048, 256, 1, 1, 8)
    one = tuning.load(tune_table.candidate_table("sm90_132sm", SMS, "backward", BF16, 2304, cand, shipped.doc))
    plain = tuning.load(tune_table.candidate_table("sm90_132sm", SMS, "backward", BF16, 2304, cand))
    for m, n, dt in ((8192, 2304, BF16), (32768, 4096, BF16), (3000, 6144, torch.float32), (1 << 20, 128, BF16)):
        assert one.lookup("forward", m, n, dt) == shipped.lookup("forward", m, n, dt), (m, n)
        assert plain.lookup("forward", m, n, dt) is None  # timed alone, the forward never runs
    assert one.lookup("backward", 8192, 2304, BF16) == cand == plain.lookup("backward", 8192, 2304, BF16)

    calls = []

    class Host:  # the two host calls a training step makes, in order
        def forward(self, x, w, eps, offset, casting):
            calls.append(("forward", x))
            return "y", "rstd of the forward"

        def backward(self, x, dy, w, rstd, offset, casting):
            calls.append(("backward", x, dy, rstd))

    tune_table._call(Host(), tune_table.AFTER_FORWARD, "w")(("x", "dy", "stored rstd"))
    assert calls == [("forward", "x"), ("backward", "x", "dy", "rstd of the forward")]
    assert tune_table.build_parser().parse_args(["--after-forward"]).after_forward


def test_overlay_with_the_shipped_table_as_base_keeps_its_measured_entries(tune_table, tmp_path):
    """The sweep's table of the shipped one as --base and --out, the table to ship as --slim: the measured
    entries stay, the sweep lands, and --slim gets the winners of what --out holds."""
    evidence = sweep_evidence()["sm90_132sm"]
    shipped_doc = json.loads(evidence.read_text())
    base_path, slim_path = tmp_path / "sm90_132sm_candidates.json", tmp_path / "sm90_132sm.json"
    base_path.write_text(evidence.read_text())
    sweep = build.new_doc("sm90_132sm", shipped_doc["device"]["name"], (9, 0), SMS, "measured", "sweep 2")
    fused = asdict(config.forward_candidate(4096, 5120, BF16, SMS, "gather"))
    build.set_runs(sweep, "fused_forward", "bf16", 5120, [{"m": 4096, "winner": fused, "gbps": {"g": 1.0}}])
    build.set_runs(sweep, "qk", "bf16", 64, [{"m": 32768, "winner": asdict(QK_ODD), "gbps": {"fwd": 1.0}}])
    sweep_path = tmp_path / "sweep2.json"
    sweep_path.write_text(json.dumps(sweep))
    args = ["--overlay", str(sweep_path), "--base", str(base_path), "--out", str(base_path), "--slim", str(slim_path)]
    assert tune_table.main(args) == 0
    out = json.loads(base_path.read_text())
    assert json.loads(slim_path.read_text()) == build.slim(out)
    assert out["forward"] == shipped_doc["forward"] and out["backward"] == shipped_doc["backward"]
    table = tuning.load(out)
    assert asdict(table.lookup("fused_forward", 4096, 5120, BF16)) == fused
    assert table.lookup("qk", 32768, 64, BF16) == QK_ODD
    # a width this sweep did not measure keeps what the shipped table launched there
    before = tuning.load(shipped_doc)
    assert next(table.winners("fused_forward", 4096, 4096, BF16)) == next(
        before.winners("fused_forward", 4096, 4096, BF16)
    )
    # without --base the sweep lands on the analytic table: the shipped measured winners would be lost
    analytic_out = tmp_path / "analytic.json"
    assert tune_table.main(["--overlay", str(sweep_path), "--out", str(analytic_out)]) == 0
    assert json.loads(analytic_out.read_text())["forward"] != shipped_doc["forward"]


def test_overlay_leaves_out_the_sweep_entries_named(tune_table, tmp_path):
    """--leave-out OP/DTYPE/N: that entry of the sweep is not laid over (an A/B rejected it), the base's stays
    there, and the sweep's other entries land; OP/DTYPE leaves out every width of that dtype and no other dtype's;
    names may overlap; an entry the sweep lacks is refused before anything is written."""
    sweep = build.new_doc("sm90_132sm", "NVIDIA H100 80GB HBM3", (9, 0), SMS, "measured", "sweep")
    gather = {n: config.forward_candidate(4096, n, BF16, SMS, "gather") for n in (2048, 4096)}
    winners = {n: asdict(replace(cand, occupancy=16)) for n, cand in gather.items()}
    for n, winner in winners.items():
        build.set_runs(sweep, "forward", "bf16", n, [{"m": 4096, "winner": winner, "gbps": {"g": 1.0}}])
    fp16_winner = asdict(replace(config.forward_candidate(4096, 2048, torch.float16, SMS, "gather"), occupancy=16))
    build.set_runs(sweep, "forward", "fp16", 2048, [{"m": 4096, "winner": fp16_winner, "gbps": {"g": 1.0}}])
    sweep_path, out = tmp_path / "sweep.json", tmp_path / "out.json"
    sweep_path.write_text(json.dumps(sweep))
    assert tune_table.main(["--overlay", str(sweep_path), "--out", str(out), "--leave-out", "forward/bf16/4096"]) == 0
    table, analytic = tuning.load(json.loads(out.read_text())), config.forward_candidate(4096, 4096, BF16, SMS)
    assert asdict(table.lookup("forward", 4096, 2048, BF16)) == winners[2048]
    assert table.lookup("forward", 4096, 4096, BF16) == analytic != winners[4096]
    args = ["--overlay", str(sweep_path), "--out", str(out), "--leave-out", "forward/bf16"]
    assert tune_table.main([*args, "--leave-out", "forward/bf16/2048"]) == 0  # overlapping names
    table = tuning.load(json.loads(out.read_text()))
    for n in (2048, 4096):  # neither width laid over: the analytic choice stays at both
        assert asdict(table.lookup("forward", 4096, n, BF16)) == asdict(config.forward_candidate(4096, n, BF16, SMS))
        assert asdict(table.lookup("forward", 4096, n, BF16)) != winners[n]
    assert asdict(table.lookup("forward", 4096, 2048, torch.float16)) == fp16_winner  # the other dtype lands
    # a width or dtype the sweep lacks, a fifth part, an op alone
    for wrong in ("forward/bf16/8192", "forward/fp32", "forward/bf16/4096/4096/1", "forward"):
        with pytest.raises(SystemExit):
            tune_table.main(["--overlay", str(sweep_path), "--out", str(tmp_path / "x.json"), "--leave-out", wrong])
    assert not (tmp_path / "x.json").exists()


def test_overlay_leaves_out_one_measured_bucket_of_a_width(tune_table, tmp_path):
    """--leave-out OP/DTYPE/N/M: at that bucket the base's winner stays though the sweep's beat it there (an A/B
    rejected it at the rows that bucket holds), and the width's other measured bucket lands, the kept bucket's
    timings staying in the table as evidence; M must be a bucket the sweep timed at that width, outside any width
    or dtype left out whole."""
    n = 1152
    incumbent = {m: config.backward_candidate(m, n, BF16, SMS) for m in (8192, 32768)}
    challenger = config.BackwardCandidate("persistent", 8, 1024, 128, 2, 2, 0)
    assert challenger not in incumbent.values() and tuning.candidate_error("backward", challenger, n) is None
    runs = [
        {
            "m": m,
            "winner": asdict(challenger),
            "gbps": {build.label("backward", incumbent[m]): 2000.0, build.label("backward", challenger): 2400.0},
        }
        for m in (8192, 32768)
    ]
    sweep = build.new_doc("sm90_132sm", "test", (9, 0), SMS, "measured", "sweep")
    build.set_runs(sweep, "backward", "bf16", n, runs)
    sweep_path, out = tmp_path / "sweep.json", tmp_path / "out.json"
    sweep_path.write_text(json.dumps(sweep))
    args = ["--overlay", str(sweep_path), "--out", str(out), "--min-gain", "0.02"]
    assert tune_table.main([*args, "--leave-out", f"backward/bf16/{n}/32768"]) == 0
    table = tuning.load(json.loads(out.read_text()))
    assert table.lookup("backward", 8192, n, BF16) == challenger
    for m in (32768, 65536):  # the base's winner at the bucket left out, and above it
        assert table.lookup("backward", m, n, BF16) == incumbent[32768], m
    kept = next(r for r in json.loads(out.read_text())["backward"]["bf16"][str(n)] if r["m"] == 32768)
    assert kept["gbps"] == runs[1]["gbps"] and kept["winner"] == asdict(incumbent[32768])
    shipped = build.slim(json.loads(out.read_text()))["backward"]["bf16"][str(n)]
    assert kept["kept"] == next(r for r in shipped if r["m"] == 32768)["kept"] == build.KEPT_BY_AB  # says why
    assert tune_table.main(args) == 0  # without it the sweep's winner lands at both
    assert tuning.load(json.loads(out.read_text())).lookup("backward", 32768, n, BF16) == challenger
    # a bucket the sweep did not time, not a number, a width it lacks; a bucket of a width or dtype left out whole
    for wrong in (
        [f"{n}/16384"],
        [f"{n}/x"],
        [f"{n}/\u00b3"],
        ["2048/32768"],
        [f"{n}/32768", f"{n}"],
        [f"{n}/32768", ""],
    ):
        names = [f"backward/bf16/{w}".rstrip("/") for w in wrong]
        with pytest.raises(SystemExit):
            tune_table.main([*args[:2], "--out", str(tmp_path / "x.json"), *(f"--leave-out={e}" for e in names)])
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit):  # without --overlay there is nothing to leave out of
        tune_table.main(["--analytic", "--sms", "132", "--out", str(tmp_path / "x.json"), "--leave-out", "a/b"])
    assert not (tmp_path / "x.json").exists()


def test_a_sweep_command_reaches_the_sweep(tune_table, monkeypatch, tmp_path):
    # main() once shadowed the sweep function with a local of the same name, so every GPU sweep died
    # with UnboundLocalError before timing anything; the CPU tests only ever ran --estimate and --overlay.
    monkeypatch.setattr(tune_table.timing, "cuda_device", lambda prog: torch.device("cuda", 0))
    seen = {}

    def fake_sweep(args, command, device, ops, points, base_doc, done):
        seen.update(ops=ops, points=points, out=args.out)
        return 0

    monkeypatch.setattr(tune_table, "sweep", fake_sweep)
    out = str(tmp_path / "s.json")
    assert tune_table.main(["--ops", "qk", "--dtypes", "bf16", "--quick", "--m", "32768", "--out", out]) == 0
    assert seen["ops"] == ["qk"] and seen["out"] == out
    assert seen["points"]["qk"] == [("bf16", d, 32768) for d in tune_table.QK_N]


@pytest.mark.parametrize(
    "op, m, n", [("forward", 1 << 20, 128), ("forward", 4096, 4096), ("backward", 1 << 18, 64), ("qk", 32768, 128)]
)
def test_wide_candidates_extend_the_quick_ones(op, m, n):
    quick = build.candidates(op, m, n, BF16, SMS)
    wide = build.candidates(op, m, n, BF16, SMS, wide=True)
    assert wide[0] == quick[0]  # the analytic choice first: the winner must beat it
    assert set(quick) < set(wide)
    assert all(tuning.candidate_error(op, c, n) is None for c in wide)
    if op == "qk":
        base = quick[0].fwd_occupancy
        assert {c.fwd_occupancy for c in wide if c.fwd_blocks_per_sm} == {base, 2 * base, 4 * base}
        # forwards of one tile per block, around the plain forward's analytic "tiles" choice for the head dim
        tiles = config.forward_candidate(m, n, BF16, SMS, "tiles")
        assert (tiles.tile_m, 0, tiles.occupancy) in {
            (c.fwd_tile_m, c.fwd_blocks_per_sm, c.fwd_occupancy) for c in wide
        }
        # the plain forward's short-row choice for rows of one head is timed too
        plain = config.forward_candidate(m, n, BF16, SMS, "persistent")
        assert (plain.tile_m, plain.blocks_per_sm, plain.occupancy) in {
            (c.fwd_tile_m, c.fwd_blocks_per_sm, c.fwd_occupancy) for c in wide
        }
    elif op == "forward" and quick[0].kernel == "persistent":
        # up to one row tile per block at large M (the grid is capped by the row tiles)
        assert max(c.blocks_per_sm for c in wide) == 64 * quick[0].blocks_per_sm
        assert {c.occupancy for c in wide} > {c.occupancy for c in quick}


@pytest.mark.parametrize("n, split", [(2304, (2048, 256)), (4608, (4096, 512)), (4096, None)])
def test_wide_forward_candidates_try_a_padded_row_as_tile_and_tail(n, split):
    """Rows padded to a power of two (the analytic forward splits only the widest) are also timed as a tile
    plus a tail tile; a power-of-two row has no split to try."""
    cands = build.candidates("forward", 16384, n, BF16, SMS, wide=True)
    tails = {(c.tile_n, c.tail_n) for c in cands if c.kernel == "persistent" and c.tail_n}
    assert tails == ({split} if split else set())
    assert all(tuning.candidate_error("forward", c, n) is None for c in cands)


@pytest.mark.parametrize("n", [20480, 65536])
def test_wide_forward_candidates_try_narrower_chunks_past_one_chunk(n):
    """Rows wider than one chunk: the wide set also times the gather's chunks at half the width, with twice
    the occupancy; the quick set and rows of one chunk keep the configured chunk. Neither times the split
    forward, which no shipped table may launch."""
    chunk = config.HEURISTICS.fwd_chunk_n
    wide = build.candidates("forward", 4096, n, BF16, SMS, wide=True)
    narrow = {(c.kernel, c.tile_n) for c in wide if c.tile_n < chunk}
    assert narrow == {("gather", chunk // 2)}
    gather = config.forward_candidate(4096, n, BF16, SMS, "gather")
    assert replace(gather, tile_n=chunk // 2, occupancy=max(1, gather.occupancy) * 2) in wide
    assert "split" not in {c.kernel for c in wide + build.candidates("forward", 4096, n, BF16, SMS)}
    assert all(tuning.candidate_error("forward", c, n) is None for c in wide)
    assert all(c.tile_n >= chunk for c in build.candidates("forward", 4096, n, BF16, SMS))
    one_chunk = build.candidates("forward", 4096, chunk, BF16, SMS, wide=True)
    assert {c.tile_n for c in one_chunk if c.kernel == "gather"} == {chunk}


@pytest.mark.parametrize(
    "op, n", [("forward", 896), ("forward", 2304), ("forward", 4608), ("backward", 3584), ("backward", 6144)]
)
def test_wide_candidates_build_each_persistent_tile_at_one_block_per_sm(op, n):
    """Every persistent tile shape the wide set times with the compiler's warps is also timed at one block per
    SM, with eight warps and with the compiler's warps at occupancy 1 (the deepest ring of load stages as
    launched, PERFORMANCE.md, "Toolchain"); the quick set has neither."""
    kind = "kernel" if op == "forward" else "strategy"
    wide = build.candidates(op, 32768, n, BF16, SMS, wide=True)
    quick = build.candidates(op, 32768, n, BF16, SMS)
    persistent = [c for c in wide if getattr(c, kind) == "persistent"]
    default_shapes = {(c.tile_m, c.tile_n, c.tail_n) for c in persistent if not c.num_worker_warps}
    for warps in (8, 0):
        built = [c for c in persistent if (c.num_worker_warps, c.occupancy, c.blocks_per_sm) == (warps, 1, 1)]
        assert default_shapes and default_shapes <= {(c.tile_m, c.tile_n, c.tail_n) for c in built}, warps
        assert not [c for c in quick if (c.num_worker_warps, c.occupancy, c.blocks_per_sm) == (warps, 1, 1)]
    assert len(set(wide)) == len(wide)
    assert all(tuning.candidate_error(op, c, n) is None for c in wide)
    assert not any(c.num_worker_warps == 8 and c.occupancy == 1 for c in quick)


def _backward_sweep_over(incumbent_gbps: float, challenger_gbps: float, min_gain: float = 0.01):
    """The shipped-style base (the analytic table) re-timed at one bucket by a sweep whose winner is another
    candidate; returns (incumbent, challenger, the overlaid table)."""
    n, m = 4096, 32768
    base = build.analytic_doc("sm90_132sm", "test", (9, 0), SMS, "test")
    incumbent = config.backward_candidate(m, n, BF16, SMS)
    challenger = config.BackwardCandidate("persistent", 4, 4096, 0, 1, 1, 8)
    gbps = {build.label("backward", incumbent): incumbent_gbps, build.label("backward", challenger): challenger_gbps}
    sweep = build.new_doc("sm90_132sm", "test", (9, 0), SMS, "measured", "sweep")
    build.set_runs(sweep, "backward", "bf16", n, [{"m": m, "winner": asdict(challenger), "gbps": gbps}])
    return incumbent, challenger, tuning.load(build.overlay(base, sweep, min_gain))


@pytest.mark.parametrize("gain, kept", [(1.004, True), (1.009, True), (1.011, False), (1.05, False), (0.99, True)])
def test_overlay_keeps_the_incumbent_unless_the_sweep_beats_it_by_min_gain(gain, kept):
    """A re-timed bucket changes its winner only when the new one is at least min_gain faster than what the
    base launched there, timed in the same sweep (a 0.4% "win" cost a held-out shape 2.8%: PERFORMANCE.md,
    "Tuning tables"), and the choice carries to the buckets above as the sweep's winner would."""
    incumbent, challenger, table = _backward_sweep_over(2000.0, 2000.0 * gain)
    for m in (32768, 65536):
        assert table.lookup("backward", m, 4096, BF16) == (incumbent if kept else challenger), m
    assert table.lookup("backward", 16384, 4096, BF16) == incumbent  # below the sweep: the base's


@pytest.mark.parametrize("fwd_gain, bwd_gain", [(1.01, 1.03), (1.03, 1.01), (1.015, 1.015), (1.05, 1.05)])
def test_overlay_keeps_each_qk_half_unless_the_sweep_beats_it_by_min_gain(fwd_gain, bwd_gain):
    """A qk sweep times the forward and the backward half apart; each half of a re-timed bucket changes only
    where the sweep's half beats what the base launched there by min_gain, so one half's noise does not ride
    in with the other's gain."""
    d, m = 128, 1048576
    base = tuning.packaged("sm90_132sm").doc
    incumbent = tuning.load(base).lookup("qk", m, d, BF16)
    challenger = config.QKCandidate(
        incumbent.fwd_tile_m * 2, incumbent.bwd_tile_m * 2, 0, incumbent.bwd_blocks_per_sm * 2, 8, 4
    )
    assert tuning.candidate_error("qk", challenger, d) is None
    gbps = {
        build.qk_half_label(incumbent, "fwd"): 2000.0,
        build.qk_half_label(challenger, "fwd"): 2000.0 * fwd_gain,
        build.qk_half_label(incumbent, "bwd"): 2000.0,
        build.qk_half_label(challenger, "bwd"): 2000.0 * bwd_gain,
    }
    sweep = build.new_doc("sm90_132sm", base["device"]["name"], (9, 0), SMS, "measured", "sweep")
    build.set_runs(sweep, "qk", "bf16", d, [{"m": m, "winner": asdict(challenger), "gbps": gbps}])
    got = tuning.load(build.overlay(base, sweep, 0.02)).lookup("qk", m, d, BF16)
    for side, gain in (("fwd", fwd_gain), ("bwd", bwd_gain)):
        want = challenger if gain >= 1.02 else incumbent
        assert build.qk_half_label(got, side) == build.qk_half_label(want, side), side


def test_overlay_of_one_qk_half_keeps_the_bases_timings_of_the_other():
    """A --qk-half fwd sweep's run replaces the base's run at its bucket whole: the backward half's timings the
    base held there stay in the run (the evidence of the backward half it still launches) and in the slim table,
    the forward half's are the sweep's."""
    d, m = 128, 1048576
    base = tuning.packaged("sm90_132sm").doc
    base_run = next(r for r in base["qk"]["bf16"][str(d)] if r["m"] == m)
    incumbent = tuning.parse_winner("qk", base_run["winner"], "incumbent")
    bwd_label = build.qk_half_label(incumbent, "bwd")
    assert bwd_label in base_run["gbps"]
    challenger = replace(incumbent, fwd_tile_m=incumbent.fwd_tile_m * 2)
    assert tuning.candidate_error("qk", challenger, d) is None
    fwd = {build.qk_half_label(incumbent, "fwd"): 2000.0, build.qk_half_label(challenger, "fwd"): 2400.0}
    sweep = build.new_doc("sm90_132sm", base["device"]["name"], (9, 0), SMS, "measured", "sweep")
    build.set_runs(sweep, "qk", "bf16", d, [{"m": m, "winner": asdict(challenger), "gbps": fwd}])
    out = build.overlay(base, sweep, 0.02)
    run = next(r for r in out["qk"]["bf16"][str(d)] if r["m"] == m)
    assert tuning.parse_winner("qk", run["winner"], "winner") == challenger
    assert run["gbps"] == {**fwd, bwd_label: base_run["gbps"][bwd_label]}
    shipped = next(r for r in build.slim(out)["qk"]["bf16"][str(d)] if r["m"] == m)
    assert shipped["gbps"] == {build.qk_half_label(challenger, "fwd"): 2400.0, bwd_label: base_run["gbps"][bwd_label]}


def test_span_rows_lie_inside_the_bucket():
    """The second point of a bucket's span takes the bucket's winner: more than half the point's rows, fewer
    than the point's (5/8 of them); buckets of fewer than 8 rows have none."""
    for m_b in tuning.M_BUCKETS:
        m = build.span_rows(m_b)
        if m_b < 8:
            assert m is None
            continue
        assert m_b // 2 < m < m_b and tuning.m_bucket(m) == m_b


def test_a_spanned_run_is_scored_by_both_points():
    """A run timed at its bucket point and inside its span is scored by the geometric mean of the two GB/s,
    for candidates timed at both; a run without a span by the point's GB/s alone."""
    run = {"m": 8192, "gbps": {"a": 2700.0, "b": 2600.0, "c": 2000.0}}
    assert build.scores(run) == run["gbps"]
    run["span"] = {"m": 5120, "gbps": {"a": 2400.0, "b": 2680.0}}
    got = build.scores(run)
    assert set(got) == {"a", "b"}
    assert got["a"] == pytest.approx((2700.0 * 2400.0) ** 0.5) and got["b"] == pytest.approx((2600.0 * 2680.0) ** 0.5)
    assert build.select_winner(got, "a", 0.01) == "b"  # ahead over the bucket's rows, behind at its point


def test_overlay_keeps_or_replaces_the_incumbent_by_the_span_scores():
    """An overlay measures the sweep's winner against the base's by the run's scores: a winner at the bucket point
    alone that loses inside the span does not replace the incumbent."""
    n, m = 4096, 32768
    base = build.analytic_doc("sm90_132sm", "test", (9, 0), SMS, "test")
    incumbent = config.backward_candidate(m, n, BF16, SMS)
    challenger = config.BackwardCandidate("persistent", 4, 4096, 0, 1, 1, 8)
    mine, theirs = build.label("backward", incumbent), build.label("backward", challenger)
    for span_gbps, kept in (({mine: 2000.0, theirs: 1800.0}, True), ({mine: 2000.0, theirs: 2100.0}, False)):
        run = {"m": m, "winner": asdict(challenger), "gbps": {mine: 2000.0, theirs: 2060.0}}
        run["span"] = {"m": build.span_rows(m), "gbps": span_gbps}
        sweep = build.new_doc("sm90_132sm", "test", (9, 0), SMS, "measured", "sweep")
        build.set_runs(sweep, "backward", "bf16", n, [run])
        got = tuning.load(build.overlay(base, sweep)).lookup("backward", m, n, BF16)
        assert got == (incumbent if kept else challenger), span_gbps


def test_overlay_takes_the_sweeps_winner_where_the_incumbent_was_not_timed():
    n, m = 4096, 32768
    base = build.analytic_doc("sm90_132sm", "test", (9, 0), SMS, "test")
    challenger = config.BackwardCandidate("persistent", 4, 4096, 0, 1, 1, 8)
    sweep = build.new_doc("sm90_132sm", "test", (9, 0), SMS, "measured", "sweep")
    run = {"m": m, "winner": asdict(challenger), "gbps": {build.label("backward", challenger): 1.0}}
    build.set_runs(sweep, "backward", "bf16", n, [run])
    assert tuning.load(build.overlay(base, sweep)).lookup("backward", m, n, BF16) == challenger


def test_the_qk_sweep_times_the_views_the_product_launches(tune_table):
    """The sweep calls the cuTile host directly, so it must hand it the views ``qk_rms_norm`` would: for the
    dense q and k it builds, ops merges (tokens, heads, D) into (1, 1, tokens * heads, D) rows. An earlier
    sweep timed the head-strided (tokens, 16, D) walk instead, and its winners did not transfer."""
    q = torch.randn(8, build.QK_SWEEP_HEADS[0], 64)
    got = tune_table.qk_product_views(q)
    assert got.shape == (1, 1, 8 * build.QK_SWEEP_HEADS[0], 64) and got.data_ptr() == q.data_ptr()
    sliced = torch.randn(8, 3 * 16 * 64)[:, : 16 * 64].view(8, 16, 64)  # q of a fused qkv projection
    assert tune_table.qk_product_views(sliced).shape == (1, 8, 16, 64)  # rows not one run: tokens x heads


def test_a_qk_sweep_of_one_half_times_it_alone_and_keeps_the_tables_other_half(tune_table, monkeypatch):
    """``--qk-half fwd``: only forward halves are timed; the winner's forward half is the fastest, its backward
    half the launch the device's table gives there (the incumbent), which the sweep never timed."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    m_b, n_b = 32768, 128
    cands = build.candidates("qk", m_b, n_b, BF16, SMS)
    base = cands[0]
    fast = next(c for c in cands if c.fwd_tile_m == 2 * base.fwd_tile_m)
    incumbent = replace(base, bwd_blocks_per_sm=4 * base.bwd_blocks_per_sm)  # a backward half no candidate has
    installed, calls = {}, []

    @contextmanager
    def use_table(doc):
        installed["cand"] = tuning.parse_winner("qk", doc["qk"]["bf16"][str(n_b)][0]["winner"], "candidate")
        yield

    def time_us(timer, call, sets, reps):
        calls.append(call)
        return 5.0 if installed["cand"].fwd_tile_m == fast.fwd_tile_m else 10.0

    monkeypatch.setattr(tune_table.tuning, "use_table", use_table)
    monkeypatch.setattr(
        tune_table.torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=SMS)
    )
    monkeypatch.setattr(tune_table.torch, "randn", lambda *a, **k: None)
    parts = {"fwd": (1 << 20, "qk_fwd"), "bwd": (1 << 21, "qk_bwd")}
    monkeypatch.setattr(tune_table, "_inputs", lambda op, m, n, dtype, device: ([m], parts))
    monkeypatch.setattr(tune_table, "_call", lambda cutile, kind, w: kind)
    monkeypatch.setattr(tune_table.tune_cutile, "_time_us", time_us)
    point = (None, None, None, "sm90_132sm", "qk", BF16, n_b, m_b, 3, 0.01)
    run = tune_table.time_point(*point, incumbent=incumbent, check=False, halves=("fwd",))
    assert calls and set(calls) == {"qk_fwd"}
    assert all(label.startswith("fwd ") for label in run["gbps"])
    won = tuning.parse_winner("qk", run["winner"], "winner")
    assert (won.fwd_tile_m, won.fwd_occupancy) == (fast.fwd_tile_m, fast.fwd_occupancy)
    assert (won.bwd_tile_m, won.bwd_blocks_per_sm, won.bwd_occupancy) == (
        incumbent.bwd_tile_m,
        incumbent.bwd_blocks_per_sm,
        incumbent.bwd_occupancy,
    )
    both = tune_table.estimate(["qk"], {"qk": [("bf16", n_b, m_b)]}, SMS)
    fwd_only = tune_table.estimate(["qk"], {"qk": [("bf16", n_b, m_b)]}, SMS, halves=("fwd",))
    assert fwd_only["timings"] == len({build.qk_half_label(c, "fwd") for c in cands}) < both["timings"]


def test_a_sweep_over_the_shipped_table_ships_what_it_would_over_the_candidates():
    """The shipped table keeps of each measured run only its winner's timings (build.slim), and an overlay needs no
    more of its base: laying a committed sweep over the shipped table gives the table that laying it over the sweeps'
    full table would ship, so a GPU run may take the shipped table as its --base (CONTRIBUTING, "Adding a kernel")."""
    checked = 0
    for key, path in sweep_evidence().items():
        candidates = tuning.load(path).doc
        for sweep_path in sorted(path.parent.glob("*.json")):
            raw = json.loads(sweep_path.read_text())
            if sweep_path == path or "schema" not in raw or raw["device"]["key"] != key:
                continue  # the full table itself, another tool's sweep (tune_cutile), another card's
            sweep = tuning.load(raw).doc
            full = build.slim(build.overlay(candidates, sweep, 0.02))
            assert build.slim(build.overlay(build.slim(candidates), sweep, 0.02)) == full, sweep_path.name
            checked += 1
    assert checked >= 10
