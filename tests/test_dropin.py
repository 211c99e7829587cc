"""Drop-in behaviour a new user meets first: compile as the first call, the defaults giving torch.nn.RMSNorm's
bits, double backward, empty and zero-width inputs, fp16 overflow in casting mode "none", rstd and eps types,
mixed dtypes in the fused add, Gemma-style initialisation, torch.export.

CPU tests use the torch backend; the Triton backend runs in a fresh subprocess under the interpreter
(``TRITON_INTERPRET`` must be set before Triton sees the kernels); the ``gpu`` tests run the same checks
on the cuTile and Triton backends.
"""

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import rel_err, strided

import tilegym_rms
from tilegym_rms import reference

# The Triton interpreter cases need the [triton] extra.
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_fresh(code: str, env: dict | None = None, timeout: int = 600, cwd=None) -> str:
    """Runs ``code`` in a new Python process (nothing imported or compiled yet); returns its stdout."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


# ----------------------------------------------------------------------------------------------
# 1. torch.compile(fullgraph=True) as the first call of a process
# ----------------------------------------------------------------------------------------------

COMPILE_FIRST = """
    import torch, tilegym_rms
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), tilegym_rms.RMSNorm(32))
    w = torch.randn(32, requires_grad=True)

    def fused(x, r):
        y, res = tilegym_rms.fused_add_rms_norm(x, r, w)
        return (y * 2 + res).sum()

    x = torch.randn(4, 16, device=DEVICE)
    model = model.to(DEVICE)
    compiled = torch.compile(model, fullgraph=True)  # before any eager tilegym_rms call
    compiled(x).square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for a, p in zip(got, model.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-4, atol=1e-5), (a, p.grad)
    w.data = w.data.to(DEVICE)
    xs = [torch.randn(4, 32, device=DEVICE, requires_grad=True) for _ in range(2)]
    torch.compile(fused, fullgraph=True)(*xs).backward()
    print("ok")
"""


def test_compile_fullgraph_as_first_call_in_a_fresh_process():
    assert run_fresh("DEVICE = 'cpu'\n" + textwrap.dedent(COMPILE_FIRST)).strip().endswith("ok")


@pytest.mark.gpu
def test_compile_fullgraph_as_first_call_on_gpu():
    assert run_fresh("DEVICE = 'cuda'\n" + textwrap.dedent(COMPILE_FIRST)).strip().endswith("ok")


# ----------------------------------------------------------------------------------------------
# The defaults give torch's bits: the values and dtype of torch.nn.RMSNorm and F.rms_norm
# ----------------------------------------------------------------------------------------------

DROPIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# No weight, one of x's dtype, and the others: torch then multiplies in the promoted dtype and returns x's.
WEIGHT_DTYPES = (None, *DROPIN_DTYPES, torch.float64)
DROPIN_SHAPES = [(64, 1000), (2, 7, 256), (1, 4096)]


def dropin_case(shape, x_dtype, w_dtype, device="cpu", seed=7):
    """``x`` and a weight far from one (where the casting modes round differently)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(device, x_dtype)
    w = None if w_dtype is None else (torch.randn(shape[-1], generator=g) * 0.5 + 1).to(device, w_dtype)
    return x, w


def assert_bits(got, want):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} values differ"


