"""The float64 checks the GPU tests and the benchmarks rely on (tilegym_rms.testing), on the CPU."""

import pytest
import torch

from tilegym_rms import reference
from tilegym_rms.testing import chunked_errors, rel_err, strided


@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
def test_chunked_errors_equal_the_unchunked_ones_and_see_a_perturbation(casting_mode):
    x, dy = strided(37, 24, seed=1), strided(37, 24, seed=2)
    w = torch.rand(24) + 0.5
    y, rstd = reference.rms_norm_forward(x.double(), w.double(), 1e-6, 0.5, casting_mode)
    dx, dw = reference.rms_norm_backward(x.double(), dy.double(), w.double(), rstd, 0.5)
    bad = {"y": y * 1.01, "rstd": rstd, "dx": dx, "dw": dw * 0.98}
    kw = dict(eps=1e-6, offset=0.5, casting_mode=casting_mode)
    whole = chunked_errors(x, w, dy, bad, **kw)
    chunked = chunked_errors(x, w, dy, bad, chunk_elems=24 * 5, **kw)  # 8 chunks, the last one short
    assert whole.keys() == {"y", "rstd", "dx", "dw"}
    for k in whole:
        assert chunked[k] == pytest.approx(whole[k], rel=1e-9, abs=1e-15)
    assert whole["y"] == pytest.approx(0.01, rel=1e-6) and whole["dw"] == pytest.approx(0.02, rel=1e-6)
    assert whole["rstd"] < 1e-15 and whole["dx"] < 1e-15


def test_dx_error_is_scaled_where_dx_cancels():
    """At N = 1 the exact dx is ~0: the error is taken relative to ||rstd * w * dy|| instead."""
    x, dy, w = torch.randn(16, 1), torch.randn(16, 1), torch.ones(1)
    errs = chunked_errors(x, w, dy, {"dx": torch.full((16, 1), 1e-3)}, eps=0.5)
    scale = (torch.rsqrt(x.double() ** 2 + 0.5) * dy.double()).norm().item()
    exact = reference.rms_norm_backward(x.double(), dy.double(), w.double(), torch.rsqrt(x.double() ** 2 + 0.5)[:, 0])[
        0
    ]
    assert errs["dx"] == pytest.approx((torch.full((16, 1), 1e-3) - exact).norm().item() / scale, rel=1e-9)


def test_rel_err_fails_on_non_finite_and_on_shape():
    assert rel_err(torch.zeros(0), torch.zeros(0)) == 0.0
    assert not rel_err(torch.tensor([1.0, float("nan")]), torch.ones(2)) <= 1.0
    with pytest.raises(AssertionError, match="shape"):
        rel_err(torch.ones(2, 1), torch.ones(2))
