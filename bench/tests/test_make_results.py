"""bench/RESULTS.md against the committed JSON (no GPU needed): ``pytest bench/``."""

from __future__ import annotations

import json

from bench.common import records, traffic
from bench.tools import make_results


def test_results_md_is_up_to_date():
    """Regenerating RESULTS.md from the committed JSON gives the committed text."""
    expected = make_results.render()
    assert make_results.RESULTS_MD.read_text() == expected, "stale: run python -m bench.tools.make_results"


def test_every_committed_file_is_linked():
    text = make_results.RESULTS_MD.read_text()
    for path in sorted(make_results.RESULTS_DIR.glob("*/*")):
        if path.suffix in (".json", ".png", ".md", ".log"):
            assert f"(results/{path.parent.name}/{path.name})" in text, path


def _point(provider: str, n: int, us: float, ok: bool = True) -> records.Point:
    extra = {"M": 4096, "dtype": "bf16", "suite": "grid"}
    p = records.Point("rms_norm", "forward", "grid", provider, "bf16", 4096, n, "N", "hidden size N", n, extra)
    p.us, p.nbytes, p.errs, p.ok = [us] * 3, traffic.forward_bytes(4096, n, 2), {"y": 1e-3}, ok
    return p


def test_render_layout(tmp_path):
    """Bold where cuTile leads its row, '!' on a failed check, a dash where a provider has no point, the % of
    the run's copy bandwidth, the card, the method and the plot link."""
    meta = {
        "gpu_name": "Test GPU",
        "timestamp": "2030-01-02 03:04:05",
        "tilegym_rms_version": "9.9",
        "copy_bandwidth_GBps": 1000.0,
        "timing_method": make_results.base.METHOD_TEXT["profiler"],
    }
    pts = [_point("tilegym_rms-cutile", 1024, 20.0), _point("tilegym_rms-cutile", 2048, 80.0, ok=False)]
    pts += [_point("liger", 1024, 40.0), _point("liger", 2048, 40.0), _point("torch", 1024, 30.0)]
    card = tmp_path / "results" / "test"
    card.mkdir(parents=True)
    (card / "rms_norm.json").write_text(json.dumps(records.build_records(pts, meta)))
    (card / "rms_norm_forward.png").write_bytes(b"")
    text = make_results.render(tmp_path / "results", tmp_path / "RESULTS.md")
    gb_1024 = traffic.gbps(traffic.forward_bytes(4096, 1024, 2), 20.0)
    assert f"| 4096 × 1024 | **{gb_1024:.0f} ({gb_1024 / 10:.0f}%)** |" in text
    row_2048 = next(line for line in text.splitlines() if line.startswith("| 4096 × 2048 "))
    assert "!" in row_2048 and "**" not in row_2048 and f"| {make_results.MISSING} |" in row_2048
    assert "## Test GPU (`results/test/`)" in text and "Recorded 2030-01-02 03:04; tilegym_rms 9.9" in text
    assert "#### Forward, bf16 ([plot](results/test/rms_norm_forward.png))" in text
    assert "Timing: `profiler`" in text and "Copy bandwidth 1000 GB/s" in text


def test_check_mode(tmp_path):
    out = tmp_path / "RESULTS.md"
    args = ["--out", str(out), "--check"]
    assert make_results.main(args) == 1 and not out.exists()
    assert make_results.main(args[:2]) == 0 and make_results.main(args) == 0


def test_latency_tables_judge_the_host_targets(tmp_path):
    """The eager-latency tables carry issue #14's host targets: cuTile's time over torch's in the same run,
    at most 1.0x for the forward and 1.1x for the forward + backward, with the verdict."""
    meta = {"gpu_name": "Test GPU", "timestamp": "2030-01-02 03:04:05", "tilegym_rms_version": "9.9"}
    pts = []
    for op, ours, torch_us in (("forward", 20.0, 18.0), ("full", 110.0, 100.0)):
        for provider, us in (("tilegym_rms-cutile", ours), ("torch", torch_us)):
            extra = {"N": 4096, "dtype": "bf16", "suite": "latency"}
            p = records.Point("rms_norm", op, "latency", provider, "bf16", 64, 4096, "M", "rows M", 64, extra)
            p.us, p.metric, p.errs, p.ok = [us] * 3, "latency", {"y": 1e-3}, True
            pts.append(p)
    card = tmp_path / "results" / "test"
    card.mkdir(parents=True)
    (card / "rms_norm.json").write_text(json.dumps(records.build_records(pts, meta)))
    text = make_results.render(tmp_path / "results", tmp_path / "RESULTS.md")
    assert f"| M × N | cuTile | torch | {make_results.HOST_TARGET_COLUMN} |" in text
    assert "| 64 × 4096 | 20.0 | 18.0 | 1.11× (≤ 1.00×: missed) |" in text
    assert "| 64 × 4096 | 110.0 | 100.0 | 1.10× (≤ 1.10×: met) |" in text