@pytest.mark.parametrize("shape", DROPIN_SHAPES, ids=str)
@pytest.mark.parametrize("w_dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("x_dtype", DROPIN_DTYPES, ids=str)
def test_default_rms_norm_is_torchs_bits(x_dtype, w_dtype, shape):
    x, w = dropin_case(shape, x_dtype, w_dtype)
    want = torch.nn.functional.rms_norm(x, shape[-1:], w, 1e-6)
    assert_bits(tilegym_rms.rms_norm(x, w, 1e-6), want)
    assert_bits(tilegym_rms.rms_norm_forward(x, w, 1e-6)[0], want)
    assert_bits(tilegym_rms.rms_norm(x.clone().requires_grad_(), w, 1e-6).detach(), want)  # the autograd path
    rows = strided(math.prod(shape[:-1]), shape[-1], x_dtype, seed=8)  # strided rows, read in place
    assert_bits(tilegym_rms.rms_norm(rows, w, 1e-6), torch.nn.functional.rms_norm(rows, shape[-1:], w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_strided_last_dim_gives_the_bits_of_its_dense_copy(dtype):
    """Rows whose elements are not adjacent (``x.t()``) are normalized as their dense copy, the bits F.rms_norm
    gives that copy (README, "Casting modes"); torch's result for the strided layout itself may differ by an ulp."""
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(64, 10, generator=g, dtype=dtype).t(), torch.randn(64, generator=g, dtype=dtype)
    assert x.stride(-1) != 1
    want = torch.nn.functional.rms_norm(x.contiguous(), (64,), w, 1e-6)
    assert_bits(tilegym_rms.rms_norm(x, w, 1e-6), want)
    assert_bits(tilegym_rms.RMSNorm(64, dtype=dtype)(x), torch.nn.RMSNorm(64, dtype=dtype)(x.contiguous()))


@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("w_dtype", [*DROPIN_DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("x_dtype", DROPIN_DTYPES, ids=str)
def test_default_module_is_torch_nn_rmsnorm_bits(x_dtype, w_dtype, eps):
    """A trained (non-unit) weight of any dtype, a two-dim normalized_shape, torch's eps=None."""
    theirs = torch.nn.RMSNorm((4, 64), eps=eps, dtype=w_dtype)
    ours = tilegym_rms.RMSNorm((4, 64), eps=eps, dtype=w_dtype)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(4, 64, generator=torch.Generator().manual_seed(9)) * 0.5 + 1)
        ours.weight.copy_(theirs.weight)
    x = (torch.randn(3, 5, 4, 64, generator=torch.Generator().manual_seed(10)) * 3).to(x_dtype)
    assert_bits(ours(x), theirs(x))
    plain = (
        torch.nn.RMSNorm(64, eps=eps, elementwise_affine=False),
        tilegym_rms.RMSNorm(64, eps=eps, elementwise_affine=False),
    )
    assert_bits(plain[1](x), plain[0](x))


@pytest.mark.parametrize("x_dtype", DROPIN_DTYPES, ids=str)
def test_default_fused_add_and_qk_norm_are_torchs_bits(x_dtype):
    """The fused add normalizes torch's ``x + residual``; qk_rms_norm each of q and k."""
    x, w = dropin_case((6, 256), x_dtype, x_dtype)
    r, _ = dropin_case((6, 256), x_dtype, None, seed=11)
    want = torch.nn.functional.rms_norm(x + r, (256,), w, 1e-6)
    assert_bits(tilegym_rms.fused_add_rms_norm(x, r, w, 1e-6)[0], want)
    with torch.no_grad():
        assert_bits(tilegym_rms.fused_add_rms_norm_(x, r.clone(), w, 1e-6), want)
    q, wq = dropin_case((2, 5, 8, 64), x_dtype, x_dtype, seed=12)
    k, wk = dropin_case((2, 5, 2, 64), x_dtype, x_dtype, seed=13)
    q_out, k_out = tilegym_rms.qk_rms_norm(q, k, wq, wk, 1e-6)
    assert_bits(q_out, torch.nn.functional.rms_norm(q, (64,), wq, 1e-6))
    assert_bits(k_out, torch.nn.functional.rms_norm(k, (64,), wk, 1e-6))


def exact_sum_case(shape, x_dtype, w_dtype, seed=14):
    """A CUDA ``x`` whose rows have one fp32 sum of squares, whatever the order of the additions: multiples of
    1/8 up to 2 in magnitude square to multiples of 1/64, and a row of at most 2^14 of them sums to at most
    2^16, within fp32's 24 bits; with a power-of-two width the mean is exact too. torch's CUDA kernel and ours
    then compute one rstd (the same rsqrt instruction), and any difference in y is a rounding of the casting."""
    assert shape[-1] & (shape[-1] - 1) == 0 and shape[-1] <= 1 << 14
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(-16, 17, shape, generator=g) / 8).to("cuda", x_dtype)
    w = None if w_dtype is None else (torch.randn(shape[-1], generator=g) * 0.5 + 1).to("cuda", w_dtype)
    return x, w


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(37, 1024), (2, 300, 128), (4, 16384)], ids=str)
@pytest.mark.parametrize("w_dtype", ["none", "same", torch.float32], ids=str)
@pytest.mark.parametrize("x_dtype", DROPIN_DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["cutile", "triton"])
def test_default_on_gpu_is_torchs_bits(backend, x_dtype, w_dtype, shape):
    w_dtype = {"none": None, "same": x_dtype}.get(w_dtype, w_dtype)
    x, w = exact_sum_case(shape, x_dtype, w_dtype)
    want = torch.nn.functional.rms_norm(x, shape[-1:], w, 1e-6)
    assert_bits(tilegym_rms.rms_norm(x, w, 1e-6, backend=backend), want)
    assert_bits(tilegym_rms.rms_norm_forward(x, w, 1e-6, backend=backend)[0], want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(600, 128), (37, 1024), (33, 16384)], ids=str)
