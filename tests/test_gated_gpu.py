"""gated_rms_norm's cuTile and Triton kernels on a CUDA GPU against float64 (marker `gpu`; skipped without CUDA).

Run the Triton half without ``TRITON_INTERPRET`` (as test_triton_gpu.py). The float64 reference is the
reference's math on float64 copies of the inputs; tolerances are those of test_cutile_gpu.py. Variants compiled:
one per (group tile, dtypes, M bucket, order of norm and gate), so the grids stay small.
"""

import os
import warnings

import pytest
import torch
from conftest import rel_err
from test_batch_invariance import RowOp, assert_rows_invariant, row_probes, weight_of
from test_cutile_gpu import DW_TOL, Y_TOL, _quiet_experimental_and_release_memory  # noqa: F401  (autouse)

import tilegym_rms
from tilegym_rms import reference

pytestmark = pytest.mark.gpu

BACKENDS = ["cutile", "triton"]
EPS = 1e-6
# (N, group size): a head-dim group (Qwen3-Next), odd widths as one group, a row padded to a wide tile, groups
# of Mamba2 models, three groups (a tile of four), groups of a size that is not a power of two (tiles of 128
# holding 96), groups of 50 (five in a tile of eight), the widest group tile (16384) and one wider than every
# tile (the torch math).
SHAPES = [(128, None), (96, None), (1000, None), (5120, None), (4096, 1024), (8192, 1024), (1536, 512),
          (3072, 96), (250, 50), (16384, None), (20000, None)]  # fmt: skip
MS = [7, 4097, 32768]
MAX_ELEMS = 1 << 26  # keeps the float64 reference (several tensors of M x N) within a few GB


def _skip_interpreted(backend):
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0"):
            pytest.skip("TRITON_INTERPRET is set: these tests need compiled Triton")


def _inputs(m, n, dtype, gate_dtype, seed=0, weight=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, n, generator=g, device="cuda") * 2).to(dtype)
    z = (torch.randn(m, n, generator=g, device="cuda") * 3).to(gate_dtype)
    w = (torch.randn(n, generator=g, device="cuda") * 0.5 + 1).to(dtype) if weight else None
    dy = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    return x, z, w, dy


def _fp64(x, z, w, dy, group_size, norm_before_gate, offset, activation="silu"):
    """``(y, dx, dz, dw)`` of the float64 math."""
    xd, zd, wd = (t.double() if t is not None else None for t in (x, z, w))
    config = (group_size, norm_before_gate, offset, "gemma", activation)
    y, rstd = reference.gated_rms_norm_forward(xd, zd, wd, EPS, *config)
    grads = reference.gated_rms_norm_backward(xd, zd, dy.double(), wd, rstd, *config)
    return (y, *grads)


def _check(backend, x, z, w, dy, group_size, norm_before_gate, casting_mode="llama", offset=0.0, activation="silu"):
    """Runs forward and backward on ``backend``; asserts each output against float64; returns them."""
    leaves = [t.detach().requires_grad_() for t in (x, z, w) if t is not None]
    kw = dict(group_size=group_size, norm_before_gate=norm_before_gate, offset=offset, casting_mode=casting_mode,
              activation=activation)  # fmt: skip
    y = tilegym_rms.gated_rms_norm(*leaves[:2], leaves[2] if w is not None else None, EPS, backend=backend, **kw)
    grads = torch.autograd.grad(y, leaves, dy)
    expected = _fp64(x, z, w, dy, group_size, norm_before_gate, offset, activation)
    tol = Y_TOL[x.dtype]
    assert y.dtype == x.dtype and grads[0].dtype == x.dtype and grads[1].dtype == z.dtype
    pairs = zip(("y", "dx", "dz"), (y, *grads[:2]), expected[:3], strict=True)
    errors = {name: rel_err(got, want) for name, got, want in pairs}
    if w is not None:
        assert grads[2].dtype == w.dtype
        errors["dw"] = rel_err(grads[2], expected[3])
    assert errors["y"] <= tol and errors["dx"] <= tol and errors["dz"] <= max(tol, Y_TOL[z.dtype]), errors
    assert errors.get("dw", 0.0) <= DW_TOL, errors
    return y, grads


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("m", MS)
def test_cutile_narrow_forward_walked(m, norm_before_gate):
    """The one-head forward with gated_narrow_fwd_walk on (walked row tiles, the general settings; the default runs a
    block per row tile): values and gradients against float64, a partial last tile at 7 and 4097 rows."""
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import config

    x, z, w, dy = _inputs(m, 128, torch.bfloat16, torch.bfloat16, seed=m)
    cutile.clear_caches()
    try:
        with config.override(gated_narrow_fwd_walk=True):
            _check("cutile", x, z, w, dy, None, norm_before_gate)
    finally:
        cutile.clear_caches()


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,group_size", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes(backend, n, group_size, m):
    """Each tile class at few and many rows, in its models' order: one group normalizes before the gate
    (Qwen3-Next), groups after it (Mamba2); both orders share the tile walk (test_dtypes runs both)."""
    _skip_interpreted(backend)
    if m * n > MAX_ELEMS:
        pytest.skip("trimmed: the float64 reference of this shape needs too much memory")
    x, z, w, dy = _inputs(m, n, torch.bfloat16, torch.bfloat16, seed=m + n)
    _check(backend, x, z, w, dy, group_size, group_size is None)


