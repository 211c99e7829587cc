"""qk_rms_norm on the CPU: values against float64, layouts (read in place, outputs in the inputs' dim order),
GQA head counts, autograd, errors, torch.compile, and the cuTile host plumbing with the kernels emulated."""

import pytest
import torch
from conftest import rel_err

import tilegym_rms
from tilegym_rms import ops, reference
from tilegym_rms.ops import qk as qk_ops

B, S, HQ, HK = 2, 5, 4, 2


def _fp64_norm(x, w, eps, offset=0.0):
    """Independent float64 math: x / sqrt(mean(x^2) + eps) * (offset + w)."""
    x = x.double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if w is None else y * (offset + w.double())


def _qkv(d, dtype=torch.float64, hq=HQ, hk=HK, seed=0):
    """The q and k slices of a fused qkv projection output, as HF models view them: (B, S, H, D), rows strided."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, S, (hq + 2 * hk) * d, generator=g).to(dtype)
    return qkv[..., : hq * d].view(B, S, hq, d), qkv[..., hq * d : (hq + hk) * d].view(B, S, hk, d)


def _layout(name, d, dtype=torch.float64, hq=HQ, hk=HK):
    q, k = _qkv(d, dtype, hq, hk)
    if name == "contiguous":  # q_proj(x).view(B, S, H, D)
        return q.contiguous(), k.contiguous()
    if name == "transposed":  # ... .transpose(1, 2): (B, H, S, D), not contiguous
        return q.contiguous().transpose(1, 2), k.contiguous().transpose(1, 2)
    if name == "qkv_slice":
        return q, k
    if name == "qkv_slice_transposed":
        return q.transpose(1, 2), k.transpose(1, 2)
    if name == "batch_gap":  # rows dense within a batch, a gap between batches
        big_q, big_k = torch.randn(B, S * hq * d + 7).to(dtype), torch.randn(B, S * hk * d + 5).to(dtype)
        return big_q[:, : S * hq * d].view(B, S, hq, d), big_k[:, : S * hk * d].view(B, S, hk, d)
    if name == "needs_copy":  # a head dim read with stride 2: no view with dense rows exists
        return torch.randn(B, S, hq, 2 * d).to(dtype)[..., ::2], torch.randn(B, S, hk, 2 * d).to(dtype)[..., ::2]
    raise ValueError(name)


LAYOUTS = ["contiguous", "transposed", "qkv_slice", "qkv_slice_transposed", "batch_gap", "needs_copy"]
IN_PLACE_LAYOUTS = LAYOUTS[:-1]


def _dense_in_stride_order(out, like):
    """``out`` is dense and lists its dims in ``like``'s memory order (what the docstring promises)."""
    order = sorted(range(like.dim() - 1), key=lambda i: -like.stride(i))
    return out.permute(*order, out.dim() - 1).is_contiguous()


# ------------------------------------------------------------------------------------------------
# Values
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_values_are_rms_norm_of_each_and_close_to_fp64(dtype, casting_mode, offset):
    q, k = _layout("qkv_slice", 64, dtype)
    wq, wk = torch.randn(64).to(dtype), torch.randn(64).to(dtype)
    kw = dict(offset=offset, casting_mode=casting_mode)
    yq, yk = tilegym_rms.qk_rms_norm(q, k, wq, wk, 1e-5, **kw)
    assert torch.equal(yq, tilegym_rms.rms_norm(q, wq, 1e-5, **kw))
    assert torch.equal(yk, tilegym_rms.rms_norm(k, wk, 1e-5, **kw))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(yq, _fp64_norm(q, wq, 1e-5, offset)) <= tol
    assert rel_err(yk, _fp64_norm(k, wk, 1e-5, offset)) <= tol
    assert yq.dtype == yk.dtype == dtype


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hq,hk", [(4, 2), (8, 1), (3, 3)])
def test_layouts_and_head_counts(layout, hq, hk):
    q, k = _layout(layout, 16, hq=hq, hk=hk)
    wq, wk = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    yq, yk = tilegym_rms.qk_rms_norm(q, k, wq, wk)
    assert yq.shape == q.shape and yk.shape == k.shape
    assert rel_err(yq, _fp64_norm(q, wq, 1e-6)) <= 1e-12 and rel_err(yk, _fp64_norm(k, wk, 1e-6)) <= 1e-12
    assert _dense_in_stride_order(yq, q) and _dense_in_stride_order(yk, k)