@pytest.mark.parametrize("x_dtype", DROPIN_DTYPES, ids=str)
@pytest.mark.parametrize("kernel", ["gather", "persistent", "tiles"])
def test_every_cutile_forward_kernel_is_torchs_bits(kernel, x_dtype, shape):
    """Each forward kernel the cuTile backend may launch (a tuning table picks among them per shape), forced."""
    x, w = exact_sum_case(shape, x_dtype, x_dtype)
    want = torch.nn.functional.rms_norm(x, shape[-1:], w, 1e-6)
    assert_bits(tilegym_rms.rms_norm_forward(x, w, 1e-6, backend="cutile", kernel=kernel)[0], want)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["cutile", "triton"])
def test_default_on_gpu_random_rows_differ_from_torch_in_the_last_bit_at_most(backend, x_dtype):
    """Rows whose fp32 sum of squares depends on the order of the additions: torch's CUDA kernel adds in
    another order, which moves rstd by a few fp32 ulps; a 16-bit output then rounds the other way now and then
    (a fraction of a percent), by one ulp. (``"llama"`` would differ in about a quarter of the values.)"""
    x, w = dropin_case((512, 4096), x_dtype, x_dtype, "cuda")
    got = tilegym_rms.rms_norm(x, w, 1e-6, backend=backend)
    want = torch.nn.functional.rms_norm(x, (4096,), w, 1e-6)
    differ = got != want
    assert differ.float().mean().item() <= 2e-2
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert (ulps[differ] <= 1).all()  # only where values differ: two zeros may differ in their sign bit


# ----------------------------------------------------------------------------------------------
# 2. Double backward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
@pytest.mark.parametrize("weight,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_gradgradcheck_rms_norm(casting_mode, weight, offset):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, dtype=torch.float64, requires_grad=True)
    inputs = (x,) + ((torch.randn(9, dtype=torch.float64, requires_grad=True),) if weight else ())
    fn = lambda x, *w: tilegym_rms.rms_norm(x, *(w or (None,)), 1e-5, offset=offset, casting_mode=casting_mode)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_gradgradcheck_module():
    torch.manual_seed(1)
    norm = tilegym_rms.RMSNorm(11, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 11, dtype=torch.float64, requires_grad=True)
    fn = lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,))
    assert torch.autograd.gradgradcheck(fn, (x, norm.weight))