# The sigmoid gate after the norm, as every model that uses it (both orders: test_casting_modes_round_as_the_reference).
@pytest.mark.parametrize("norm_before_gate,activation", [(True, "silu"), (False, "silu"), (True, "sigmoid")])
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n,group_size", [(4096, 1024), (96, None)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dtypes(backend, n, group_size, dtype, gate_dtype, norm_before_gate, activation):
    _skip_interpreted(backend)
    _check(backend, *_inputs(4097, n, dtype, gate_dtype), group_size, norm_before_gate, activation=activation)


@pytest.mark.parametrize("activation", reference.GATE_ACTIVATIONS)
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("weight,offset", [(True, 1.0), (False, 0.0)])
@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_casting_modes_round_as_the_reference(backend, casting_mode, weight, offset, norm_before_gate, activation):
    """Each mode against float64, and against the reference in that mode: the kernels round where it does (up
    to an ulp where a row's fp32 sum, added in another order, rounds rstd another way)."""
    _skip_interpreted(backend)
    x, z, w, dy = _inputs(129, 1536, torch.bfloat16, torch.float32, weight=weight)
    config = (512, norm_before_gate, offset)
    if casting_mode == "none":  # fp32 math in 16-bit steps is further from float64
        y = tilegym_rms.gated_rms_norm(x, z, w, EPS, group_size=512, norm_before_gate=norm_before_gate,
                                       offset=offset, casting_mode="none", activation=activation,
                                       backend=backend)  # fmt: skip
        assert rel_err(y, _fp64(x, z, w, dy, *config, activation)[0]) <= 3e-2
    else:
        y, _ = _check(backend, x, z, w, dy, 512, norm_before_gate, casting_mode, offset, activation=activation)
    expected, _ = reference.gated_rms_norm_forward(x, z, w, EPS, *config, casting_mode, activation)
    assert rel_err(y, expected) <= 4e-3
    ulp = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(y.float(), expected.float(), rtol=2 * ulp, atol=2 * ulp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_and_leading_dims(backend):
    """Row-strided x (a slice of a wider projection output), a transposed gate and three leading dims."""
    _skip_interpreted(backend)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, 300, 2 * 3072, generator=g, device="cuda").to(torch.bfloat16)[..., :3072]
    z = torch.randn(3072, 300, 2, generator=g, device="cuda").permute(2, 1, 0)
    w = torch.randn(3072, generator=g, device="cuda").to(torch.bfloat16)
    dy = torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16)
    y, grads = _check(backend, x, z, w, dy, 96, False)
    assert y.shape == x.shape and y.is_contiguous() and grads[1].shape == z.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_dw_is_deterministic(backend):
    _skip_interpreted(backend)
    x, z, w, dy = _inputs(32768, 1024, torch.bfloat16, torch.bfloat16)
    runs = [_check(backend, x, z, w, dy, 256, False)[1] for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    _skip_interpreted(backend)
    x = torch.empty(0, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    z = torch.empty(0, 128, device="cuda", requires_grad=True)
    w = torch.ones(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = tilegym_rms.gated_rms_norm(x, z, w, group_size=64, backend=backend)
    y.sum().backward()
    assert y.shape == x.shape and z.grad.shape == z.shape and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("activation", reference.GATE_ACTIVATIONS)
def test_compile_fullgraph_matches_eager(activation):
    x, z, w, dy = _inputs(4097, 4096, torch.bfloat16, torch.float32)
    kw = dict(group_size=1024, norm_before_gate=False, casting_mode="llama", activation=activation, backend="cutile")

    def fn(x, z, w):
        return tilegym_rms.gated_rms_norm(x, z, w, EPS, **kw)

    torch._dynamo.reset()
    outs = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.detach().requires_grad_() for t in (x, z, w)]
        y = f(*leaves)
        outs.append((y, *torch.autograd.grad(y, leaves, dy)))
    for eager, compiled in zip(*outs, strict=True):
        assert torch.equal(eager, compiled)


def test_cutile_is_the_default_and_launches_its_kernels(monkeypatch):
    """backend=None picks cutile on an H100, which runs its gated kernels (not the torch math)."""
    from tilegym_rms.cutile import launch

    launched = []
    real = launch.notify_launch
    monkeypatch.setattr(launch, "notify_launch", lambda kernel, device: launched.append(kernel) or real(kernel, device))
    x, z, w, dy = _inputs(64, 256, torch.bfloat16, torch.bfloat16)
    _check(None, x, z, w, dy, 64, True)
    from tilegym_rms.experimental import kernel_name

    assert [kernel_name(k) for k in launched] == ["gated_rms_norm_fwd", "gated_rms_norm_bwd", "rms_norm_dw_reduce"]


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("n,group_size", [(128, None), (1000, None), (4096, 1024), (8192, None)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariant_mode(backend, n, group_size, norm_before_gate):
    """In the batch-invariant mode each probe row's y, dx and dz are those of the row alone, at Ms where the
    default launch tiles several rows and walks several tiles per block; dw (a sum over rows) is not compared.
    The probes' ``residual`` rows serve as the gate. A group wider than the Triton kernels' tiles runs torch's
    math, which warns instead (test_batch_invariant_mode_warns_where_torch_math_runs)."""
    _skip_interpreted(backend)
    if backend == "triton" and _wider_than_triton_tiles(group_size or n):
        pytest.skip("runs torch's math: see test_batch_invariant_mode_warns_where_torch_math_runs")
    w = weight_of(n, torch.bfloat16, "cuda").requires_grad_()

    def run(b):
        x, z = b["x"].detach().requires_grad_(), b["residual"].detach().requires_grad_()
        y = tilegym_rms.gated_rms_norm(x, z, w, EPS, group_size=group_size, norm_before_gate=norm_before_gate,
                                       casting_mode="llama", backend=backend)  # fmt: skip
        dx, dz = torch.autograd.grad(y, (x, z), b["dy"])
        return {"y": y.detach(), "dx": dx, "dz": dz}, {}

    with tilegym_rms.batch_invariant():
        probes = row_probes(n, torch.bfloat16, "cuda")
        assert_rows_invariant(RowOp(("x", "residual", "dy"), run), probes, [1, 7, 600, 4100, 40000])


def _wider_than_triton_tiles(group_size: int) -> bool:
    from tilegym_rms.triton import config

    return config.next_pow2(group_size) > config.max_tile_elems("gated_backward")


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_batch_invariant_mode_warns_where_torch_math_runs(norm_before_gate):
    """On the Triton backend a group wider than its tiles runs the reference's torch math, whose results follow
    M (on an H100, one of 8192 values of a few rows differed by an ulp between batch sizes): in the
    batch-invariant mode the call says so; outside it, and for groups that fit, it stays silent."""
    _skip_interpreted("triton")
    n = 8192
    assert _wider_than_triton_tiles(n)
    x, z, w, dy = _inputs(64, n, torch.bfloat16, torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (x, z, w)]

    def call(*rows):
        y = tilegym_rms.gated_rms_norm(*rows, EPS, norm_before_gate=norm_before_gate, backend="triton")
        return torch.autograd.grad(y, rows, torch.ones_like(y))

    with tilegym_rms.batch_invariant(), pytest.warns(tilegym_rms.BatchInvarianceWarning, match="torch's math"):
        call(*leaves)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tilegym_rms.BatchInvarianceWarning)
        call(*leaves)  # the default mode promises no invariance
        small = [t[:, :1024].detach().requires_grad_() for t in (x, z)] + [w[:1024].detach().requires_grad_()]
        with tilegym_rms.batch_invariant():
            call(*small)


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,group_size", [(6144, 768), (3 * 96, 96), (1536 * 3, 1536), (2 * 1000, 1000)])
@pytest.mark.parametrize("m", [7, 4097])
def test_cutile_forward_with_groups_as_a_tile_and_a_tail(m, n, group_size, gate_dtype, norm_before_gate):
    """gated_fwd_tail_min_group on: groups that are not a power of two run the forward as a tile and a narrower tail
    (768 = 512 + 256, 96 = 64 + 32, 1536 = 1024 + 512; 1000 keeps its padded 1024); every output against float64
    y against the padded tile's build within the dtype's tolerance (the sums of squares run in another order)."""
    from tilegym_rms import cutile
    from tilegym_rms.cutile import config
    from tilegym_rms.cutile.host import gated as gated_host
    from tilegym_rms.cutile.host.common import target

    x, z, w, dy = _inputs(m, n, torch.bfloat16, gate_dtype, seed=group_size)
    padded = _check("cutile", x, z, w, dy, group_size, norm_before_gate)[0]
    try:
        with config.override(gated_fwd_tail_min_group=64):
            cutile.clear_caches()  # the host caches launches by shape: rebuild them under the setting
            launch = gated_host.forward_launch(target(x.device.index), m, n, group_size, x.dtype, "llama", True,
                                               norm_before_gate, True)  # fmt: skip
            assert (launch.constants[3] > 0) == (group_size != 1000)  # TAIL_S
            y = _check("cutile", x, z, w, dy, group_size, norm_before_gate)[0]
    finally:
        cutile.clear_caches()
    torch.testing.assert_close(y, padded, rtol=Y_TOL[x.dtype], atol=0)