def test_a_transposed_input_gives_a_transposed_output_of_the_projection_layout():
    q, k = _layout("transposed", 16)
    yq, _ = tilegym_rms.qk_rms_norm(q, k)
    assert not yq.is_contiguous() and yq.transpose(1, 2).is_contiguous()
    q, k = _layout("qkv_slice", 16)
    yq, _ = tilegym_rms.qk_rms_norm(q, k)
    assert yq.is_contiguous()  # the slice's gaps are not kept


# The (A, G, H) views the backend's qk kernels get, by input layout (a head count h): one run of rows for dense
# tensors, tokens x heads for fused qkv slices, batches x (tokens x heads) for rows with gaps between batches.
VIEW_SHAPES = {
    "contiguous": lambda h: (1, 1, B * S * h),
    "transposed": lambda h: (1, 1, B * S * h),
    "qkv_slice": lambda h: (1, B * S, h),
    "qkv_slice_transposed": lambda h: (1, B * S, h),
    "batch_gap": lambda h: (1, B, S * h),
    "needs_copy": lambda h: (1, 1, B * S * h),
}


def _gradient(name, x):
    """An output gradient for ``x`` (logical shape as x) in a layout autograd hands back: dense like the forward
    output (``like_output``), contiguous in x's logical dims, or ``transposed_back``: from a consumer of
    ``y.transpose(1, 2)`` whose gradient is a contiguous ``(B, H, S, D)`` tensor (HF attention after QK-norm)."""
    if name == "like_output":
        return qk_ops._empty_in_order(x).copy_(torch.randn(x.shape, dtype=x.dtype))
    if name == "contiguous":
        return torch.randn(x.shape, dtype=x.dtype)
    assert name == "transposed_back"
    return torch.randn(x.transpose(1, 2).shape, dtype=x.dtype).transpose(1, 2)


# (q layout, gradient layout) -> the backward's (A, G, H) by head count: the gradient transposed back from
# (B, H, S, D), or contiguous beside a transposed q, has three runs (batch, tokens, heads): read in place too.
BACKWARD_VIEW_SHAPES = {
    ("contiguous", "like_output"): lambda h: (1, 1, B * S * h),
    ("contiguous", "contiguous"): lambda h: (1, 1, B * S * h),
    ("contiguous", "transposed_back"): lambda h: (B, S, h),
    ("transposed", "like_output"): lambda h: (1, 1, B * S * h),
    ("transposed", "contiguous"): lambda h: (B, S, h),
    ("qkv_slice", "like_output"): lambda h: (1, B * S, h),
    ("qkv_slice", "contiguous"): lambda h: (1, B * S, h),
    ("qkv_slice", "transposed_back"): lambda h: (B, S, h),
    ("qkv_slice_transposed", "contiguous"): lambda h: (B, S, h),
    ("batch_gap", "like_output"): lambda h: (1, B, S * h),
    ("batch_gap", "transposed_back"): lambda h: (B, S, h),
}


class _RecordingQKBackend:
    """A backend with the qk capability that records the views it gets and computes with the reference on them
    (outputs contiguous ``(A, G, H, D)``, as the protocol asks)."""

    SUPPORTED_DTYPES = (torch.float32, torch.float64)

    def __init__(self):
        self.calls = []

    def qk_forward(self, q, k, q_weight, k_weight, eps, offset, casting_mode):
        self.calls.append(("forward", q, k))
        (yq, rq), (yk, rk) = (reference.rms_norm_forward(t, w, eps, offset, casting_mode) for t, w in
                              ((q, q_weight), (k, k_weight)))  # fmt: skip
        return yq.contiguous(), yk.contiguous(), rq.contiguous(), rk.contiguous()

    def qk_backward(self, q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset, casting_mode):
        self.calls.append(("backward", q, k, dq_out, dk_out, q_rstd, k_rstd))
        (dq, dwq), (dk, dwk) = (reference.rms_norm_backward(t, dy, w, r, offset) for t, dy, w, r in
                                ((q, dq_out, q_weight, q_rstd), (k, dk_out, k_weight, k_rstd)))  # fmt: skip
        return dq.contiguous(), dk.contiguous(), dwq, dwk