@pytest.mark.parametrize("mode", ["pre", "post"])
def test_gradgradcheck_fused_add(mode):
    torch.manual_seed(2)
    x, r = (torch.randn(3, 10, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(10, dtype=torch.float64, requires_grad=True)

    def fn(x, r, w):
        y, res = tilegym_rms.fused_add_rms_norm(x, r, w, 1e-5, mode=mode, offset=0.5)
        return y * 2 + res.sin()

    assert torch.autograd.gradgradcheck(fn, (x, r, w))


def second_order(backend, device, dtype=torch.float32, fused=False, seed=3):
    """``d/d(x, w) <grad_x(<y, dy>), v>``: a second derivative, through ``create_graph=True``."""
    g = torch.Generator().manual_seed(seed)
    x, r, dy, v = (torch.randn(5, 40, generator=g, dtype=torch.float64) for _ in range(4))
    w = torch.randn(40, generator=g, dtype=torch.float64)
    x, r, w = (t.to(device, dtype).requires_grad_() for t in (x, r, w))
    dy, v = dy.to(device, dtype), v.to(device, dtype)
    if fused:
        y, res = tilegym_rms.fused_add_rms_norm(x, r, w, 1e-5, offset=0.5, backend=backend)
        out = (y * dy).sum() + res.square().sum()
    else:
        out = (tilegym_rms.rms_norm(x, w, 1e-5, offset=0.5, backend=backend) * dy).sum()
    (gx,) = torch.autograd.grad(out, x, create_graph=True)
    return torch.autograd.grad((gx * v).sum(), (x, w) + ((r,) if fused else ()))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("backend", ["cutile", "triton"])
def test_double_backward_kernel_backends_match_fp64(backend, fused):
    got = second_order(backend, "cuda", fused=fused)
    want = second_order("torch", "cpu", torch.float64, fused=fused)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a.cpu(), b) <= 1e-4


@needs_triton
def test_double_backward_triton_interpreter_matches_fp64():
    out = run_fresh(
        """
        import torch, sys
        sys.path.insert(0, "tests")
        from test_dropin import second_order
        from conftest import rel_err
        for fused in (False, True):
            got = second_order("triton", "cpu", fused=fused)
            want = second_order("torch", "cpu", torch.float64, fused=fused)
            print(max(rel_err(a, b) for a, b in zip(got, want, strict=True)))
        """,
        env={"TRITON_INTERPRET": "1"},
    )
    assert all(float(line) <= 1e-4 for line in out.split())


def test_double_backward_under_compile_raises_torchs_error():
    """torch.compile does not support double backward: torch says so (no silent wrong answer)."""
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(lambda x, w: tilegym_rms.rms_norm(x, w), fullgraph=True, backend="aot_eager")(x, w)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward|does not require grad|not supported"):
        torch.autograd.grad(gx.sum(), w)


# ----------------------------------------------------------------------------------------------
# 3 and 10. RMSNorm module: eps=None and the initial weight
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_module_default_eps_matches_torch(dtype):
    """Small activations make eps matter: a 16-bit eps would change every output."""
    torch.manual_seed(4)
    x = (torch.randn(6, 64) * 1e-3).to(dtype).requires_grad_()
    ours, theirs = tilegym_rms.RMSNorm(64, dtype=dtype), torch.nn.RMSNorm(64, dtype=dtype)
    y_ours, y_theirs = ours(x), theirs(x)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(y_ours, y_theirs) <= tol
    (gx_ours,) = torch.autograd.grad(y_ours.float().square().sum(), x)
    (gx_theirs,) = torch.autograd.grad(y_theirs.float().square().sum(), x)
    assert rel_err(gx_ours, gx_theirs) <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_module_offset_initialises_the_effective_weight_to_one():
    x = torch.randn(3, 16)
    plain = torch.nn.RMSNorm(16, eps=1e-6)(x)
    for offset in (0.0, 1.0, 0.25):
        norm = tilegym_rms.RMSNorm(16, eps=1e-6, offset=offset, casting_mode="gemma")
        assert torch.equal(norm.weight.detach(), torch.full((16,), 1.0 - offset))
        assert rel_err(norm(x), plain) <= 1e-6
        norm.weight.data.fill_(5.0)
        norm.reset_parameters()
        assert torch.equal(norm.weight.detach(), torch.full((16,), 1.0 - offset))


# ----------------------------------------------------------------------------------------------
# 4. Empty inputs, a last dim of 0 included
# ----------------------------------------------------------------------------------------------

EMPTY_SHAPES = [(3, 0), (0, 5), (2, 0, 4), (0,), (4, 2, 0)]


@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
@pytest.mark.parametrize("with_weight", [True, False])
def test_empty_inputs_give_empty_outputs_and_grads(shape, with_weight):
    n = shape[-1]
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(n, requires_grad=True) if with_weight else None
    y = tilegym_rms.rms_norm(x, w)
    y.sum().backward()
    assert y.shape == shape and x.grad.shape == shape
    if with_weight:
        assert torch.equal(w.grad, torch.zeros(n))
    y2, rstd = tilegym_rms.rms_norm_forward(x.detach(), w)
    assert y2.shape == shape and rstd.shape == shape[:-1] and rstd.dtype == torch.float32
    dx, dw = tilegym_rms.rms_norm_backward(x.detach(), torch.randn(shape), w, rstd)
    assert dx.shape == shape and (dw is None if w is None else torch.equal(dw, torch.zeros(n)))
    r = torch.randn(shape, requires_grad=True)
    out, res = tilegym_rms.fused_add_rms_norm(x, r, w)
    (out.sum() + res.sum()).backward()
    assert out.shape == res.shape == shape and r.grad.shape == shape


def test_zero_width_rows_have_the_reference_rstd():
    _, rstd = tilegym_rms.rms_norm_forward(torch.randn(3, 0), eps=0.25)
    assert torch.equal(rstd, torch.full((3,), 2.0))
    _, ref_rstd = reference.rms_norm_forward(torch.randn(3, 0), eps=0.25)
    assert torch.equal(ref_rstd, rstd)


@needs_triton
def test_empty_inputs_on_triton_interpreter():
    out = run_fresh(
        """
        import torch, tilegym_rms
        for shape in [(3, 0), (0, 5), (2, 0, 4)]:
            x = torch.randn(shape, requires_grad=True)
            w = torch.randn(shape[-1], requires_grad=True)
            y = tilegym_rms.rms_norm(x, w, backend="triton")
            y.sum().backward()
            y2, res = tilegym_rms.fused_add_rms_norm(x, torch.randn(shape), w, backend="triton")
            assert y.shape == y2.shape == res.shape == shape and x.grad.shape == shape
            assert torch.equal(w.grad, torch.zeros(shape[-1]))
        print("ok")
        """,
        env={"TRITON_INTERPRET": "1"},
    )
    assert out.strip() == "ok"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cutile", "triton"])
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
def test_empty_inputs_on_gpu(backend, shape):
    x = torch.randn(shape, device="cuda", requires_grad=True)
    w = torch.randn(shape[-1], device="cuda", requires_grad=True)
    y = tilegym_rms.rms_norm(x, w, backend=backend)
    y.sum().backward()
    assert y.shape == shape and x.grad.shape == shape and torch.equal(w.grad, torch.zeros_like(w))


# ----------------------------------------------------------------------------------------------
# 5. casting_mode="none" in fp16: no overflow of the mean square
# ----------------------------------------------------------------------------------------------


def fp16_none_case():
    torch.manual_seed(5)
    # Row RMS from about 0.6 to 35000 (uniform values stay under fp16's 65504); fp16's mean square
    # overflows from an RMS of 256 on.
    scale = torch.tensor([1, 100, 300, 1000, 3000, 10000, 30000, 60000])[:, None]
    x = ((torch.rand(8, 256) * 2 - 1) * scale).half()
    w = torch.rand(256).half() + 0.5
    return x, w


def fp64_math(x, w, eps=1e-6):
    xd = x.double()
    return xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps) * w.double()


