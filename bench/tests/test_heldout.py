"""The held-out shapes (bench/heldout.json): what makes them held out is checked here."""

import json
from pathlib import Path

HELDOUT = json.loads((Path(__file__).resolve().parents[1] / "heldout.json").read_text())["shapes"]


def test_heldout_shapes_are_not_sweep_points_and_cover_what_users_run():
    assert len(HELDOUT) >= 12
    shapes = [(s["m"], s["n"], s["dtype"]) for s in HELDOUT]
    assert len(set(shapes)) == len(shapes)
    # The sweep times M at powers of two: a held-out M never is one.
    assert all(m & (m - 1) for m, _, _ in shapes)
    assert {d for _, _, d in shapes} == {"bf16", "fp16", "fp32"}
    assert {n for _, n, _ in shapes} >= {64, 128, 256}  # QK-norm head dims
    # Big enough to be bandwidth-bound (the targets start at M x N >= 2^22).
    assert all(m * n >= 1 << 22 for m, n, _ in shapes)