@pytest.fixture
def recording_backend(monkeypatch):
    backend = _RecordingQKBackend()
    monkeypatch.setattr(qk_ops, "_backend", lambda x, name: backend)
    return backend


def _assert_view_of(view, t, shape, like=None):
    """``view`` is the ``(A, G, H, D)`` view of ``shape`` over ``t``'s own memory, its rows in the stride order
    of ``like`` (default ``t``: a gradient's rows follow its input's)."""
    d, order = t.shape[-1], qk_ops._stride_order(t if like is None else like)
    assert tuple(view.shape) == (*shape, d) and view.stride(3) == 1
    assert view.data_ptr() == t.data_ptr()
    assert torch.equal(view.reshape(-1, d), qk_ops._in_order(t, order).reshape(-1, d))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_hands_the_backend_views_of_the_inputs_own_memory(recording_backend, layout):
    q, k = _layout(layout, 16)
    wq, wk = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    yq, yk = tilegym_rms.qk_rms_norm(q, k, wq, wk)
    ((_, q4, k4),) = recording_backend.calls
    for x, view, h in ((q, q4, HQ), (k, k4, HK)):
        shape = VIEW_SHAPES[layout](h)
        if layout == "needs_copy":  # a head dim read with stride 2: copied once, dense
            assert view.data_ptr() != x.data_ptr() and view.is_contiguous() and tuple(view.shape[:3]) == shape
        else:
            _assert_view_of(view, x, shape)
    assert rel_err(yq, _fp64_norm(q, wq, 1e-6)) <= 1e-12 and rel_err(yk, _fp64_norm(k, wk, 1e-6)) <= 1e-12
    assert _dense_in_stride_order(yq, q) and _dense_in_stride_order(yk, k)


@pytest.mark.parametrize("layout,grad", list(BACKWARD_VIEW_SHAPES))
def test_backward_hands_the_backend_views_of_the_gradients_own_memory(recording_backend, layout, grad):
    q, k = _layout(layout, 16)
    wq, wk = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    _, _, rq, rk = qk_ops._qk_forward(q, k, wq, wk, 1e-6, 0.0, "llama", "cutile")
    dyq, dyk = _gradient(grad, q), _gradient(grad, k)
    dq, dk, dwq, dwk = qk_ops._qk_backward(q, k, dyq, dyk, wq, wk, rq, rk, 0.0, "llama", "cutile")
    _, q4, k4, dq4, dk4, rq3, rk3 = recording_backend.calls[-1]
    for x, dy, view, dview, r, h in ((q, dyq, q4, dq4, rq3, HQ), (k, dyk, k4, dk4, rk3, HK)):
        shape = BACKWARD_VIEW_SHAPES[layout, grad](h)
        _assert_view_of(view, x, shape)
        _assert_view_of(dview, dy, shape, like=x)
        assert tuple(r.shape) == shape and r.is_contiguous()
    for x, dy, w, dx, dw in ((q, dyq, wq, dq, dwq), (k, dyk, wk, dk, dwk)):
        ref_dx, ref_dw = reference.rms_norm_backward(x, dy, w, reference.rms_norm_forward(x, w, 1e-6)[1])
        assert rel_err(dx, ref_dx) <= 1e-12 and rel_err(dw, ref_dw) <= 1e-12 and _dense_in_stride_order(dx, x)


def test_autograd_hands_the_backend_the_gradient_of_a_transposing_consumer_in_place(recording_backend):
    """HF attention: q_norm on the (B, S, H, D) projection view, then ``.transpose(1, 2)`` into (B, H, S, D)
    math; the gradient comes back (B, H, S, D)-contiguous, transposed: read as (B, S, H, D) without a copy."""
    q, k = (t.detach().requires_grad_() for t in _layout("qkv_slice", 16))
    yq, yk = tilegym_rms.qk_rms_norm(q, k)
    cq, ck = torch.randn(B, HQ, S, 16, dtype=torch.float64), torch.randn(B, HK, S, 16, dtype=torch.float64)
    ((yq.transpose(1, 2) * cq).sum() + (yk.transpose(1, 2) * ck).sum()).backward()
    _, _, _, dq4, dk4, _, _ = recording_backend.calls[-1]
    for view, c in ((dq4, cq), (dk4, ck)):
        assert view.shape == (B, S, c.shape[1], 16) and view.stride() == c.transpose(1, 2).stride()
    ref_q = torch.autograd.grad((tilegym_rms.rms_norm(q, None).transpose(1, 2) * cq).sum(), q)[0]
    assert rel_err(q.grad, ref_q) <= 1e-12