def test_fp16_none_mode_large_rows_are_not_zero():
    x, w = fp16_none_case()
    y = tilegym_rms.rms_norm(x, w, casting_mode="none")
    assert torch.isfinite(y).all()
    # fp16 roundings (rstd is subnormal in fp16 for the widest rows), never zeros
    assert rel_err(y, fp64_math(x, w)) <= 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cutile", "triton"])
def test_fp16_none_mode_on_gpu(backend):
    x, w = fp16_none_case()
    y, rstd = tilegym_rms.rms_norm_forward(x.cuda(), w.cuda(), casting_mode="none", backend=backend)
    y_ref, rstd_ref = reference.rms_norm_forward(x, w, 1e-6, casting_mode="none")
    assert rel_err(y.cpu(), fp64_math(x, w)) <= 5e-3
    assert rel_err(y.cpu(), y_ref) <= 2e-3 and rel_err(rstd.cpu(), rstd_ref) <= 1e-3


@needs_triton
def test_fp16_none_mode_on_triton_interpreter():
    out = run_fresh(
        """
        import sys, torch, tilegym_rms
        sys.path.insert(0, "tests")
        from test_dropin import fp16_none_case, fp64_math
        from conftest import rel_err
        x, w = fp16_none_case()
        print(rel_err(tilegym_rms.rms_norm(x, w, casting_mode="none", backend="triton"), fp64_math(x, w)))
        """,
        env={"TRITON_INTERPRET": "1"},
    )
    assert float(out) <= 5e-3


