"""The cuTile fused residual add on a CUDA GPU against float64 (marker `gpu`; skipped without CUDA).

Every check asserts residual_out bit for bit against :func:`tilegym_rms.reference.fused_add_sum` (the
sum's rounding is part of the contract), then measures y, rstd, ds (less dres) and dw of the norm of
that sum against float64 with the plain norm's tolerances (:func:`tilegym_rms.testing.chunked_errors`).
The shapes are those of ``test_cutile_gpu.py``; the grid runs mode "pre" through the public API, the
other axes (mode, forced kernel, fp32 residual, dres or not) over its forced-kernel shapes.
"""

import pytest
import torch
from conftest import BIG_GPU_ELEMS, big_gpu_memory_if, chunked_errors, rel_err
from test_cutile_gpu import DTYPES, DW_TOL, FORCED_MODE_SHAPES, M_GRID, N_GRID, REF_CHUNK_ELEMS, Y_TOL

import tilegym_rms
from tilegym_rms import reference

pytestmark = pytest.mark.gpu

EPS = 1e-6
MN_GRID = [
    pytest.param(m, n, id=f"{m}-{n}", marks=big_gpu_memory_if(m * n >= BIG_GPU_ELEMS)) for m in M_GRID for n in N_GRID
]
FORCED = [pytest.param(m, n, marks=big_gpu_memory_if(m * n >= BIG_GPU_ELEMS)) for m, n in FORCED_MODE_SHAPES]


@pytest.fixture(autouse=True)
def _quiet_experimental(monkeypatch):
    monkeypatch.setenv("TILEGYM_RMS_SILENCE_EXPERIMENTAL", "1")


def _skip_if_too_big(m, n, dtype):
    # Seven (M, N) tensors plus an fp32 difference: 2^30 elements run in bf16 only, 2^32 not at all.
    if m * n > (1 << 31) or (m * n > (1 << 30) and dtype != torch.bfloat16):
        pytest.skip("too large for the fused add's tensors")


def _inputs(m, n, dtype, residual_dtype, with_dres):
    torch.manual_seed(m * 131 + n)
    x = torch.randn(m, n, dtype=dtype, device="cuda")
    r = torch.randn(m, n, dtype=residual_dtype, device="cuda")
    w = torch.randn(n, dtype=dtype, device="cuda")
    dy = torch.randn(m, n, dtype=dtype, device="cuda")
    dres = torch.randn(m, n, dtype=residual_dtype, device="cuda") if with_dres else None
    return x, r, w, dy, dres


def _through_backend(x, r, w, dy, dres, mode, kernel):
    """The backend itself (the only way to force a forward kernel): ``(y, res, rstd, ds, dx, dw)``."""
    from tilegym_rms import cutile

    y, res, rstd = cutile.fused_add_forward(x, r, w, EPS, 0.0, "llama", mode=mode, kernel=kernel)
    s = res if mode == "pre" else reference.fused_add_sum(x, r)
    dy = dy.to(s.dtype)
    if dres is None:
        ds, dw = cutile.backward(s, dy, w, rstd, 0.0, "llama")
    else:
        ds, dw = cutile.fused_add_backward(s, dy, dres, w, rstd, 0.0, "llama")
    return y, res, rstd, ds, ds.to(x.dtype), dw


def _through_autograd(x, r, w, dy, dres, mode):
    """``tilegym_rms.fused_add_rms_norm`` and autograd: ``(y, res, None, ds, dx, dw)`` (no rstd out)."""
    xg, rg, wg = (t.detach().requires_grad_() for t in (x, r, w))
    y, res = tilegym_rms.fused_add_rms_norm(xg, rg, wg, EPS, mode=mode, backend="cutile")
    outs, grads = ((y, res), (dy, dres)) if dres is not None else ((y,), (dy,))
    dx, dr, dw = torch.autograd.grad(outs, (xg, rg, wg), grads)
    return y.detach(), res.detach(), None, dr, dx, dw


