"""RESULTS.md against the committed JSON (no GPU needed): ``pytest bench/``."""

from __future__ import annotations

import json
import statistics

from bench.common import base, records, traffic
from bench.tools import make_results


def test_results_md_is_up_to_date():
    """Regenerating RESULTS.md from the committed JSON gives the committed text."""
    expected = make_results.render()
    assert make_results.RESULTS_MD.read_text() == expected, "stale: run python -m bench.tools.make_results"


def test_every_committed_file_is_linked():
    """Each card's headline files, and every file of its sweeps/ and ab/ folders."""
    text = make_results.RESULTS_MD.read_text()
    for card in sorted(p for p in make_results.RESULTS_DIR.iterdir() if p.is_dir()):
        paths = [p for p in card.iterdir() if p.suffix in (".json", ".png", ".md", ".log")]
        paths += [p for files in make_results.evidence_files(card).values() for p in files]
        for path in paths:
            assert f"({make_results.rel(path, make_results.RESULTS_MD.parent)})" in text, path


def _point(provider: str, n: int, us: float, ok: bool = True) -> records.Point:
    extra = {"M": 4096, "dtype": "bf16", "suite": "grid"}
    p = records.Point("rms_norm", "forward", "grid", provider, "bf16", 4096, n, "N", "hidden size N", n, extra)
    p.us, p.nbytes, p.errs, p.ok = [us] * 3, traffic.forward_bytes(4096, n, 2), {"y": 1e-3}, ok
    return p


META = {  # a results file's run
    "gpu_name": "Test GPU",
    "timestamp": "2030-01-02 03:04:05",
    "tilegym_rms_version": "9.9",
    "copy_bandwidth_GBps": 1000.0,
    "timing_method": make_results.base.METHOD_TEXT["profiler"],
}


def _render(tmp_path, pts: list, meta: dict):
    """Writes the points as a card's results file and renders RESULTS.md over it: ``(card folder, text)``."""
    card = tmp_path / "results" / "test"
    card.mkdir(parents=True)
    (card / "rms_norm.json").write_text(json.dumps(records.build_records(pts, meta)))
    return card, make_results.render(tmp_path / "results", tmp_path / "RESULTS.md")


def test_render_layout(tmp_path):
    """Bold where cuTile leads its row, '!' on a failed check, a dash where a provider has no point, the % of
    the run's copy bandwidth, the card, the method and the plot link."""
    pts = [_point("tilegym_rms-cutile", 1024, 20.0), _point("tilegym_rms-cutile", 2048, 80.0, ok=False)]
    pts += [_point("liger", 1024, 40.0), _point("liger", 2048, 40.0), _point("torch", 1024, 30.0)]
    card = tmp_path / "results" / "test"
    card.mkdir(parents=True)
    (card / "rms_norm.json").write_text(json.dumps(records.build_records(pts, META)))
    (card / "rms_norm_forward.png").write_bytes(b"")
    text = make_results.render(tmp_path / "results", tmp_path / "RESULTS.md")
    gb_1024 = traffic.gbps(traffic.forward_bytes(4096, 1024, 2), 20.0)
    assert f"| 4096 × 1024 | **{gb_1024:.0f} ({gb_1024 / 10:.0f}%)** |" in text
    row_2048 = next(line for line in text.splitlines() if line.startswith("| 4096 × 2048 "))
    assert "!" in row_2048 and "**" not in row_2048 and f"| {make_results.MISSING} |" in row_2048
    assert "## Test GPU (`results/test/`)" in text and "Recorded 2030-01-02 03:04; tilegym_rms 9.9" in text
    assert "#### Forward, bf16 ([plot](results/test/rms_norm_forward.png))" in text
    assert "Timing: `profiler`" in text and "Copy bandwidth 1000 GB/s" in text