# ----------------------------------------------------------------------------------------------
# 6. rstd must be what rms_norm_forward returns
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [torch.int64, torch.bool, torch.float16, torch.float64])
def test_backward_rejects_an_rstd_of_another_dtype(bad):
    x = torch.randn(4, 8)
    _, rstd = tilegym_rms.rms_norm_forward(x)
    with pytest.raises(TypeError, match="rstd must be float32 for x of dtype float32"):
        tilegym_rms.rms_norm_backward(x, torch.randn(4, 8), None, rstd.to(bad))


def test_backward_takes_fp64_rstd_for_fp64_input():
    x = torch.randn(4, 8, dtype=torch.float64)
    _, rstd = tilegym_rms.rms_norm_forward(x)
    assert rstd.dtype == torch.float64
    dx, _ = tilegym_rms.rms_norm_backward(x, torch.ones_like(x), None, rstd)
    with pytest.raises(TypeError, match="rstd must be float64"):
        tilegym_rms.rms_norm_backward(x, torch.ones_like(x), None, rstd.float())
    assert dx.dtype == torch.float64


# ----------------------------------------------------------------------------------------------
# 7. Fused add with an fp32 residual stream
# ----------------------------------------------------------------------------------------------


def mixed_fused_case(device, backend, mode, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 48, generator=g).to(device, dtype).requires_grad_()
    r = torch.randn(6, 48, generator=g).to(device).requires_grad_()  # fp32 residual stream
    w = (torch.randn(48, generator=g) * 0.1 + 1).to(device).requires_grad_()
    y, res = tilegym_rms.fused_add_rms_norm(x, r, w, mode=mode, backend=backend)
    dy = torch.randn(6, 48, generator=g).to(device)
    (y.float() * dy).sum().add_((res.float() * 0.5).sum()).backward()
    return (x, r, w), (y, res), dy


def check_mixed_fused(device, backend, mode):
    (x, r, w), (y, res), dy = mixed_fused_case(device, backend, mode)
    assert y.dtype == x.dtype and x.grad.dtype == x.dtype and r.grad.dtype == torch.float32
    assert res.dtype == (torch.float32 if mode == "pre" else x.dtype)
    # fp64 math of the documented rule: s = x + r (fp32), y = norm(s) in x's dtype
    xd, rd, wd = (t.detach().double().cpu().requires_grad_() for t in (x, r, w))
    s = xd + rd
    yd = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + 1e-6) * wd
    resd = s if mode == "pre" else yd
    (yd * dy.double().cpu()).sum().add((resd * 0.5).sum()).backward()
    assert rel_err(y.cpu(), yd) <= 1e-2 and rel_err(res.cpu(), resd) <= (1e-6 if mode == "pre" else 1e-2)
    for got, want in ((x.grad, xd.grad), (r.grad, rd.grad), (w.grad, wd.grad)):
        assert rel_err(got.cpu(), want) <= 2e-2


@pytest.mark.parametrize("mode", ["pre", "post"])
def test_fused_add_fp32_residual_with_bf16_x(mode):
    check_mixed_fused("cpu", None, mode)


@needs_triton
def test_fused_add_fp32_residual_on_triton_interpreter():
    out = run_fresh(
        """
        import sys, torch
        sys.path.insert(0, "tests")
        from test_dropin import mixed_fused_case, check_mixed_fused
        for mode in ("pre", "post"):
            check_mixed_fused("cpu", "triton", mode)
        print("ok")
        """,
        env={"TRITON_INTERPRET": "1"},
    )
    assert out.strip() == "ok"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pre", "post"])
@pytest.mark.parametrize("backend", ["cutile", "triton"])
def test_fused_add_fp32_residual_on_gpu(backend, mode):
    check_mixed_fused("cuda", backend, mode)


def test_fused_add_fp32_residual_under_compile():
    w = torch.randn(32, requires_grad=True)

    def block(x, r):
        y, res = tilegym_rms.fused_add_rms_norm(x, r, w)
        return y, res

    x, r = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(4, 32)
    torch._dynamo.reset()
    y, res = torch.compile(block, fullgraph=True, backend="aot_eager")(x, r)
    y_eager, res_eager = block(x, r)
    assert (y.dtype, res.dtype) == (torch.bfloat16, torch.float32)
    assert torch.equal(y, y_eager) and torch.equal(res, res_eager)


