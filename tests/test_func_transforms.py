"""torch.func transforms (vmap, grad, jacrev, jvp, functional_call) over the public functions and the module,
on the CPU and on a GPU: as torch.nn.RMSNorm and F.rms_norm they compose with every transform (the calls run the
reference's torch math under a transform; the eager autograd Functions and the kernels are opaque to transforms)."""

import pytest
import torch
from torch.func import functional_call, grad, jacrev, jvp, vmap

import tilegym_rms

EPS = 1e-6


def modules(dtype=torch.float32):
    """Ours and torch's RMSNorm with the same trained (non-unit) weight, which requires grad as a fresh one does."""
    ours, theirs = tilegym_rms.RMSNorm(16, dtype=dtype), torch.nn.RMSNorm(16, dtype=dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16, generator=torch.Generator().manual_seed(1)) * 0.5 + 1)
        theirs.weight.copy_(ours.weight)
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vmap_of_the_module_gives_torchs_bits(dtype):
    ours, theirs = modules(dtype)
    x = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(vmap(ours)(x), vmap(theirs)(x))
    assert torch.equal(vmap(ours, in_dims=1)(x), vmap(theirs, in_dims=1)(x))


def test_per_sample_gradients_match_torchs_and_a_loop_over_samples():
    ours, theirs = modules()
    x = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(3))

    def per_sample(module):
        params = {k: v.detach() for k, v in module.named_parameters()}
        loss = lambda p, xi: functional_call(module, p, (xi,)).square().sum()  # noqa: E731
        return vmap(grad(loss), in_dims=(None, 0))(params, x)["weight"]

    got = per_sample(ours)
    torch.testing.assert_close(got, per_sample(theirs), rtol=1e-6, atol=1e-6)
    for i in range(x.shape[0]):  # the eager autograd path, one sample at a time
        ours.zero_grad()
        ours(x[i]).square().sum().backward()
        torch.testing.assert_close(got[i], ours.weight.grad, rtol=1e-5, atol=1e-5)


def test_jacrev_and_jvp_match_torchs():
    w = torch.randn(16, generator=torch.Generator().manual_seed(4))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    ours = lambda t: tilegym_rms.rms_norm(t, w, EPS)  # noqa: E731
    theirs = lambda t: torch.nn.functional.rms_norm(t, (16,), w, EPS)  # noqa: E731
    torch.testing.assert_close(jacrev(ours)(x[0]), jacrev(theirs)(x[0]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(jvp(ours, (x,), (x.flip(0),))[1], jvp(theirs, (x,), (x.flip(0),))[1])


def test_vmap_over_weights_normalizes_with_each_member_of_an_ensemble():
    weights = torch.randn(3, 16, generator=torch.Generator().manual_seed(6), requires_grad=True)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))
    got = vmap(lambda w: tilegym_rms.rms_norm(x, w, EPS))(weights)
    assert torch.equal(got, torch.stack([tilegym_rms.rms_norm(x, w, EPS) for w in weights]))


G = torch.Generator().manual_seed(8)
X, OTHER = (torch.randn(4, 3, 16, generator=G) for _ in range(2))
W = torch.randn(16, generator=G)
OTHER_CALLS = {  # x, and a second tensor of x's shape (the residual, k, the gate)
    "fused_add": lambda t, r: tilegym_rms.fused_add_rms_norm(t, r, W, EPS)[0],
    "qk": lambda q, k: tilegym_rms.qk_rms_norm(q, k, W, W * 2, EPS)[1],
    "gated": lambda t, z: tilegym_rms.gated_rms_norm(t, z, W, EPS, group_size=8),
}


@pytest.mark.parametrize("name", OTHER_CALLS)
def test_the_fused_add_qk_and_gated_norms_compose_with_grad_and_vmap(name):
    call = OTHER_CALLS[name]
    got = grad(lambda t, o: call(t, o).square().sum(), argnums=(0, 1))(X, OTHER)
    leaves = [X.clone().requires_grad_(), OTHER.clone().requires_grad_()]
    call(*leaves).square().sum().backward()  # the eager autograd path
    for mine, eager in zip(got, leaves, strict=True):
        torch.testing.assert_close(mine, eager.grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(vmap(call)(X, OTHER), call(X, OTHER))  # rows are independent: vmap over the first dim


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_cuda_tensors_transforms_run_the_reference_and_the_eager_call_the_kernels(dtype, monkeypatch):
    """On a GPU the eager call runs the cuTile kernels and a transform the reference's torch math: the forwards
    against float64, the per-sample weight gradients against the kernels' backward one sample at a time."""
    from tilegym_rms import cutile

    launched = []
    for name in ("forward", "backward"):
        real = getattr(cutile, name)
        monkeypatch.setattr(cutile, name, lambda *a, _real=real, _n=name, **kw: launched.append(_n) or _real(*a, **kw))
    ours = tilegym_rms.RMSNorm(16, eps=EPS, dtype=dtype, backend="cutile").cuda()
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16, generator=torch.Generator().manual_seed(1)) * 0.5 + 1)
    x = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(9)).to(dtype).cuda()
    x64, w64 = x.double(), ours.weight.detach().double()
    expected = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS) * w64
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for call in (ours, vmap(ours), vmap(ours, in_dims=1, out_dims=1)):
        before = len(launched)
        got = call(x)
        assert got.device == x.device and got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
        assert (len(launched) > before) == (call is ours), "the kernels run in the eager call only"

    params = {k: v.detach() for k, v in ours.named_parameters()}
    loss = lambda p, xi: functional_call(ours, p, (xi,)).float().square().sum()  # noqa: E731
    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)["weight"]
    for i in range(x.shape[0]):  # the eager autograd path (the kernels' backward), one sample at a time
        ours.zero_grad()
        ours(x[i]).float().square().sum().backward()
        torch.testing.assert_close(per_sample[i].float(), ours.weight.grad.float(), rtol=tol, atol=tol * 10)
    assert "backward" in launched