def test_qk_norm_records_of_another_head_ratio_get_tables_of_their_own(tmp_path):
    """A QK-norm run at 32:8 heads beside the default ratio's: two tables, each titled by its ratio, and the
    summary compares within a ratio (a 32:8 peer never judges the 16:4 point)."""
    pts = []
    for heads, provider, us in (("", "tilegym_rms-cutile", 20.0), ("", "torch", 40.0), ("32:8", "torch", 10.0)):
        extra = {"M": 4096, "dtype": "bf16", "suite": "qk_norm", **({"heads": heads} if heads else {})}
        p = records.Point("rms_norm", "qk_fwd", "qk_norm", provider, "bf16", 4096, 128, "N", "head dim", 128, extra)
        p.us, p.nbytes, p.errs, p.ok = [us] * 3, traffic.forward_bytes(4096, 128, 2), {"y": 1e-3}, True
        pts.append(p)
    card, text = _render(tmp_path, pts, META)
    assert "#### QK-norm, forward, q of 16 heads, k of 4, bf16" in text
    assert "#### QK-norm, forward, q of 32 heads, k of 8, bf16" in text
    assert make_results.against_best_peer(json.loads((card / "rms_norm.json").read_text()))["qk_fwd"] == [
        make_results.Versus(2.0, traffic.gbps(traffic.forward_bytes(4096, 128, 2), 20.0) / 1000, "torch", "bf16")
    ]


def test_gated_records_of_another_group_count_get_tables_of_their_own(tmp_path):
    """A gated run with whole rows as one group beside the default layout's: two tables, the other titled by its
    count, and no table mixes the two."""
    pts = []
    for groups, us in ((None, 20.0), (1, 10.0)):
        extra = {"M": 4096, "dtype": "bf16", "suite": "gated", **({"groups": groups} if groups else {})}
        p = records.Point("rms_norm", "gated_fwd_after_bf16gate", "gated", "tilegym_rms-cutile", "bf16", 4096, 2048,
                          "N", "hidden size N", 2048, extra)  # fmt: skip
        p.us, p.nbytes, p.errs, p.ok = [us] * 3, traffic.forward_bytes(4096, 2048, 2), {"y": 1e-3}, True
        pts.append(p)
    _, text = _render(tmp_path, pts, META)
    titles = [line for line in text.splitlines() if line.startswith("#### gated_fwd_after_bf16gate")]
    assert titles == [
        "#### gated_fwd_after_bf16gate, gated, bf16",
        "#### gated_fwd_after_bf16gate, gated, rows of one group, bf16",
    ]


def test_check_mode(tmp_path):
    out = tmp_path / "RESULTS.md"
    args = ["--out", str(out), "--check"]
    assert make_results.main(args) == 1 and not out.exists()
    assert make_results.main(args[:2]) == 0 and make_results.main(args) == 0


def test_latency_tables_judge_the_host_targets(tmp_path):
    """The eager-latency tables carry the host-time targets: cuTile's time over torch's in the same run,
    at most 1.0x for the forward and 1.1x for the forward + backward, with the verdict."""
    meta = {"gpu_name": "Test GPU", "timestamp": "2030-01-02 03:04:05", "tilegym_rms_version": "9.9"}
    pts = []
    for op, ours, torch_us in (("forward", 20.0, 18.0), ("full", 110.0, 100.0)):
        for provider, us in (("tilegym_rms-cutile", ours), ("torch", torch_us)):
            extra = {"N": 4096, "dtype": "bf16", "suite": "latency"}
            p = records.Point("rms_norm", op, "latency", provider, "bf16", 64, 4096, "M", "rows M", 64, extra)
            p.us, p.metric, p.errs, p.ok = [us] * 3, "latency", {"y": 1e-3}, True
            pts.append(p)
    card, text = _render(tmp_path, pts, meta)
    assert f"| M × N | cuTile | torch | {make_results.HOST_TARGET_COLUMN} |" in text
    assert "| 64 × 4096 | 20.0 | 18.0 | 1.11× (≤ 1.00×: missed) |" in text
    assert "| 64 × 4096 | 110.0 | 100.0 | 1.10× (≤ 1.10×: met) |" in text


