"""The values a tuning candidate computes, against float64: the check ``tune_table`` makes of every candidate
before it times one.

A sweep times launches the GPU tests may never have run (another tile, another hint, another kernel for that
width), and a fast wrong launch would win. Each candidate, installed as the one-entry table that serves every
row count, first computes its op on random rows; its relative errors against :mod:`tilegym_rms.testing`'s
float64 references must stay within the benchmarks' limits (``bench.common.base.tolerance``), or the candidate
is not timed and the run records why.
"""

from __future__ import annotations

import torch

from bench.common import base
from tilegym_rms import testing
from tilegym_rms.cutile.tuning import build

# Rows of the check: odd, so that the last row tile and the grid-stride walk end part-way, and few, so that the
# float64 reference stays cheap beside the timing. The candidate's table serves every row count, so these rows
# run its launch.
CHECK_ROWS = 1037
EPS = base.EPS


def errors(cutile, op: str, dtype: torch.dtype, n: int, w: torch.Tensor, rows: int = CHECK_ROWS) -> dict[str, float]:
    """Relative errors against float64 of the outputs of ``cutile``'s host call for ``op`` (a ``tune_table`` op)
    on random ``rows x n`` inputs, under the tuning table in effect: the forward's ``y`` and ``rstd``; the
    backward's ``dx`` and ``dw`` (fed the forward's rstd); the fused forward's ``y``, ``res`` and ``rstd``; the
    qk op's forward and backward outputs for q and for k (``q.y``, ..., ``k.dw``), on the views the product
    hands the host."""
    device = w.device
    gen = torch.Generator(device=device).manual_seed(n)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    if op == "qk":
        from bench.tools.tune_table import qk_product_views  # here: tune_table imports this module

        hq, hk = build.QK_SWEEP_HEADS
        tokens = max(1, rows // (hq + hk))
        q, k = (qk_product_views(randn(tokens, h, n)) for h in (hq, hk))
        yq, yk, rq, rk = cutile.qk_forward(q, k, w, w, EPS, 0.0, "llama")
        dyq, dyk = randn(*q.shape), randn(*k.shape)
        dq, dk, dwq, dwk = cutile.qk_backward(q, k, dyq, dyk, w, w, rq, rk, 0.0, "llama")
        out = {}
        for name, t, y, r, dy, dt, dw in (("q", q, yq, rq, dyq, dq, dwq), ("k", k, yk, rk, dyk, dk, dwk)):
            outputs = {"y": y, "rstd": r, "dx": dt, "dw": dw}
            errs = testing.chunked_errors(t.reshape(-1, n), w, dy.reshape(-1, n), outputs, eps=EPS)
            out.update({f"{name}.{key}": v for key, v in errs.items()})
        return out
    x = randn(rows, n)
    if op == "fused_forward":
        r = randn(rows, n)
        y, res, rstd = cutile.fused_add_forward(x, r, w, EPS, 0.0, "llama", mode="pre")
        return testing.fused_add_errors(x, r, w, EPS, {"y": y, "res": res, "rstd": rstd})
    y, rstd = cutile.forward(x, w, EPS, 0.0, "llama")
    if op == "forward":
        return testing.chunked_errors(x, w, None, {"y": y, "rstd": rstd}, eps=EPS)
    dy = randn(rows, n)
    dx, dw = cutile.backward(x, dy, w, rstd, 0.0, "llama")
    return testing.chunked_errors(x, w, dy, {"dx": dx, "dw": dw}, eps=EPS)


def beyond_tolerance(errs: dict[str, float], dtype_name: str) -> dict[str, float]:
    """The errors of :func:`errors` over the benchmarks' limit for ``dtype_name`` inputs (NaN included)."""
    return {k: v for k, v in errs.items() if not v <= base.tolerance(k.rsplit(".", 1)[-1], dtype_name)}
