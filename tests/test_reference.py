"""The reference semantics against float64 math written out independently."""

import pytest
import torch
from conftest import rel_err

from tilegym_rms import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def fp64_rms_norm(x, w, eps, offset):
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * (offset + w.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
@pytest.mark.parametrize("weight,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 1000), (5, 1)])
def test_forward_matches_fp64(dtype, casting_mode, weight, offset, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype) if weight else None
    y, rstd = reference.rms_norm_forward(x, w, 1e-6, offset, casting_mode)
    assert y.dtype == dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == x.shape[:-1]
    assert rel_err(y, fp64_rms_norm(x, w, 1e-6, offset)) <= TOL[dtype]
    expected_rstd = torch.rsqrt(x.double().square().mean(-1) + 1e-6)
    assert rel_err(rstd, expected_rstd) <= TOL[dtype]


def test_casting_modes_round_differently():
    """llama rounds x*rstd before the weight; gemma rounds once: on bf16 they must differ somewhere."""
    torch.manual_seed(1)
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    llama, _ = reference.rms_norm_forward(x, w, 1e-6, 0.0, "llama")
    gemma, _ = reference.rms_norm_forward(x, w, 1e-6, 0.0, "gemma")
    assert not torch.equal(llama, gemma)
    assert rel_err(gemma, fp64_rms_norm(x, w, 1e-6, 0.0)) <= rel_err(llama, fp64_rms_norm(x, w, 1e-6, 0.0))


@pytest.mark.parametrize("weight,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_backward_matches_fp64_autograd(weight, offset):
    torch.manual_seed(2)
    x = torch.randn(6, 33, dtype=torch.float64, requires_grad=True)
    w = torch.randn(33, dtype=torch.float64, requires_grad=True) if weight else None
    dy = torch.randn(6, 33, dtype=torch.float64)
    fp64_rms_norm(x, w, 1e-5, offset).backward(dy)
    _, rstd = reference.rms_norm_forward(x.detach(), None if w is None else w.detach(), 1e-5, offset, "gemma")
    dx, dw = reference.rms_norm_backward(x.detach(), dy, None if w is None else w.detach(), rstd, offset)
    assert rel_err(dx, x.grad) <= 1e-12
    if weight:
        assert rel_err(dw, w.grad) <= 1e-12
    else:
        assert dw is None


@pytest.mark.parametrize("mode", reference.FUSED_ADD_MODES)
def test_fused_add_reference(mode):
    torch.manual_seed(3)
    x, r = torch.randn(4, 100), torch.randn(4, 100)
    w = torch.randn(100)
    y, res_out, rstd = reference.fused_add_rms_norm_forward(x, r, w, 1e-6, mode)
    assert rel_err(y, fp64_rms_norm(x.double() + r.double(), w, 1e-6, 0.0)) <= 1e-6
    assert torch.equal(res_out, x + r if mode == "pre" else y)
    assert rstd.shape == (4,)


@pytest.mark.parametrize("x_dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("w_dtype", [None, *DTYPES, torch.float64])
@pytest.mark.parametrize("eps", [1e-6, None])
def test_torch_mode_is_torchs_rms_norm_bit_for_bit(x_dtype, w_dtype, eps):
    """``"torch"`` is ``F.rms_norm`` of the installed torch: values and dtype, for every pair of x and weight
    dtypes (a wider weight multiplies in its own dtype) and torch's default eps."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(16, 3, 96, generator=g) * 3).to(x_dtype)
    w = None if w_dtype is None else (torch.randn(96, generator=g) + 0.5).to(w_dtype)
    want = torch.nn.functional.rms_norm(x, (96,), w, eps)
    resolved = torch.finfo(reference.compute_dtype(x_dtype)).eps if eps is None else eps
    got, _ = reference.rms_norm_forward(x, w, resolved, 0.0, "torch")
    assert got.dtype == want.dtype and torch.equal(got, want)
