"""qk_rms_norm's cuTile kernels on a CUDA GPU against float64 (marker `gpu`; skipped without CUDA).

Structured like test_cutile_gpu.py, whose tolerances and fixture it reuses. Variants compiled: one per
(head dim, dtype, rows bucket) and kernel direction, so the grid stays at two row counts.
"""

import pytest
import torch
from conftest import chunked_errors
from test_cutile_gpu import DW_TOL, Y_TOL, _quiet_experimental_and_release_memory  # noqa: F401  (autouse)

import tilegym_rms
from tilegym_rms import reference
from tilegym_rms.ops import qk as qk_ops

pytestmark = pytest.mark.gpu

HEAD_DIMS = [64, 96, 128, 256]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = ["contiguous", "transposed", "qkv_slice"]
HQ, HK = 16, 4  # GQA


def _layout(name, b, s, d, dtype, hq=HQ, hk=HK, seed=0):
    """q and k as HF attention makes them: projection outputs viewed (B, S, H, D), or transposed to
    (B, H, S, D), or the q / k slices of one fused qkv projection (strided rows)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, generator=g, device="cuda").to(dtype)
    q, k = qkv[..., : hq * d].view(b, s, hq, d), qkv[..., hq * d : (hq + hk) * d].view(b, s, hk, d)
    if name == "qkv_slice":
        return q, k
    q, k = q.contiguous(), k.contiguous()
    return (q, k) if name == "contiguous" else (q.transpose(1, 2), k.transpose(1, 2))


def _gradient(name, x):
    """An output gradient for ``x`` as autograd hands it back: contiguous in x's dims, dense like the forward
    output (``like_output``: in x's memory order), or ``transposed_back`` from a consumer of ``y.transpose(1, 2)``
    (HF attention after QK-norm: a contiguous ``(B, H, S, D)`` gradient, transposed)."""
    if name == "contiguous":
        return torch.randn(x.shape, dtype=x.dtype, device=x.device)
    if name == "like_output":
        return qk_ops._empty_in_order(x).copy_(torch.randn(x.shape, dtype=x.dtype, device=x.device))
    assert name == "transposed_back"
    return torch.randn(x.transpose(1, 2).shape, dtype=x.dtype, device=x.device).transpose(1, 2)


def _check(q, k, *, weight=True, offset=0.0, casting_mode="llama", eps=1e-6, compiled=False, grad="contiguous"):
    d, dtype = q.shape[-1], q.dtype
    torch.manual_seed(d)
    wq, wk = (torch.randn(d, dtype=dtype, device="cuda") if weight else None for _ in range(2))
    leaves = [t.detach().requires_grad_() for t in (q, k)] + [w.requires_grad_() for w in (wq, wk) if w is not None]
    dyq, dyk = _gradient(grad, q), _gradient(grad, k)
    kw = dict(offset=offset, casting_mode=casting_mode, backend="cutile")

    def fn(q, k, *w):
        return tilegym_rms.qk_rms_norm(q, k, *(w or (None, None)), eps, **kw)

    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    yq, yk = fn(*leaves)
    grads = torch.autograd.grad((yq, yk), leaves, (dyq, dyk))
    dq, dk, dws = grads[0], grads[1], (grads[2:] if weight else (None, None))
    for x, w, dy, y, dx, dw in ((q, wq, dyq, yq, dq, dws[0]), (k, wk, dyk, yk, dk, dws[1])):
        outputs = {"y": y, "dx": dx} | ({"dw": dw} if weight else {})
        err = chunked_errors(x, w, dy, outputs, eps=eps, offset=offset, casting_mode=casting_mode)
        assert y.shape == x.shape and dx.shape == x.shape and y.dtype == dtype, err
        assert err["y"] <= Y_TOL[dtype] and err["dx"] <= Y_TOL[dtype], err
        if weight:
            assert dw.dtype == w.dtype and err["dw"] <= DW_TOL, err
    return yq, yk, wq, wk


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("b,s", [(1, 7), (4, 2048)])  # few rows (small tiles), and 163840 rows of q and k
def test_qk_forward_backward(b, s, d, dtype, layout):
    q, k = _layout(layout, b, s, d, dtype)
    yq, yk, wq, wk = _check(q, k)
    # The values rms_norm gives each tensor, up to the order of a row's fp32 sum (the plain kernels hold
    # rows in other tile shapes): a rounding of rstd can move an output by an ulp or two.
    eps = torch.finfo(dtype).eps
    for x, w, y in ((q, wq, yq), (k, wk, yk)):
        torch.testing.assert_close(
            y, tilegym_rms.rms_norm(x, w, casting_mode="llama", backend="cutile"), rtol=4 * eps, atol=4 * eps
        )
        assert y.is_contiguous() == (layout != "transposed")  # dense in the input's dim order


# (head dim, q heads, k heads): every head dim's tile class beside GQA 1:1 to 8:1 and head counts that are not
# powers of two (28 and 40 query heads: tiles of 4 and 8 heads).
HEADS_BY_D = [(64, 8, 8), (80, 40, 8), (96, 28, 4), (128, 32, 8), (128, 64, 8), (256, 16, 4)]
GRADIENTS = ["contiguous", "transposed_back", "like_output"]


@pytest.mark.parametrize("grad", GRADIENTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,hq,hk", HEADS_BY_D)
def test_qk_layouts_and_gradient_layouts(d, hq, hk, dtype, layout, grad):
    """Values and gradients against float64 for every input layout and every gradient layout (the kernels read
    them all in place, tiles split over tokens and heads), 999 tokens (odd: partial tiles along G and H)."""
    q, k = _layout(layout, 3, 333, d, dtype, hq, hk)
    _check(q, k, grad=grad)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_qk_forward_of_one_tile_per_block(d, layout):
    """A tuning entry may run the forward one tile per block (fwd_blocks_per_sm 0: no walk; q's tiles, then
    k's): values and gradients against float64, 999 tokens (partial tiles along G and H)."""
    from dataclasses import asdict

    from tilegym_rms.cutile import config, tuning
    from tilegym_rms.cutile.tuning import build

    doc = build.new_doc("sm90_132sm", "test", (9, 0), 132, "measured", "test")
    entry = config.QKCandidate(32 if d <= 128 else 16, 64, 0, 2, 8, 2)
    build.set_runs(doc, "qk", "bf16", config.next_pow2(d), [{"m": 1, "winner": asdict(entry), "gbps": {}}])
    q, k = _layout(layout, 3, 333, d, torch.bfloat16, 28, 4)
    with tuning.use_table(doc):
        _check(q, k)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,tail", [(80, 16), (96, 32), (192, 64)])
@pytest.mark.parametrize("tokens", [999, 8192])  # partial tiles along G and H; many tiles per block
def test_qk_head_as_a_tile_and_a_tail(monkeypatch, tokens, d, tail, dtype, layout):
    """A head of 80, 96 or 192 columns held as a power-of-two tile and a tail tile (no padded columns) by both
    kernels (qk_fwd_min_tail_n, qk_bwd_min_tail_n), as they are launched; values and gradients against float64 in
    every layout, the gradient as a transposing consumer hands it back, both weights' dw through the partial
    buffer's head and tail columns."""
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import config
    from tilegym_rms.cutile.host import common
    from tilegym_rms.experimental import kernel_name

    launched = {}
    real = common.launcher()

    def launch(kernel, grid, args, *rest):
        launched[kernel_name(kernel)] = args
        return real(kernel, grid, args, *rest)

    monkeypatch.setattr(common, "launcher", lambda: launch)
    q, k = _layout(layout, 1, tokens, d, dtype, 28, 4)
    cutile.clear_caches()
    try:
        with config.override(qk_fwd_min_tail_n=16, qk_bwd_min_tail_n=16):
            _check(q, k, grad="transposed_back")
    finally:
        cutile.clear_caches()
    # (TILE_N, TAIL_N): the forward's constants end with CAST, HAS_WQ, HAS_WK, EXACT_D, WALK; the backward's with
    # HAS_WQ, HAS_WK.
    assert tuple(launched["qk_rms_norm_fwd"][-7:-5]) == (d - tail, tail)
    assert tuple(launched["qk_rms_norm_bwd"][-4:-2]) == (d - tail, tail)


@pytest.mark.parametrize("grad", GRADIENTS)
def test_qk_gradient_layouts_at_many_rows(grad):
    """A fused qkv slice of 8192 tokens, 32 and 8 heads (327680 rows): many tiles per block."""
    q, k = _layout("qkv_slice", 4, 2048, 128, torch.bfloat16, 32, 8)
    _check(q, k, grad=grad)


def test_qk_gradient_of_a_transposing_consumer_is_read_in_place(monkeypatch):
    """HF attention: q_norm, then ``.transpose(1, 2)`` into (B, H, S, D) math; the backward kernel gets the
    gradient autograd hands back, (B, H, S, D)-contiguous and transposed, without a copy."""
    from tilegym_rms.cutile.host import common

    seen = []
    real = common.launcher()
    monkeypatch.setattr(
        common, "launcher", lambda: lambda kernel, g, args, *a: seen.append(args) or real(kernel, g, args, *a)
    )
    q, k = (t.detach().requires_grad_() for t in _layout("qkv_slice", 2, 301, 128, torch.bfloat16, 32, 8))
    yq, yk = tilegym_rms.qk_rms_norm(q, k, backend="cutile")
    cq = torch.randn(2, 32, 301, 128, dtype=torch.bfloat16, device="cuda")
    ck = torch.randn(2, 8, 301, 128, dtype=torch.bfloat16, device="cuda")
    ((yq.transpose(1, 2).float() * cq).sum() + (yk.transpose(1, 2).float() * ck).sum()).backward()
    dyq, dyk = seen[1][0], seen[1][1]  # the backward kernel's gradient arguments
    assert dyq.shape == (2, 301, 32, 128) and dyq.stride() == cq.transpose(1, 2).stride()
    assert dyk.shape == (2, 301, 8, 128) and dyk.stride() == ck.transpose(1, 2).stride()
    for x, c, dx in ((q, cq, q.grad), (k, ck, k.grad)):
        dy = c.transpose(1, 2)
        err = chunked_errors(x.detach(), None, dy, {"dx": dx}, eps=1e-6, offset=0.0, casting_mode="llama")
        assert err["dx"] <= Y_TOL[torch.bfloat16], err


@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
@pytest.mark.parametrize("weight,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qk_casting_weight_offset(dtype, casting_mode, weight, offset):
    q, k = _layout("qkv_slice", 2, 300, 128, dtype)
    _check(q, k, weight=weight, offset=offset, casting_mode=casting_mode)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_qk_under_torch_compile(d, dtype, layout):
    q, k = _layout(layout, 2, 1000, d, dtype)
    _check(q, k, compiled=True)


def test_qk_rows_with_gaps_between_batches_only():
    """A (G, H, D) view with H > G: the host hands the kernels the transposed view (see cutile)."""
    big = torch.randn(3, 2048 * 8 * 128 + 64, dtype=torch.bfloat16, device="cuda")
    q = big[:, : 2048 * 8 * 128].view(3, 2048, 8, 128)
    k = torch.randn(3, 2048, 2, 128, dtype=torch.bfloat16, device="cuda")
    _check(q, k)


def test_qk_one_weight_and_mixed_weight_dtypes():
    q, k = _layout("contiguous", 2, 512, 128, torch.bfloat16)
    w32, w16 = torch.randn(128, device="cuda"), torch.randn(128, device="cuda", dtype=torch.bfloat16)
    for wq, wk in ((w32, w16), (w16, None), (None, w16)):
        leaves = [t.detach().requires_grad_() for t in (q, k)]
        ws = [w.detach().requires_grad_() if w is not None else None for w in (wq, wk)]
        yq, yk = tilegym_rms.qk_rms_norm(*leaves, *ws, backend="cutile")
        (yq.float().square().sum() + yk.float().sum()).backward()
        for x, w, y, dy in ((q, wq, yq, 2 * yq.float()), (k, wk, yk, torch.ones_like(yk))):
            w64 = w.double() if w is not None else None
            ref, rstd = reference.rms_norm_forward(x.double(), w64, 1e-6)
            assert (y.double() - ref).norm() / ref.norm() <= Y_TOL[torch.bfloat16]
            if w is not None:
                dw = ws[0 if x is q else 1].grad
                ref_dw = reference.rms_norm_backward(x.double(), dy.double(), w64, rstd)[1]
                assert dw.dtype == w.dtype and (dw.double() - ref_dw).norm() / ref_dw.norm() <= DW_TOL


def test_qk_dw_is_deterministic():
    q, k = _layout("qkv_slice", 4, 4096, 128, torch.bfloat16)
    w = [torch.randn(128, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2)]
    dy = (
        torch.randn(q.shape, dtype=torch.bfloat16, device="cuda"),
        torch.randn(k.shape, dtype=torch.bfloat16, device="cuda"),
    )
    runs = [torch.autograd.grad(tilegym_rms.qk_rms_norm(q, k, *w, backend="cutile"), w, dy) for _ in range(3)]
    assert all(torch.equal(r[0], runs[0][0]) and torch.equal(r[1], runs[0][1]) for r in runs)


def test_qk_is_one_launch_each_way(monkeypatch):
    """Forward: one kernel for q and k; backward: one kernel and one dw reduction for both weights."""
    from tilegym_rms.cutile.host import common

    launched = []
    real = common.launcher()
    monkeypatch.setattr(
        common, "launcher", lambda: lambda kernel, *a, **kw: launched.append(kernel) or real(kernel, *a, **kw)
    )
    q, k = (t.requires_grad_() for t in _layout("contiguous", 2, 1024, 128, torch.bfloat16))
    w = [torch.randn(128, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2)]
    yq, yk = tilegym_rms.qk_rms_norm(q, k, *w, backend="cutile")
    (yq.float().sum() + yk.float().sum()).backward()
    kernels = common.kernels()
    assert launched == [kernels.qk_rms_norm_fwd, kernels.qk_rms_norm_bwd, kernels.rms_norm_dw_reduce]
