"""The sweep's value check (bench/tools/candidate_check.py) on the CPU: the host calls of the reference stand in
for cuTile's, and wrong ones beside them (tests/test_tuning_sweep.py: the sweep skipping a candidate that fails it)."""

from __future__ import annotations

import pytest
import torch

from bench.tools import candidate_check
from tilegym_rms import reference

BF16 = torch.bfloat16


class ReferenceHost:
    """The cuTile host calls ``tune_table`` times, computed by :mod:`tilegym_rms.reference` in the inputs' dtype
    (what a correct launch returns, rounding included). ``wrong``: one output of one call made wrong."""

    def __init__(self, wrong: str = ""):
        self.wrong = wrong

    def _spoil(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name != self.wrong:
            return t
        if t.dim() == 1:
            return t * 1.05  # a reduction 5% off (a dropped or doubled partial)
        return t.reshape(-1, t.shape[-1]).roll(1, dims=0).reshape(t.shape)  # each row's values in the next row

    def forward(self, x, w, eps, offset, casting_mode):
        y, rstd = reference.rms_norm_forward(x, w, eps, offset, casting_mode)
        return self._spoil("y", y), self._spoil("rstd", rstd)

    def backward(self, x, dy, w, rstd, offset, casting_mode):
        dx, dw = reference.rms_norm_backward(x, dy, w, rstd, offset, casting_mode)
        return self._spoil("dx", dx), self._spoil("dw", dw)

    def fused_add_forward(self, x, r, w, eps, offset, casting_mode, *, mode):
        y, s, rstd = reference.fused_add_rms_norm_forward(x, r, w, eps, mode, offset, casting_mode)
        return self._spoil("y", y), self._spoil("res", s), rstd

    def qk_forward(self, q, k, wq, wk, eps, offset, casting_mode):
        (yq, rq), (yk, rk) = (self._rows(t, w, eps, offset, casting_mode) for t, w in ((q, wq), (k, wk)))
        return self._spoil("y", yq), yk, rq, rk

    def qk_backward(self, q, k, dyq, dyk, wq, wk, rq, rk, offset, casting_mode):
        n = q.shape[-1]
        out = []
        for t, dy, w, r in ((q, dyq, wq, rq), (k, dyk, wk, rk)):
            dx, dw = reference.rms_norm_backward(t.reshape(-1, n), dy.reshape(-1, n), w, r.reshape(-1), offset)
            out.append((dx.reshape(t.shape), dw))
        (dq, dwq), (dk, dwk) = out
        return dq, dk, self._spoil("dw", dwq), dwk

    @staticmethod
    def _rows(t, w, eps, offset, casting_mode):
        y, rstd = reference.rms_norm_forward(t.reshape(-1, t.shape[-1]), w, eps, offset, casting_mode)
        return y.reshape(t.shape), rstd.reshape(t.shape[:-1])


OPS = ("forward", "backward", "fused_forward", "qk")


@pytest.mark.parametrize("op", OPS)
def test_a_correct_launch_passes_the_check(op):
    w = torch.randn(96, dtype=BF16)
    errs = candidate_check.errors(ReferenceHost(), op, BF16, 96, w, rows=37)
    expected = {
        "forward": {"y", "rstd"},
        "backward": {"dx", "dw"},
        "fused_forward": {"y", "res", "rstd"},
        "qk": {f"{h}.{k}" for h in "qk" for k in ("y", "rstd", "dx", "dw")},
    }[op]
    assert set(errs) == expected
    assert candidate_check.beyond_tolerance(errs, "bf16") == {}
    assert max(errs.values()) > 0  # rounded to bf16 against float64: the check measured something


@pytest.mark.parametrize(
    ("op", "wrong", "flagged"),
    [
        ("forward", "y", "y"),
        ("forward", "rstd", "rstd"),
        ("backward", "dx", "dx"),
        ("backward", "dw", "dw"),
        ("fused_forward", "res", "res"),
        ("qk", "y", "q.y"),
        ("qk", "dw", "q.dw"),
    ],
)
def test_a_wrong_launch_fails_the_check(op, wrong, flagged):
    w = torch.randn(96, dtype=BF16)
    errs = candidate_check.errors(ReferenceHost(wrong), op, BF16, 96, w, rows=37)
    assert set(candidate_check.beyond_tolerance(errs, "bf16")) == {flagged}


def test_nan_is_beyond_every_tolerance():
    bad = candidate_check.beyond_tolerance({"y": float("nan"), "rstd": 0.0}, "fp32")
    assert list(bad) == ["y"]
