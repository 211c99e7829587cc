"""Autograd through every public entry point (CPU: the torch backend). `pytest -k autograd` selects these."""

import pytest
import torch
from conftest import rel_err

import tilegym_rms
from tilegym_rms import reference


@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
@pytest.mark.parametrize("weight,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_autograd_gradcheck_rms_norm(casting_mode, weight, offset):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, dtype=torch.float64, requires_grad=True)
    inputs = (x,) + ((torch.randn(17, dtype=torch.float64, requires_grad=True),) if weight else ())
    fn = lambda x, *w: tilegym_rms.rms_norm(x, *(w or (None,)), 1e-5, offset=offset, casting_mode=casting_mode)
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("mode", ["pre", "post"])
def test_autograd_gradcheck_fused_add(mode):
    torch.manual_seed(1)
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, dtype=torch.float64, requires_grad=True)

    def fn(x, r, w):
        y, res = tilegym_rms.fused_add_rms_norm(x, r, w, 1e-5, mode=mode, offset=0.5)
        return y * 2 + res.sin()  # both outputs carry gradient

    assert torch.autograd.gradcheck(fn, (x, r, w))


def test_autograd_noncontiguous_input_and_broadcast_grad():
    torch.manual_seed(2)
    base = torch.randn(8, 40, dtype=torch.float64)
    x = base[:, 3:35].requires_grad_()  # strided rows
    w = torch.randn(32, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: tilegym_rms.rms_norm(x, w).sum(), (x, w))  # dy is broadcast
    xt = torch.randn(32, 8, dtype=torch.float64).t().requires_grad_()  # a column-major view
    assert torch.autograd.gradcheck(lambda x, w: tilegym_rms.rms_norm(x, w), (xt, w))


def test_autograd_module_matches_torch_rmsnorm():
    torch.manual_seed(3)
    ours = tilegym_rms.RMSNorm(24, eps=1e-6)
    theirs = torch.nn.RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(24))
        theirs.weight.copy_(ours.weight)
    x1 = torch.randn(5, 7, 24, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    dy = torch.randn(5, 7, 24)
    y1, y2 = ours(x1), theirs(x2)
    y1.backward(dy)
    y2.backward(dy)
    assert rel_err(y1, y2) <= 1e-6
    assert rel_err(x1.grad, x2.grad) <= 1e-5
    assert rel_err(ours.weight.grad, theirs.weight.grad) <= 1e-5


def test_autograd_module_multi_dim_normalized_shape_and_default_eps():
    torch.manual_seed(4)
    ours = tilegym_rms.RMSNorm((3, 8))
    theirs = torch.nn.RMSNorm((3, 8))
    x = torch.randn(4, 3, 8, requires_grad=True)
    assert rel_err(ours(x), theirs(x)) <= 1e-6
    ours(x).sum().backward()
    assert ours.weight.grad.shape == (3, 8)


def test_autograd_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), tilegym_rms.RMSNorm(32, offset=1.0, casting_mode="gemma"))
    x = torch.randn(6, 16)
    model(x).square().sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x).square().sum().backward()
    for g_eager, p in zip(eager, model.parameters(), strict=False):
        assert rel_err(p.grad, g_eager) <= 1e-6


def test_autograd_standalone_backward_matches_autograd():
    torch.manual_seed(6)
    x = torch.randn(9, 50, requires_grad=True)
    w = torch.randn(50, requires_grad=True)
    dy = torch.randn(9, 50)
    tilegym_rms.rms_norm(x, w, offset=0.3).backward(dy)
    y, rstd = tilegym_rms.rms_norm_forward(x.detach(), w.detach(), offset=0.3)
    dx, dw = tilegym_rms.rms_norm_backward(x.detach(), dy, w.detach(), rstd, offset=0.3)
    assert torch.allclose(dx, x.grad) and torch.allclose(dw, w.grad)


@pytest.mark.parametrize("mode", ["pre", "post"])
def test_autograd_fused_add_torch_compile_fullgraph_matches_eager(mode):
    torch.manual_seed(7)
    w = torch.randn(24, requires_grad=True)

    def block(x, r):
        y, res = tilegym_rms.fused_add_rms_norm(x, r, w, 1e-6, mode=mode, offset=0.5)
        return (y * 3 + res.cos()).sum()

    inputs = [torch.randn(5, 24, requires_grad=True) for _ in range(2)]
    block(*inputs).backward()
    eager = [t.grad.clone() for t in (*inputs, w)]
    for t in (*inputs, w):
        t.grad = None
    torch._dynamo.reset()
    torch.compile(block, fullgraph=True, backend="aot_eager")(*inputs).backward()
    for g_eager, t in zip(eager, (*inputs, w), strict=True):
        assert rel_err(t.grad, g_eager) <= 1e-6


def test_autograd_fused_add_only_residual_used():
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, r, w: tilegym_rms.fused_add_rms_norm(x, r, w)[1].exp(), (x, r, w))