def test_views_copy_only_layouts_of_more_than_three_runs():
    x = torch.randn(3, 4, 5, 6, 8)[:, :3, :4, :5]  # four strided leading dims
    (view,), shape = qk_ops._qk_views([x])
    assert shape == (1, 1, 3 * 3 * 4 * 5) and view.data_ptr() != x.data_ptr()
    assert torch.equal(view.reshape(-1, 8), x.reshape(-1, 8))
    three = torch.randn(3, 4, 5, 8)[:, :3, :4]
    (view,), shape = qk_ops._qk_views([three])
    assert shape == (3, 3, 4) and view.data_ptr() == three.data_ptr()
    broadcast = torch.randn(8).expand(2, 3, 4, 8)  # a broadcast gradient: rows overlap, copied
    (_, view), shape = qk_ops._qk_views([torch.randn(2, 3, 4, 8), broadcast])
    assert shape == (1, 1, 24) and view.is_contiguous() and torch.equal(view.reshape(-1, 8), broadcast.reshape(-1, 8))


def test_rows_apart_rejects_overlapping_and_gathered_rows():
    base = torch.randn(4, 8, 16)
    assert qk_ops._rows_apart(base)
    assert not qk_ops._rows_apart(base[..., ::2])  # last dim strided
    assert not qk_ops._rows_apart(torch.randn(16).expand(4, 8, 16))  # a broadcast gradient: every row the same
    assert not qk_ops._rows_apart(torch.randn(40, 16).as_strided((4, 8, 16), (16, 16, 1)))  # rows shared


def test_weights_none_or_one_of_them():
    q, k = _layout("qkv_slice", 16)
    w = torch.randn(16, dtype=torch.float64)
    for wq, wk in ((None, None), (w, None), (None, w)):
        yq, yk = tilegym_rms.qk_rms_norm(q, k, wq, wk)
        assert rel_err(yq, _fp64_norm(q, wq, 1e-6)) <= 1e-12 and rel_err(yk, _fp64_norm(k, wk, 1e-6)) <= 1e-12