def _check(m, n, dtype, residual_dtype=None, *, mode="pre", kernel=None, with_dres=True, autograd=None):
    residual_dtype = residual_dtype or dtype
    x, r, w, dy, dres = _inputs(m, n, dtype, residual_dtype, with_dres and mode == "pre")
    if autograd if autograd is not None else kernel is None:
        y, res, rstd, ds, dx, dw = _through_autograd(x, r, w, dy, dres, mode)
    else:
        y, res, rstd, ds, dx, dw = _through_backend(x, r, w, dy, dres, mode, kernel)
    s = reference.fused_add_sum(x, r)
    assert y.dtype == dtype and ds.dtype == residual_dtype
    if mode == "pre":
        assert res.dtype == residual_dtype and torch.equal(res, s)
    else:
        assert torch.equal(res, y)
    assert torch.equal(dx, ds.to(dtype))  # x's gradient is residual's, cast
    outputs = {"y": y, "dx": ds.float() - dres.float() if dres is not None else ds, "dw": dw}
    if rstd is not None:
        outputs["rstd"] = rstd
    err = chunked_errors(s, w, dy.to(s.dtype), outputs, eps=EPS, chunk_elems=REF_CHUNK_ELEMS)
    assert err["y"] <= Y_TOL[dtype], err
    assert err["dx"] <= Y_TOL[residual_dtype], err
    assert err.get("rstd", 0.0) <= 1e-5, err
    assert dw.dtype == w.dtype and err["dw"] <= DW_TOL, err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n", MN_GRID)
def test_fused_add_grid(m, n, dtype):
    """Mode "pre" through fused_add_rms_norm and autograd, the gradient of residual_out included."""
    _skip_if_too_big(m, n, dtype)
    if n == 1:
        pytest.skip("N = 1: dx cancels to rounding (test_cutile_gpu uses a large eps there)")
    _check(m, n, dtype)