def test_summary_is_ours_against_the_best_peer(tmp_path):
    """Per op: ours over the fastest peer at each shape (our other backends are not peers, a point that failed
    its check and the ascend-rs suite are left out), the median and range, the shapes at or above it, ours'
    share of the copy bandwidth and the best peers; an op the card lacks says so."""
    meta = {
        "gpu_name": "Test GPU",
        "timestamp": "2030-01-02 03:04:05",
        "tilegym_rms_version": "9.9",
        "copy_bandwidth_GBps": 1000.0,
    }
    # n: (ours, liger, quack, triton) in µs; quack failed its check at 2048, where it would have been fastest.
    times = {1024: (20.0, 40.0, 25.0, 10.0), 2048: (50.0, 40.0, 30.0, 50.0), 4096: (40.0, 40.0, 50.0, 50.0)}
    pts = []
    for n, row in times.items():
        for provider, us in zip(("tilegym_rms-cutile", "liger", "quack", "tilegym_rms-triton"), row, strict=True):
            pts.append(_point(provider, n, us, ok=not (provider == "quack" and n == 2048)))
    for provider, us in (("tilegym_rms-cutile", 100.0), ("liger", 1.0)):
        extra = {"M": 1, "N": 768, "dtype": "fp32", "suite": "ascend-rs"}
        p = records.Point(
            "rms_norm", "forward", "ascend-rs", provider, "fp32", 1, 768, "shape", "M x N", "1x768", extra
        )
        p.us, p.nbytes, p.errs, p.ok = [us] * 3, traffic.forward_bytes(1, 768, 4), {"y": 1e-6}, True
        pts.append(p)
    card, text = _render(tmp_path, pts, meta)

    # Same bytes per shape for every provider: ours / best peer is the best peer's time over ours.
    ratios = [25.0 / 20.0, 40.0 / 50.0, 40.0 / 40.0]
    shares = [traffic.gbps(traffic.forward_bytes(4096, n, 2), row[0]) / 10 for n, row in times.items()]
    share = f"{statistics.median(shares):.0f}% ({min(shares):.0f}–{max(shares):.0f}%)"
    summary = text[text.index("## Summary") : text.index("## How the tables")]
    assert "### Test GPU (`results/test/`)" in summary and "Peers: Liger, quack. Copy bandwidth 1000 GB/s." in summary
    row = f"| Forward | 3 (bf16) | 1.00× ({min(ratios):.2f}–{max(ratios):.2f}×) | 2 of 3 | {share} | Liger 2, quack 1 |"
    assert row in summary
    assert "| Forward + backward | not measured on this card |" in summary


def test_the_readmes_speed_summary_quotes_the_results():
    """The README's speed table (H100) and its H200 line quote the summary RESULTS.md computes from the committed
    results: each op's median ours ÷ best peer (with the range where the table shows it) and share of copy."""
    readme = (base.REPO_ROOT / "README.md").read_text()

    def summary_of(card: str) -> dict[str, tuple[str, str, str]]:
        files = make_results.card_files(make_results.RESULTS_DIR / card)[0]
        found = make_results.against_best_peer([r for f in files for r in json.loads(f.read_text())])
        rows = {op: make_results.summary_row(op, found[op]) for op in found}
        return {op: (row[2], row[2].split(" (")[0], row[4].split(" (")[0]) for op, row in rows.items()}

    h100 = summary_of("h100")
    for label, op in (("forward", "forward"), ("backward", "backward"), ("forward + backward", "full")):
        ratio, _, share = h100[op]
        assert f"| {label} | {ratio} | {share} |" in readme
    for label, fwd, bwd in (("fused add", "fused_add_fwd", "fused_add_bwd"), ("QK-norm", "qk_fwd", "qk_bwd")):
        medians, shares = f"{h100[fwd][1]} / {h100[bwd][1]}", f"{h100[fwd][2]} / {h100[bwd][2]}"
        assert f"| {label}, forward / backward | {medians} | {shares} |" in readme
    h200 = summary_of("h200")
    line = " ".join(readme[readme.index("NVIDIA H200 (") :].split("\n\n")[0].split())  # one paragraph, one line
    assert f"forward {h200['forward'][1]}, backward {h200['backward'][1]}, forward + backward {h200['full'][1]}" in line
    qk = f"forward {h200['qk_fwd'][1]}, backward {h200['qk_bwd'][1]}"
    assert f"QK-norm beside torch.compile (and quack at head dims 64, 128, 256): {qk}" in line
