"""The fused residual add beyond its reference (CPU): the in-place variant and its errors, and the
backward that hands the gradient of residual_out to the backend's one-pass ``fused_add_backward``."""

import pytest
import torch
from conftest import rel_err

import tilegym_rms
from tilegym_rms import _torch_backend, reference

EPS = 1e-5


def _fp64(x, r, w):
    """``(y, s)`` of the fused add in float64 math, independent of the reference module."""
    s = x.double() + r.double()
    return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + EPS) * w.double(), s


def _case(kind):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, generator=g)
    if kind == "strided":  # residual rows with a row stride of 20: written in place through a view
        return torch.randn(12, 16, generator=g), torch.randn(12, 20, generator=g)[:, :16], w
    if kind == "transposed":  # no dense-row view exists: the kernels read a copy, the sum is copied back
        return torch.randn(12, 16, generator=g), torch.randn(16, 12, generator=g).t(), w
    if kind == "fp32-residual":
        return torch.randn(3, 4, 16, generator=g).bfloat16(), torch.randn(3, 4, 16, generator=g), w.bfloat16()
    if kind == "fp16":
        return torch.randn(3, 4, 16, generator=g).half(), torch.randn(3, 4, 16, generator=g).half(), w.half()
    return torch.randn(3, 4, 16, generator=g), torch.randn(3, 4, 16, generator=g), w


@pytest.mark.parametrize("kind", ["contiguous", "strided", "transposed", "fp32-residual", "fp16"])
def test_in_place_writes_the_sum_into_residual_and_returns_y(kind):
    x, r, w = _case(kind)
    x0, r0 = x.clone(), r.clone()
    y = tilegym_rms.fused_add_rms_norm_(x, r, w, EPS)
    y64, s64 = _fp64(x0, r0, w)
    assert y.dtype == x.dtype and r.dtype == r0.dtype and torch.equal(x, x0)
    # The sum's rounding is part of the contract (torch's add, kept in residual's dtype): bit for bit.
    assert torch.equal(r, reference.fused_add_sum(x0, r0))
    assert rel_err(r, s64) <= (1e-6 if r.dtype == torch.float32 else 1e-2)
    assert rel_err(y, y64) <= (1e-5 if x.dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("casting_mode,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.5)])
def test_in_place_matches_the_out_of_place_pre_mode(casting_mode, offset):
    x, r, w = _case("fp16")
    y_ref, s_ref = tilegym_rms.fused_add_rms_norm(x, r, w, EPS, offset=offset, casting_mode=casting_mode)
    y = tilegym_rms.fused_add_rms_norm_(x, r, w, EPS, offset=offset, casting_mode=casting_mode)
    assert torch.equal(y, y_ref) and torch.equal(r, s_ref)


def test_in_place_refuses_autograd_and_bad_arguments():
    x, r, w = _case("contiguous")
    # The message names the tensor that requires grad (a Parameter weight is the common case).
    with pytest.raises(RuntimeError, match="inference-only .* and weight requires grad: .* torch.no_grad"):
        tilegym_rms.fused_add_rms_norm_(x, r, torch.nn.Parameter(w.clone()))
    with pytest.raises(RuntimeError, match="inference-only .* and x requires grad"):
        tilegym_rms.fused_add_rms_norm_(x.clone().requires_grad_(), r, w)
    with pytest.raises(RuntimeError, match="inference-only .* and residual requires grad"):
        tilegym_rms.fused_add_rms_norm_(x, r.clone().requires_grad_(), w)
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        tilegym_rms.fused_add_rms_norm_(x, r[:, :2], w)
    assert torch.equal(r, _case("contiguous")[1])  # nothing was written by the failed calls
    with torch.no_grad():  # grad-requiring leaves are fine where no graph is built
        y = tilegym_rms.fused_add_rms_norm_(x.clone().requires_grad_(), r, w.clone().requires_grad_())
    assert not y.requires_grad and torch.equal(r, reference.fused_add_sum(x, _case("contiguous")[1]))


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 4)])
def test_in_place_empty_inputs(shape):
    x, r = torch.randn(shape), torch.randn(shape)
    y = tilegym_rms.fused_add_rms_norm_(x, r, torch.ones(shape[-1]))
    assert y.shape == shape and r.shape == shape


def test_in_place_under_torch_compile_fullgraph():
    x, r, w = _case("contiguous")
    r_eager = r.clone()
    y_eager = tilegym_rms.fused_add_rms_norm_(x, r_eager, w, EPS)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, r: tilegym_rms.fused_add_rms_norm_(x, r, w, EPS), fullgraph=True)
    y = compiled(x, r)
    assert torch.equal(r, r_eager) and rel_err(y, y_eager) <= 1e-6


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "mode,use_residual,fused_calls", [("pre", True, 1), ("pre", False, 0), ("post", True, 0), ("post", False, 0)]
)
def test_backward_adds_the_residual_gradient_in_the_backends_pass(
    monkeypatch, compiled, mode, use_residual, fused_calls
):
    """Mode "pre" with residual_out used: one fused_add_backward call, no separate norm backward; the
    gradients match float64 math either way."""
    calls = []

    def spy(name):
        original = getattr(_torch_backend, name)
        monkeypatch.setattr(_torch_backend, name, lambda *a: calls.append(name) or original(*a))

    spy("fused_add_backward")
    spy("backward")
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(4, 24, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(24, generator=g, dtype=torch.float64, requires_grad=True)

    def loss(x, r, w):
        y, res = tilegym_rms.fused_add_rms_norm(x, r, w, EPS, mode=mode)
        return (y * 2).sum() + (res.sin().sum() if use_residual else 0)

    fn = loss
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(fn(x, r, w), (x, r, w))
    xd, rd, wd = (t.detach().clone().requires_grad_() for t in (x, r, w))
    y64, s64 = _fp64(xd, rd, wd)
    res64 = s64 if mode == "pre" else y64
    want = torch.autograd.grad((y64 * 2).sum() + (res64.sin().sum() if use_residual else 0), (xd, rd, wd))
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) <= 1e-10
    assert calls == (["fused_add_backward"] if fused_calls else ["backward"])