@pytest.mark.parametrize("with_dres", [True, False], ids=["dres", "no-dres"])
@pytest.mark.parametrize("mode", ["pre", "post"])
@pytest.mark.parametrize("kernel", ["gather", "persistent", "tiles"])
@pytest.mark.parametrize("m,n", FORCED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_forced_kernel_and_mode(m, n, dtype, kernel, mode, with_dres):
    if mode == "post" and with_dres:
        pytest.skip("mode post writes no sum: its residual_out is y (dres joins dy, covered on the CPU)")
    _check(m, n, dtype, mode=mode, kernel=kernel, with_dres=with_dres)


@pytest.mark.parametrize("mode", ["pre", "post"])
@pytest.mark.parametrize("kernel", [None, "gather", "persistent", "tiles"])
@pytest.mark.parametrize("m,n", [(7, 1000), (4097, 4096), (65536, 5120), (4097, 12288), (3, 65536)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fused_add_fp32_residual_stream(m, n, dtype, kernel, mode):
    """An fp32 residual beside 16-bit x: the sum and ds in fp32, y in x's dtype."""
    if kernel in ("persistent", "tiles") and n > 16384:
        pytest.skip("the row-tile forwards take rows of at most 16384")
    _check(m, n, dtype, torch.float32, mode=mode, kernel=kernel, autograd=kernel is None)


@pytest.mark.parametrize("residual_dtype", [None, torch.float32], ids=["same", "fp32-residual"])
@pytest.mark.parametrize("m,n", [(7, 1000), (65536, 1000), (4097, 5120), (4097, 12288), (7, 65536), (300, 20000)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_writes_the_sum_over_the_residual(m, n, dtype, residual_dtype):
    """fused_add_rms_norm_ on every forward path (single tile, persistent, tile + tail, chunked gather: the
    one that reads the residual twice): the residual ends as the exact sum, y as the out-of-place y."""
    if dtype == torch.float32 and residual_dtype is not None:
        pytest.skip("same dtype")
    residual_dtype = residual_dtype or dtype
    x, r, w, _, _ = _inputs(m, n, dtype, residual_dtype, False)
    r0 = r.clone()
    with torch.no_grad():
        y_ref, s_ref = tilegym_rms.fused_add_rms_norm(x, r0, w, EPS, backend="cutile")
        y = tilegym_rms.fused_add_rms_norm_(x, r, w, EPS, backend="cutile")
    assert torch.equal(r, reference.fused_add_sum(x, r0)) and torch.equal(r, s_ref)
    assert torch.equal(y, y_ref)
    err = chunked_errors(s_ref, w, None, {"y": y}, eps=EPS, chunk_elems=REF_CHUNK_ELEMS)
    assert err["y"] <= Y_TOL[dtype], err


def test_in_place_strided_residual_rows():
    big = torch.randn(300, 1024 + 24, dtype=torch.bfloat16, device="cuda")
    r = big[:, 8 : 8 + 1024]  # rows of stride 1048: written in place through the view
    x = torch.randn(300, 1024, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(1024, dtype=torch.bfloat16, device="cuda")
    r0, before = r.clone(), big.clone()
    with torch.no_grad():
        y = tilegym_rms.fused_add_rms_norm_(x, r, w, EPS, backend="cutile")
    assert torch.equal(r, reference.fused_add_sum(x, r0))
    assert torch.equal(big[:, :8], before[:, :8]) and torch.equal(big[:, 8 + 1024 :], before[:, 8 + 1024 :])
    assert torch.equal(y, tilegym_rms.fused_add_rms_norm(x, r0, w, EPS, backend="cutile")[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n", [(7, 1000), (4097, 4096), (3, 65536)])
def test_inference_forward_matches_the_training_forward(m, n, dtype):
    """Without grad the gather kernel skips rstd (STORE_RSTD=False): the same y and sum, bit for bit."""
    x, r, w, _, _ = _inputs(m, n, dtype, dtype, False)
    with torch.no_grad():
        y, s = tilegym_rms.fused_add_rms_norm(x, r, w, EPS, backend="cutile")
    y_train, s_train = tilegym_rms.fused_add_rms_norm(x, r, w.requires_grad_(), EPS, backend="cutile")
    assert torch.equal(y, y_train) and torch.equal(s, s_train)


@pytest.mark.parametrize("mode", ["pre", "post"])
def test_fused_add_torch_compile_fullgraph(mode):
    """Inductor around the custom ops (forward, the one-pass backward) against eager and float64."""
    torch.manual_seed(4)
    w = torch.randn(2048, device="cuda", requires_grad=True)

    def block(x, r):
        y, res = tilegym_rms.fused_add_rms_norm(x, r, w, EPS, mode=mode, backend="cutile")
        return (y * 3 + res.cos()).sum()

    inputs = [torch.randn(4, 33, 2048, device="cuda", requires_grad=True) for _ in range(2)]
    block(*inputs).backward()
    eager = [t.grad.clone() for t in (*inputs, w)]
    for t in (*inputs, w):
        t.grad = None
    torch._dynamo.reset()
    torch.compile(block, fullgraph=True)(*inputs).backward()
    for g_eager, t in zip(eager, (*inputs, w), strict=True):
        assert rel_err(t.grad, g_eager) <= 1e-5
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (*inputs, w))
    y64, res64 = tilegym_rms.fused_add_rms_norm(x64, r64, w64, EPS, mode=mode, backend="torch")
    (y64 * 3 + res64.cos()).sum().backward()
    for got, want in zip((*inputs, w), (x64, r64, w64), strict=True):
        assert rel_err(got.grad, want.grad) <= 1e-4


def test_in_place_under_torch_compile():
    x = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(64, 4096, dtype=torch.float32, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    r_eager = r.clone()
    with torch.no_grad():
        y_eager = tilegym_rms.fused_add_rms_norm_(x, r_eager, w, EPS, backend="cutile")
        torch._dynamo.reset()
        y = torch.compile(lambda x, r: tilegym_rms.fused_add_rms_norm_(x, r, w, EPS, backend="cutile"), fullgraph=True)(
            x, r
        )
    assert torch.equal(r, r_eager) and torch.equal(y, y_eager)


@pytest.mark.parametrize("mode", ["pre", "post"])
@pytest.mark.parametrize("m,n", [(7, 20000), (129, 65536)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_split_kernel(m, n, dtype, mode, split_forward_finishes):
    """Rows wider than one chunk split over a block per chunk (kernel "split"), each block adding and, in mode
    "pre", storing its own chunk's sum."""
    _check(m, n, dtype, mode=mode, kernel="split", with_dres=mode == "pre")