# ----------------------------------------------------------------------------------------------
# 8. eps and offset as real-number scalars
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "eps", [1e-2, 1, np.float32(1e-2), np.float64(1e-2), torch.tensor(1e-2), torch.tensor(1e-2, dtype=torch.float64)]
)
def test_eps_accepts_real_scalars(eps):
    x = torch.randn(3, 16) * 0.1
    want = reference.rms_norm_forward(x, None, float(eps))[0]
    assert torch.allclose(tilegym_rms.rms_norm(x, None, eps), want)


@pytest.mark.parametrize(
    "eps,exc,match",
    [
        ("1e-6", TypeError, r"eps must be a real number .* or None, got str"),
        (torch.tensor([1e-6]), TypeError, "0-dim CPU tensor"),
        (True, TypeError, "got bool"),
        (-1e-6, ValueError, "non-negative"),
        (np.float32(-1), ValueError, "non-negative"),
        (torch.tensor(float("nan")), ValueError, "non-negative"),
    ],
)
def test_eps_errors_say_what_type_is_wanted(eps, exc, match):
    with pytest.raises(exc, match=match):
        tilegym_rms.rms_norm(torch.randn(2, 4), None, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_eps_none_is_torchs_default(dtype):
    """``eps=None`` as ``F.rms_norm`` takes it: the machine epsilon of the compute dtype, which small rows
    make visible (fp32's for bf16 input, fp64's for fp64)."""
    x = (torch.randn(4, 32) * 1e-4).to(dtype)
    want = torch.nn.functional.rms_norm(x, (32,), None, None)
    assert torch.equal(tilegym_rms.rms_norm(x, None, None), want)
    assert torch.equal(tilegym_rms.rms_norm_forward(x, None, None)[0], want)


def test_offset_accepts_numpy_scalars():
    x, w = torch.randn(3, 8), torch.randn(8)
    want = reference.rms_norm_forward(x, w, 1e-6, 0.5)[0]
    assert torch.equal(tilegym_rms.rms_norm(x, w, offset=np.float32(0.5)), want)


# ----------------------------------------------------------------------------------------------
# torch.export: a program saved on one machine chooses its backend on the machine that runs it
# ----------------------------------------------------------------------------------------------


class ExportedBlock(torch.nn.Module):
    """A block with each exported op: the module, the fused add and the qk norm (``backend`` for all)."""

    def __init__(self, n=64, d=16, backend=None):
        super().__init__()
        self.norm = tilegym_rms.RMSNorm(n, eps=1e-6, backend=backend)
        g = torch.Generator().manual_seed(15)  # the same weights in every process
        self.q_weight = torch.nn.Parameter(torch.rand(d, generator=g) + 0.5)
        self.backend = backend
        with torch.no_grad():
            self.norm.weight.copy_(torch.rand(n, generator=g) + 0.5)

    def forward(self, x, r, q, k):
        y, s = tilegym_rms.fused_add_rms_norm(x, r, self.norm.weight, 1e-6, backend=self.backend)
        q_out, k_out = tilegym_rms.qk_rms_norm(q, k, self.q_weight, None, 1e-6, backend=self.backend)
        return self.norm(y), s, q_out, k_out


def exported_inputs(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(16)
    shapes = ((8, 64), (8, 64), (2, 8, 4, 16), (2, 8, 1, 16))
    return tuple(torch.randn(s, generator=g).to(device, dtype) for s in shapes)


def backends_recorded(program) -> list:
    """The ``backend`` argument of every tilegym_rms op in an exported program."""
    found = []
    for node in program.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "tilegym_rms":
            names = [a.name for a in node.target._schema.arguments]
            found.append(node.args[names.index("backend")])
    return found


def test_export_records_no_backend_of_the_exporting_machine():
    """With backend=None the op chooses when it runs; an explicit backend stays in the program."""
    program = torch.export.export(ExportedBlock(), exported_inputs())
    assert backends_recorded(program) == [None, None, None]  # fused add, qk norm, module
    assert backends_recorded(torch.export.export(ExportedBlock(backend="torch"), exported_inputs())) == ["torch"] * 3


def test_exported_program_saved_and_loaded_gives_eager_bits(tmp_path):
    block, inputs = ExportedBlock(), exported_inputs()
    torch.export.save(torch.export.export(block, inputs), tmp_path / "block.pt2")
    loaded = torch.export.load(tmp_path / "block.pt2").module()
    for got, want in zip(loaded(*inputs), block(*inputs), strict=True):
        assert_bits(got, want)


EXPORT_ON_CPU = """
    import sys, torch
    sys.path.insert(0, "tests")
    from test_dropin import ExportedBlock, exported_inputs
    assert not torch.cuda.is_available()
    torch.export.save(torch.export.export(ExportedBlock(), exported_inputs()), PATH)
    print("saved")
"""


@pytest.mark.gpu
def test_program_exported_on_a_cpu_runs_cutile_on_a_gpu(tmp_path, monkeypatch):
    """Exported and saved where no GPU is visible (its backend would have been "torch"), then loaded and run
    on CUDA inputs: the cuTile kernels run, and the values are the float64 ones."""
    from tilegym_rms import cutile

    path = tmp_path / "block.pt2"
    out = run_fresh(f"PATH = {str(path)!r}\n" + textwrap.dedent(EXPORT_ON_CPU), env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.strip() == "saved"
    launched = []
    for name in ("forward", "fused_add_forward", "qk_forward"):
        real = getattr(cutile, name)
        monkeypatch.setattr(
            cutile, name, lambda *a, _real=real, _name=name, **kw: launched.append(_name) or _real(*a, **kw)
        )
    program = torch.export.load(path).module().to("cuda")
    inputs = exported_inputs("cuda")
    outputs = program(*inputs)
    assert sorted(launched) == ["forward", "fused_add_forward", "qk_forward"]
    want = ExportedBlock(backend="torch").double()(*(t.double().cpu() for t in inputs))
    for got, ref in zip(outputs, want, strict=True):
        assert got.device.type == "cuda" and got.dtype == torch.float32
        assert rel_err(got.cpu(), ref) <= 1e-5


# ----------------------------------------------------------------------------------------------
# torch.compile's caches across versions of tilegym_rms
# ----------------------------------------------------------------------------------------------

CACHED_STEP = """
    import torch, tilegym_rms
    torch.manual_seed(0)
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    f = torch.compile(lambda x, w: tilegym_rms.rms_norm(x, w).sin().sum(), fullgraph=True)
    f(x, w).backward()
    print(float(x.grad.abs().sum()))
"""


def test_compile_cache_does_not_reuse_the_backward_of_another_version(tmp_path):
    """A compiled backward cached by one version of the ops must not serve another (PERFORMANCE.md,
    "Host path"): two copies of the package, the second with a backward that doubles dx, share
    one Inductor cache; the second must get doubled gradients."""
    import shutil

    src = os.path.dirname(tilegym_rms.__file__)
    copies = []
    for i, scale in enumerate(("", " * 2")):
        root = tmp_path / f"v{i}"
        shutil.copytree(src, root / "tilegym_rms", ignore=shutil.ignore_patterns("__pycache__"))
        ops = root / "tilegym_rms" / "ops" / "norm.py"
        old = "dx, dw = _rms_norm_bwd_op(x, dy, weight, rstd, *ctx.config)\n"
        text = ops.read_text()
        assert old in text
        ops.write_text(text.replace(old, old + f"    dx = dx{scale}\n"))
        copies.append(root)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    # cwd: python -c puts it first on sys.path, ahead of PYTHONPATH
    first, second = (float(run_fresh(CACHED_STEP, {**env, "PYTHONPATH": str(root)}, cwd=root)) for root in copies)
    assert second == pytest.approx(2 * first, rel=1e-5)


def test_wiring_fingerprint_changes_with_every_module_of_the_ops(tmp_path):
    """The backward wiring lives in every module of ``tilegym_rms.ops``: an edit to any of them must change
    the fingerprint that keys torch.compile's caches."""
    import shutil
    from pathlib import Path

    from tilegym_rms.ops import common

    package = tmp_path / "ops"
    shutil.copytree(Path(common.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    assert common._wiring_fingerprint(package) == common.WIRING
    modules = sorted(package.glob("*.py"))
    assert {p.name for p in modules} >= {"__init__.py", "common.py", "norm.py", "fused_add.py", "qk.py"}
    for path in modules:
        text = path.read_text()
        path.write_text(text + "\n")
        assert common._wiring_fingerprint(package) != common.WIRING, path.name
        path.write_text(text)