@pytest.mark.parametrize("empty", ["q", "k", "head_dim"])
def test_empty_inputs(empty):
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 1, 8)
    if empty == "q":
        q = q[:0]
    elif empty == "k":
        k = k[:, :0]
    else:
        q, k = q[..., :0], k[..., :0]
    d = q.shape[-1]
    w = (torch.randn(d, requires_grad=True), torch.randn(d, requires_grad=True))
    q, k = q.requires_grad_(), k.requires_grad_()
    yq, yk = tilegym_rms.qk_rms_norm(q, k, *w)
    assert yq.shape == q.shape and yk.shape == k.shape
    (yq.sum() + yk.square().sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert w[0].grad.shape == (d,) and w[1].grad.shape == (d,)
    if empty != "k":
        assert rel_err(yk, _fp64_norm(k.detach(), w[1].detach(), 1e-6)) <= 1e-6


# ------------------------------------------------------------------------------------------------
# Autograd
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "qkv_slice", "needs_copy"])
@pytest.mark.parametrize("casting_mode,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.5)])
def test_autograd_gradcheck_qk(layout, casting_mode, offset):
    q, k = (t.detach().requires_grad_() for t in _layout(layout, 8))
    wq, wk = (torch.randn(8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    fn = lambda q, k, wq, wk: tilegym_rms.qk_rms_norm(q, k, wq, wk, 1e-5, offset=offset, casting_mode=casting_mode)
    assert torch.autograd.gradcheck(fn, (q, k, wq, wk))


def test_autograd_gradgradcheck_qk():
    q, k = (t.detach().requires_grad_() for t in _layout("transposed", 8))
    wq, wk = (torch.randn(8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradgradcheck(lambda *a: tilegym_rms.qk_rms_norm(*a, 1e-5, offset=0.5), (q, k, wq, wk))


def test_autograd_matches_rms_norm_of_each_with_one_output_unused():
    q, k = _layout("qkv_slice_transposed", 16, torch.float32)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    wq, wk = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    yq, _ = tilegym_rms.qk_rms_norm(q, k, wq, wk)
    dy = torch.randn(yq.shape)
    grads = torch.autograd.grad(yq, (q, k, wq, wk), dy, allow_unused=True, materialize_grads=True)
    ref = torch.autograd.grad(tilegym_rms.rms_norm(q, wq), (q, wq), dy)
    assert torch.equal(grads[0], ref[0])
    assert rel_err(grads[2], ref[1]) <= 1e-6  # dw sums the rows in memory order, rms_norm in logical order
    assert not grads[1].any() and not grads[3].any()


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k,kw,exc,match",
    [
        (torch.randn(2, 3, 1, 16), {}, ValueError, r"k must have the head dim of q \(last dim 8\)"),
        (torch.randn(2, 3, 1, 8, dtype=torch.float64), {}, TypeError, "q and k must have one dtype"),
        ([1.0], {}, TypeError, "k must be a torch.Tensor"),
        (torch.randn(2, 3, 1, 8), {"q_weight": torch.ones(4)}, ValueError, r"^q_weight must .* dim of q\), got \(4,\)"),
        (torch.randn(2, 3, 1, 8), {"k_weight": torch.ones(4)}, ValueError, r"^k_weight must .* dim of k\), got \(4,\)"),
        (
            torch.randn(2, 3, 1, 8),
            {"k_weight": torch.ones(8, dtype=torch.int32)},
            TypeError,
            "^k_weight must be a float",
        ),
        (torch.randn(2, 3, 1, 8), {"q_weight": torch.ones(8), "offset": 1.0}, ValueError, "with k_weight=None it"),
        (torch.randn(2, 3, 1, 8), {"casting_mode": "fp32"}, ValueError, "casting_mode must be one of"),
        (torch.randn(2, 3, 1, 8), {"backend": "cuda"}, ValueError, "unknown backend 'cuda'"),
    ],
)
def test_errors_say_what_is_allowed(k, kw, exc, match):
    with pytest.raises(exc, match=match):
        tilegym_rms.qk_rms_norm(torch.randn(2, 3, 4, 8), k, **kw)


def test_errors_name_q_where_q_is_wrong():
    with pytest.raises(TypeError, match="^q must be a torch.Tensor, got list"):
        tilegym_rms.qk_rms_norm([1.0], torch.randn(2, 8))
    with pytest.raises(ValueError, match="^q and q_weight must be on the same device, got q on cpu, q_weight on meta"):
        tilegym_rms.qk_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8, device="meta"))


# ------------------------------------------------------------------------------------------------
# torch.compile (the custom ops: their fake outputs must have the real outputs' strides)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "qkv_slice"])
def test_compile_fullgraph_matches_eager(layout):
    q, k = (t.requires_grad_() for t in _layout(layout, 32, torch.float32))
    wq, wk = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)

    def block(q, k, wq, wk):
        yq, yk = tilegym_rms.qk_rms_norm(q, k, wq, wk, offset=0.25)
        return (yq * 2).sin().sum() + yk.cos().sum()  # Inductor fuses around the op: reads it by its strides

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    leaves = (q, k, wq, wk)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    ref = torch.autograd.grad(block(*leaves), leaves)
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-5


def test_compile_fake_outputs_have_the_real_strides():
    q, k = _layout("qkv_slice_transposed", 16, torch.float32)
    real = qk_ops._qk_fwd_op(q, k, None, None, 1e-6, 0.0, "llama", "torch", ops.WIRING)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        fake = qk_ops._qk_fwd_op(fq, fk, None, None, 1e-6, 0.0, "llama", "torch", ops.WIRING)
    for r, f in zip(real, fake, strict=True):
        assert r.shape == f.shape and r.stride() == f.stride() and r.dtype == f.dtype


# ------------------------------------------------------------------------------------------------
# cuTile host plumbing on the CPU: the kernels replaced by torch emulations of their contract
# ------------------------------------------------------------------------------------------------


def _emulated_launch(calls):
    from tilegym_rms.experimental import kernel_name

    def launch(kernel, grid, args, dev, hints=(), built=None):
        kernel = kernel_name(kernel)
        calls.append(kernel)
        if kernel == "qk_rms_norm_fwd":
            q, k, wq, wk, yq, yk, rq, rk, eps, offset, *_tiles, _tn, _tail, cast, has_wq, has_wk, _exact_d, _walk = args
            mode = reference.KERNEL_CASTING_MODES[cast]
            for x, w, has, y, r in ((q, wq, has_wq, yq, rq), (k, wk, has_wk, yk, rk)):
                out, rstd = reference.rms_norm_forward(x, w if has else None, eps, offset, mode)
                y.copy_(out)
                r.copy_(rstd)
        elif kernel == "qk_rms_norm_bwd":
            dyq, dyk, q, k, wq, wk, rq, rk, dq, dk, partial, offset, *_tiles, _tn, _tail, has_wq, has_wk = args
            assert partial.shape[0] == grid[0] or not (has_wq or has_wk)
            for slot, (dy, x, w, has, r, dx) in enumerate(((dyq, q, wq, has_wq, rq, dq), (dyk, k, wk, has_wk, rk, dk))):
                grad, dw = reference.rms_norm_backward(x, dy, w if has else None, r, offset)
                dx.copy_(grad)
                if has:  # spread over the partial rows, as the blocks would
                    partial[:, slot] = dw.float() / partial.shape[0]
        else:
            assert kernel == "rms_norm_dw_reduce"
            args[1].copy_(args[0].sum(0))

    return launch


def _emulate_cutile(monkeypatch):
    """The cuTile host with its kernels emulated (:func:`_emulated_launch`) on a 4-SM device without a
    tuning table: ``(the cutile module, the names of the kernels launched)``."""
    pytest.importorskip("cuda.tile")
    from tilegym_rms import cutile
    from tilegym_rms.cutile import launch, tuning
    from tilegym_rms.cutile.host import common

    calls = []
    monkeypatch.setattr(cutile, "available", lambda device: (True, ""))  # the custom ops check it where they run
    monkeypatch.setattr(launch, "num_sms", lambda index: 4)
    monkeypatch.setattr(tuning, "table_for", lambda index: None)  # no device to key a table on
    monkeypatch.setattr(common, "launcher", lambda: _emulated_launch(calls))
    return cutile, calls


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weights", ["both", "q_only", "mixed_dtypes"])
def test_cutile_host_passes_consistent_views(monkeypatch, layout, weights):
    """Views handed to the qk kernels (transposed where H > G), the rstd between them and the dw slots:
    with each kernel replaced by torch math on the views it receives, the result is rms_norm of each."""
    cutile, calls = _emulate_cutile(monkeypatch)
    q, k = _layout(layout, 16, torch.float32)
    wq = torch.randn(16)
    wk = {"both": torch.randn(16), "q_only": None, "mixed_dtypes": torch.randn(16, dtype=torch.float64)}[weights]
    try:
        yq, yk, rq, rk = qk_ops._qk_forward(q, k, wq, wk, 1e-6, 0.0, "llama", "cutile")
        dyq, dyk = torch.randn(q.shape).transpose(0, 1).contiguous().transpose(0, 1), torch.randn(k.shape)
        dq, dk, dwq, dwk = qk_ops._qk_backward(q, k, dyq, dyk, wq, wk, rq, rk, 0.0, "llama", "cutile")
    finally:
        cutile.clear_caches()
    reductions = {"both": 1, "q_only": 1, "mixed_dtypes": 2}[weights]
    assert calls == ["qk_rms_norm_fwd", "qk_rms_norm_bwd"] + ["rms_norm_dw_reduce"] * reductions
    for x, w, y, dy, dx, dw in ((q, wq, yq, dyq, dq, dwq), (k, wk, yk, dyk, dk, dwk)):
        ref_y, ref_rstd = reference.rms_norm_forward(x, w, 1e-6, 0.0, "llama")
        ref_dx, ref_dw = reference.rms_norm_backward(x, dy, w, ref_rstd)
        assert torch.equal(y, ref_y) and _dense_in_stride_order(y, x)
        assert rel_err(dx, ref_dx) <= 1e-6 and _dense_in_stride_order(dx, x)
        assert (dw is None) == (w is None)
        if w is not None:
            assert dw.dtype == w.dtype and rel_err(dw, ref_dw) <= 1e-5


def test_cutile_backward_op_returns_no_aliased_outputs(monkeypatch):
    """The torch.compile path: the cuTile host reduces both weights' dw into one (2, D) buffer, whose rows
    the custom op must not return as they are (torch refuses outputs that alias one another)."""
    cutile, calls = _emulate_cutile(monkeypatch)
    q, k = _layout("qkv_slice", 16, torch.float32)
    wq, wk = torch.randn(16), torch.randn(16)
    dyq, dyk = torch.randn(q.shape), torch.randn(k.shape)
    try:
        _, _, rq, rk = qk_ops._qk_fwd_op(q, k, wq, wk, 1e-6, 0.0, "llama", "cutile", ops.WIRING)
        dq, dk, dwq, dwk = qk_ops._qk_bwd_op(q, k, dyq, dyk, wq, wk, rq, rk, 0.0, "llama", "cutile")
    finally:
        cutile.clear_caches()
    assert calls == ["qk_rms_norm_fwd", "qk_rms_norm_bwd", "rms_norm_dw_reduce"]  # one reduction for both
    for x, w, dy, dx, dw in ((q, wq, dyq, dq, dwq), (k, wk, dyk, dk, dwk)):
        ref_dx, ref_dw = reference.rms_norm_backward(x, dy, w, reference.rms_norm_forward(x, w, 1e-6)[1])
        assert rel_err(dx, ref_dx) <= 1e-6 and rel_err(dw, ref_dw) <= 1e-5


@pytest.mark.parametrize("layout,grad", [("qkv_slice", "transposed_back"), ("contiguous", "like_output")])
def test_cutile_host_launches_on_the_views_with_tiles_split_by_their_shape(monkeypatch, layout, grad):
    """The qk kernels get the 4-D views themselves (the gradient's memory, no copy) and tiles of the configured
    rows split along G and H for each tensor's own shape (config.qk_tile_split)."""
    from tilegym_rms.cutile import config
    from tilegym_rms.cutile.host import common

    cutile, calls = _emulate_cutile(monkeypatch)
    emulated = _emulated_launch(calls)
    launched = []
    monkeypatch.setattr(common, "launcher", lambda: lambda *a: launched.append(a) or emulated(*a))
    q, k = _layout(layout, 16, torch.float32)
    dyq, dyk = _gradient(grad, q), _gradient(grad, k)
    try:
        _, _, rq, rk = qk_ops._qk_forward(q, k, None, None, 1e-6, 0.0, "llama", "cutile")
        dq, dk, _, _ = qk_ops._qk_backward(q, k, dyq, dyk, None, None, rq, rk, 0.0, "llama", "cutile")
    finally:
        cutile.clear_caches()
    (_, _, fwd_args, *_), (_, _, bwd_args, *_) = launched
    shapes = [BACKWARD_VIEW_SHAPES[layout, grad](h) for h in (HQ, HK)]
    cfg = config.qk_config(*shapes, 16, torch.float32, 4)
    assert bwd_args[0].data_ptr() == dyq.data_ptr() and bwd_args[1].data_ptr() == dyk.data_ptr()
    assert [tuple(t.shape[:3]) for t in bwd_args[:4]] == shapes * 2
    assert bwd_args[12:16] == (*cfg.bwd_tiles[0], *cfg.bwd_tiles[1])
    for (tg, th), (_, g, h) in zip(cfg.bwd_tiles, shapes, strict=True):
        assert (tg, th) == config.qk_tile_split(cfg.bwd_tile_m, g, h)
    assert fwd_args[0].data_ptr() == q.data_ptr() and fwd_args[1].data_ptr() == k.data_ptr()
    for x, dy, dx in ((q, dyq, dq), (k, dyk, dk)):
        ref_dx, _ = reference.rms_norm_backward(x, dy, None, reference.rms_norm_forward(x, None, 1e-6)[1])
        assert rel_err(dx, ref_dx) <= 1e-6
