"""The gated RMSNorm on the CPU: the reference against float64 restatements and Hugging Face's own classes,
gradients, autograd, torch.compile, errors, empty and strided inputs."""

import importlib
import textwrap

import pytest
import torch
from conftest import rel_err
from test_batch_invariance import RowOp, assert_rows_invariant, row_probes, weight_of

import tilegym_rms
from tilegym_rms import reference

# (semantics, group size) pairs every model family uses: Qwen3-Next (one group, norm before gate), Mamba2
# (groups, gate before norm), FalconH1 (groups, either order)
LAYOUTS = [(True, None), (True, 4), (False, None), (False, 4)]
ACTIVATIONS = ["silu", "sigmoid"]


def fp64_gate(z, activation="silu"):
    """The gate in float64, written out: silu ``z / (1 + e^-z)``, sigmoid ``1 / (1 + e^-z)``."""
    z = z.double()
    return (z if activation == "silu" else 1) / (1 + torch.exp(-z))


def fp64_gated(x, z, w, eps, group_size, norm_before_gate, offset=0.0, activation="silu"):
    """The gated norm in float64, written out from the models' definitions."""
    x = x.double()
    gate = fp64_gate(z, activation)
    h = x if norm_before_gate else x * gate
    g = group_size or x.shape[-1]
    hg = h.unflatten(-1, (x.shape[-1] // g, g))
    y = (hg / torch.sqrt((hg * hg).mean(-1, keepdim=True) + eps)).flatten(-2)
    if w is not None:
        y = y * (offset + w.double())
    return y * gate if norm_before_gate else y


def hf_class(module, name):
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


def sigmoid_gated(module, name):
    """A sigmoid-gated class (one group, norm before gate, fp32 throughout), as its builder."""
    return lambda n, g, nbg: hf_class(module, name)(n, eps=1e-6)


# Each HF gated class, how to build it for a width and group size, the casting mode that rounds as it does and
# its gate's activation.
HF_CLASSES = {
    "qwen3_next": (lambda n, g, nbg: hf_class("qwen3_next", "Qwen3NextRMSNormGated")(n, eps=1e-6), "llama", "silu"),
    "mamba2": (lambda n, g, nbg: hf_class("mamba2", "MambaRMSNormGated")(n, group_size=g, eps=1e-6), "llama", "silu"),
    "nemotron_h": (lambda n, g, nbg: hf_class("nemotron_h", "NemotronHRMSNormGated")(n, group_size=g), "llama", "silu"),
    "falcon_h1": (
        lambda n, g, nbg: hf_class("falcon_h1", "FalconH1RMSNormGated")(n, n_groups=n // g, norm_before_gate=nbg),
        "gemma",
        "silu",
    ),
    "kimi_linear": (sigmoid_gated("kimi_linear", "KimiLinearRMSNormGated"), "gemma", "sigmoid"),
    "bailing_hybrid": (sigmoid_gated("bailing_hybrid", "BailingHybridRMSNormGated"), "gemma", "sigmoid"),
    "glm5_next": (sigmoid_gated("glm5_next", "Glm5NextTextRMSNormGated"), "gemma", "sigmoid"),
}
HF_CASES = [
    ("qwen3_next", True, None),
    ("mamba2", False, 16),
    ("mamba2", False, 64),
    ("nemotron_h", False, 8),
    ("falcon_h1", True, 16),
    ("falcon_h1", False, 64),
    ("kimi_linear", True, None),
    ("bailing_hybrid", True, None),
    ("glm5_next", True, None),
]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("norm_before_gate,group_size", LAYOUTS)
@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_forward_matches_fp64(norm_before_gate, group_size, casting_mode, dtype, activation):
    torch.manual_seed(0)
    x, z = torch.randn(3, 5, 16, dtype=dtype), torch.randn(3, 5, 16, dtype=dtype)
    w = torch.randn(16, dtype=dtype)
    args = (group_size, norm_before_gate, 0.5)
    y, rstd = reference.gated_rms_norm_forward(x, z, w, 1e-5, *args, casting_mode, activation)
    tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float64: 1e-13}[dtype]
    assert y.dtype == dtype and rel_err(y, fp64_gated(x, z, w, 1e-5, *args, activation)) <= tol
    groups = 16 // (group_size or 16)
    assert rstd.shape == (3, 5, groups) and rstd.dtype == reference.compute_dtype(dtype)
    h = x.double() if norm_before_gate else x.double() * fp64_gate(z, activation)
    expected = torch.rsqrt(h.unflatten(-1, (groups, -1)).square().mean(-1) + 1e-5)
    assert rel_err(rstd, expected) <= max(tol, 1e-6)


@pytest.mark.parametrize("model,norm_before_gate,group_size", HF_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gate_dtype", ["x", torch.float32])
def test_reference_has_the_bits_of_each_hf_class(model, norm_before_gate, group_size, dtype, gate_dtype):
    """Each HF class's forward, with its weight in the model's dtype, against the reference in the mode that
    rounds as it does: bit for bit in 16 bits (in fp32 the sum of squares may round another way)."""
    build, mode, activation = HF_CLASSES[model]
    n = 128
    hf = build(n, group_size or n, norm_before_gate).to(dtype)
    torch.manual_seed(1)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(n) * 0.5 + 1)
    x = torch.randn(2, 9, n, dtype=dtype) * 3
    z = torch.randn(2, 9, n, dtype=dtype if gate_dtype == "x" else gate_dtype)
    with torch.no_grad():
        expected = hf(x, z)
    args = (group_size, norm_before_gate, 0.0, mode, activation)
    y, _ = reference.gated_rms_norm_forward(x, z, hf.weight.detach(), 1e-6, *args)
    out = tilegym_rms.gated_rms_norm(
        x, z, hf.weight.detach(), 1e-6, group_size=group_size, norm_before_gate=norm_before_gate, casting_mode=mode,
        activation=activation,
    )  # fmt: skip
    for result in (y, out):
        assert result.dtype == expected.dtype
        assert torch.equal(result, expected) if dtype != torch.float32 else rel_err(result, expected) <= 1e-6


def test_llama_and_gemma_round_differently():
    """The modes are not one rounding under two names: on bf16 they differ, and gemma is the closer to fp64."""
    torch.manual_seed(2)
    x, z, w = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(64, 256), torch.randn(256, dtype=torch.bfloat16)
    exact = fp64_gated(x, z, w, 1e-6, None, True)
    llama = reference.gated_rms_norm_forward(x, z, w, 1e-6, None, True, 0.0, "llama")[0]
    gemma = reference.gated_rms_norm_forward(x, z, w, 1e-6, None, True, 0.0, "gemma")[0]
    assert not torch.equal(llama, gemma)
    assert rel_err(gemma, exact) < rel_err(llama, exact)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("norm_before_gate,group_size", LAYOUTS)
@pytest.mark.parametrize("weight,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_backward_matches_fp64_autograd(norm_before_gate, group_size, weight, offset, activation):
    torch.manual_seed(3)
    x = torch.randn(4, 3, 12 if group_size is None else 16, dtype=torch.float64, requires_grad=True)
    z = torch.randn(x.shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(x.shape[-1], dtype=torch.float64, requires_grad=True) if weight else None
    dy = torch.randn(x.shape, dtype=torch.float64)
    fp64_gated(x, z, w, 1e-5, group_size, norm_before_gate, offset, activation).backward(dy)
    xd, zd, wd = x.detach(), z.detach(), (w.detach() if weight else None)
    args = (group_size, norm_before_gate, offset, "gemma", activation)
    _, rstd = reference.gated_rms_norm_forward(xd, zd, wd, 1e-5, *args)
    dx, dz, dw = reference.gated_rms_norm_backward(xd, zd, dy, wd, rstd, *args)
    assert rel_err(dx, x.grad) <= 1e-12 and rel_err(dz, z.grad) <= 1e-12
    assert (dw is None) if not weight else rel_err(dw, w.grad) <= 1e-12


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("norm_before_gate,group_size", LAYOUTS)
def test_gradcheck_and_double_backward(norm_before_gate, group_size, activation):
    torch.manual_seed(4)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    z = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    kw = dict(group_size=group_size, norm_before_gate=norm_before_gate, activation=activation)

    def fn(x, z, w):
        return tilegym_rms.gated_rms_norm(x, z, w, 1e-5, **kw)

    assert torch.autograd.gradcheck(fn, (x, z, w))
    assert torch.autograd.gradgradcheck(fn, (x, z, w))


# Every layout with silu; sigmoid before and after the norm (its graph differs only in the gate's op).
COMPILE_CASES = [(*layout, "silu") for layout in LAYOUTS] + [(True, None, "sigmoid"), (False, 4, "sigmoid")]


@pytest.mark.parametrize("norm_before_gate,group_size,activation", COMPILE_CASES)
def test_compile_fullgraph_matches_eager(norm_before_gate, group_size, activation):
    torch.manual_seed(5)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    z = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
    kw = dict(group_size=group_size, norm_before_gate=norm_before_gate, casting_mode="llama", activation=activation)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, z, w: tilegym_rms.gated_rms_norm(x, z, w, **kw), fullgraph=True)
    dy = torch.randn(x.shape, dtype=torch.bfloat16)
    outs = []
    for f in (lambda x, z, w: tilegym_rms.gated_rms_norm(x, z, w, **kw), compiled):
        y = f(x, z, w)
        outs.append((y, *torch.autograd.grad(y, (x, z, w), dy)))
    for eager, comp in zip(*outs, strict=True):
        assert torch.equal(eager, comp)


def test_gradients_and_dtypes_through_autograd():
    """A 16-bit x with an fp32 gate: each gradient in its input's dtype, against the fp64 formula."""
    torch.manual_seed(6)
    x = torch.randn(7, 32, dtype=torch.bfloat16, requires_grad=True)
    z = torch.randn(7, 32, requires_grad=True)
    w = torch.randn(32, dtype=torch.bfloat16, requires_grad=True)
    y = tilegym_rms.gated_rms_norm(x, z, w, group_size=8, norm_before_gate=False)
    dy = torch.randn(7, 32, dtype=torch.bfloat16)
    y.backward(dy)
    xd, zd, wd = (t.detach().double().requires_grad_() for t in (x, z, w))
    fp64_gated(xd, zd, wd, 1e-6, 8, False).backward(dy.double())
    assert (x.grad.dtype, z.grad.dtype, w.grad.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert rel_err(x.grad, xd.grad) <= 1e-2 and rel_err(z.grad, zd.grad) <= 1e-2 and rel_err(w.grad, wd.grad) <= 1e-2


def test_strided_inputs_and_leading_dims():
    torch.manual_seed(7)
    base = torch.randn(6, 4, 2, 16, dtype=torch.float64)
    x = base.transpose(0, 1)[..., 0, :]  # (4, 6, 16), rows not dense
    z = torch.randn(16, 6, 4, dtype=torch.float64).permute(2, 1, 0)  # last dim strided
    w = torch.randn(16, dtype=torch.float64)
    x.requires_grad_(), z.requires_grad_()
    y = tilegym_rms.gated_rms_norm(x, z, w, group_size=4, norm_before_gate=False)
    assert y.shape == x.shape and y.is_contiguous()
    assert rel_err(y, fp64_gated(x, z, w, 1e-6, 4, False)) <= 1e-13
    y.sum().backward()
    assert x.grad.shape == x.shape and z.grad.shape == z.shape


@pytest.mark.parametrize("shape,group_size", [((0, 8), None), ((0, 8), 4), ((3, 0), None), ((2, 0, 8), 2)])
def test_empty_inputs(shape, group_size):
    x = torch.randn(shape, requires_grad=True)
    z = torch.randn(shape, requires_grad=True)
    w = torch.randn(shape[-1], requires_grad=True)
    y = tilegym_rms.gated_rms_norm(x, z, w, group_size=group_size)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and z.grad.shape == z.shape
    assert torch.equal(w.grad, torch.zeros_like(w))
    _, rstd = reference.gated_rms_norm_forward(x.detach(), z.detach(), None, 1e-6, group_size)
    assert rstd.shape == (*shape[:-1], 1 if group_size is None else shape[-1] // group_size)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(z=torch.randn(4, 6)), ValueError, r"z must have the shape of x \(4, 8\), got \(4, 6\)"),
        (dict(z=torch.ones(4, 8, dtype=torch.int32)), TypeError, "z must be a floating-point tensor"),
        (dict(z=torch.randn(4, 8, device="meta")), ValueError, "z must be on the device of x"),
        (dict(group_size=3), ValueError, r"group_size must divide the last dim \(8\) into groups, got 3"),
        (dict(group_size=0), ValueError, "group_size must be None or a positive int dividing the last dim"),
        (dict(group_size=True), ValueError, "group_size must be None or a positive int"),
        (dict(norm_before_gate=1), TypeError, "norm_before_gate must be True or False, got int"),
        (dict(casting_mode="fp8"), ValueError, "casting_mode must be one of"),
        (dict(activation="gelu"), ValueError, r"^activation must be one of 'silu', 'sigmoid', got 'gelu'$"),
        (dict(activation=None), ValueError, r"^activation must be one of 'silu', 'sigmoid', got None$"),
        (dict(weight=torch.ones(4)), ValueError, r"weight must have shape \(8,\)"),
    ],
)
def test_errors(kwargs, error, match):
    args = dict(x=torch.randn(4, 8), z=torch.randn(4, 8), weight=None)
    args.update(kwargs)
    x, z, weight = args.pop("x"), args.pop("z"), args.pop("weight")
    with pytest.raises(error, match=match):
        tilegym_rms.gated_rms_norm(x, z, weight, **args)


def test_module_matches_the_function_and_checks_where_it_is_built():
    torch.manual_seed(8)
    norm = tilegym_rms.GatedRMSNorm(16, eps=1e-5, group_size=8, norm_before_gate=False, casting_mode="llama")
    assert torch.equal(norm.weight.detach(), torch.ones(16))
    with torch.no_grad():
        norm.weight.normal_()
    x, z = torch.randn(3, 16), torch.randn(3, 16)
    expected = tilegym_rms.gated_rms_norm(
        x, z, norm.weight, 1e-5, group_size=8, norm_before_gate=False, casting_mode="llama"
    )
    assert torch.equal(norm(x, z), expected)
    assert tilegym_rms.GatedRMSNorm(16, offset=1.0).weight.detach().eq(0).all()
    assert tilegym_rms.GatedRMSNorm(16, elementwise_affine=False).weight is None
    with pytest.raises(ValueError, match=r"group_size must divide the last dim \(16\) into groups, got 5"):
        tilegym_rms.GatedRMSNorm(16, group_size=5)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        tilegym_rms.GatedRMSNorm(16, backend="cuda")
    with pytest.raises(ValueError, match="activation must be one of 'silu', 'sigmoid', got 'tanh'"):
        tilegym_rms.GatedRMSNorm(16, activation="tanh")
    default_eps = tilegym_rms.GatedRMSNorm(16, eps=None)  # torch's default, as RMSNorm and gated_rms_norm take it
    assert torch.equal(default_eps(x, z), tilegym_rms.gated_rms_norm(x, z, default_eps.weight, None))
    sig = tilegym_rms.GatedRMSNorm(16, eps=1e-5, activation="sigmoid")
    assert "activation='sigmoid'" in repr(sig)
    assert rel_err(sig(x, z), fp64_gated(x, z, None, 1e-5, None, True, activation="sigmoid")) <= 1e-6


# ------------------------------------------------------------------------------------------------
# cuTile host plumbing on the CPU: the kernels replaced by torch emulations of their contract
# ------------------------------------------------------------------------------------------------


def _emulated_launch(calls):
    from tilegym_rms.experimental import kernel_name

    def launch(kernel, grid, args, dev, hints=(), built=None):
        name = kernel_name(kernel)
        calls.append(name)
        if name == "gated_rms_norm_fwd":
            x, z, w, y, rstd, eps, offset, _tm, tile_g, tile_s, tail_s, cast, has_w, nbg, gate, store, _walk = args
            m, groups, size = x.shape
            assert grid[1] == -(-groups // tile_g) and size <= tile_s + tail_s < 2 * size
            assert tail_s == 0 or tail_s <= tile_s < size  # a group as a tile and a narrower tail
            mode = reference.KERNEL_CASTING_MODES[cast]
            weight = w.reshape(-1) if has_w else None
            out, r = reference.gated_rms_norm_forward(
                x.reshape(m, -1), z.reshape(m, -1), weight, eps, size, nbg, offset, mode,
                reference.GATE_ACTIVATIONS[gate],
            )  # fmt: skip
            y.copy_(out.view(y.shape))
            if store:
                rstd.copy_(r)
        elif name == "gated_rms_norm_bwd":
            dy, x, z, w, rstd, dx, dz, partial, offset, _tm, _tg, _ts, has_w, nbg, gate = args
            m, groups, size = x.shape
            weight = w.reshape(-1) if has_w else None
            flat = [t.reshape(m, -1) for t in (x, z, dy)]
            config = (size, nbg, offset, "gemma", reference.GATE_ACTIVATIONS[gate])
            gx, gz, dw = reference.gated_rms_norm_backward(flat[0], flat[1], flat[2], weight, rstd, *config)
            dx.copy_(gx.view(dx.shape))
            dz.copy_(gz.view(dz.shape))
            if has_w:  # spread over the partial rows, one per block of grid axis 0
                assert partial.shape == (grid[0], groups, size)
                partial.copy_((dw.float() / grid[0]).view(1, groups, size).expand_as(partial))
        else:
            assert name == "rms_norm_dw_reduce"
            args[1].copy_(args[0].sum(0))

    return launch


@pytest.fixture
def emulated_cutile(monkeypatch):
    """The cuTile host with its kernels emulated on a 4-SM device without a tuning table: the names of the
    kernels launched."""
    pytest.importorskip("cuda.tile")
    from tilegym_rms import cutile
    from tilegym_rms.cutile import launch, tuning
    from tilegym_rms.cutile.host import common

    calls = []
    monkeypatch.setattr(cutile, "available", lambda device: (True, ""))
    monkeypatch.setattr(launch, "num_sms", lambda index: 4)
    monkeypatch.setattr(tuning, "table_for", lambda index: None)
    monkeypatch.setattr(common, "launcher", lambda: _emulated_launch(calls))
    cutile.clear_caches()
    yield calls
    cutile.clear_caches()


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize(
    "n,group_size,weight,activation",
    [(96, None, True, "silu"), (96, 32, True, "sigmoid"), (120, 40, False, "silu"), (3 * 512, 512, True, "silu")],
)
def test_cutile_host_views_and_partial_buffer(emulated_cutile, norm_before_gate, n, group_size, weight, activation):
    """The host's (M, G, S) views, rstd, grids and dw partial buffer, on row-strided x and a strided fp32 gate:
    the results of the reference on the whole call (the gate's activation passed through to both kernels)."""
    torch.manual_seed(9)
    x = torch.randn(3, 7, n + 8, dtype=torch.bfloat16)[..., :n].requires_grad_()
    z = torch.randn(n, 3, 7).permute(1, 2, 0).requires_grad_()
    w = torch.randn(n, dtype=torch.bfloat16, requires_grad=True) if weight else None
    kw = dict(group_size=group_size, norm_before_gate=norm_before_gate, casting_mode="llama", activation=activation)
    y = tilegym_rms.gated_rms_norm(x, z, w, 1e-5, backend="cutile", **kw)
    dy = torch.randn(y.shape, dtype=y.dtype)
    grads = torch.autograd.grad(y, [t for t in (x, z, w) if t is not None], dy)
    expected = tilegym_rms.gated_rms_norm(x, z, w, 1e-5, backend="torch", **kw)
    expected_grads = torch.autograd.grad(expected, [t for t in (x, z, w) if t is not None], dy)
    assert torch.equal(y, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.dtype == want.dtype and rel_err(got, want) <= 1e-6
    assert emulated_cutile == ["gated_rms_norm_fwd", "gated_rms_norm_bwd"] + ["rms_norm_dw_reduce"] * weight


def test_cutile_host_runs_groups_wider_than_its_tiles_in_torch(emulated_cutile):
    x, z = torch.randn(2, 20000), torch.randn(2, 20000)
    y = tilegym_rms.gated_rms_norm(x, z, backend="cutile")
    assert emulated_cutile == []
    assert rel_err(y, fp64_gated(x, z, None, 1e-6, None, True)) <= 1e-6
    y = tilegym_rms.gated_rms_norm(x, z, group_size=10000, backend="cutile")
    assert emulated_cutile == ["gated_rms_norm_fwd"]


# ------------------------------------------------------------------------------------------------
# cuTile launch heuristics (config.gated_config, no GPU)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 7, 4097, 65536, 1 << 20])
@pytest.mark.parametrize(
    "n,group_size", [(128, 128), (3072, 96), (1536, 512), (8192, 1024), (16384, 1024), (5120, 5120)]
)
def test_cutile_tiles_hold_whole_groups(m, n, group_size):
    """Each tile holds whole groups, padded to a power of two; chunks cover every group; no block without a row
    tile; the backward's tiles are no bigger than the forward's (x, z and dy live) except on narrow rows, whose
    settings were measured apart."""
    from tilegym_rms.cutile import config

    cfg = config.gated_config(m, n, group_size, torch.bfloat16, 132)
    groups = n // group_size
    assert cfg.tile_s == 1 << (group_size - 1).bit_length()
    for launch in (cfg.fwd, cfg.bwd):
        assert launch.grid[1] * launch.tile_g >= groups > (launch.grid[1] - 1) * launch.tile_g
        assert 1 <= launch.grid[0] <= -(-m // launch.tile_m)
    if cfg.tile_s * cfg.fwd.tile_g > config.HEURISTICS.gated_narrow_max_row:
        assert cfg.bwd.tile_m * cfg.bwd.tile_g <= cfg.fwd.tile_m * cfg.fwd.tile_g


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_cutile_narrow_rows_take_the_head_settings(norm_before_gate):
    """Rows of one narrow group (a 128-wide head): the backward takes the gated_narrow_* settings by where the gate
    applies, the forward one row tile of gated_narrow_fwd_tile_elems per block without the walk (PERFORMANCE.md,
    "Gated RMSNorm"); the batch-invariant mode keeps its walked one-row tiles."""
    from tilegym_rms.cutile import config

    p = config.HEURISTICS
    cfg = config.gated_config(1 << 18, 128, 128, torch.bfloat16, 132, norm_before_gate=norm_before_gate)
    side = "before" if norm_before_gate else "after"
    assert cfg.fwd.tile_m * 128 == p.gated_narrow_fwd_tile_elems
    assert dict(cfg.fwd.hints) == {"occupancy": p.gated_narrow_occupancy, "num_worker_warps": p.gated_worker_warps}
    assert not cfg.fwd.walk and cfg.fwd.grid == (-(-(1 << 18) // cfg.fwd.tile_m), 1)
    assert cfg.bwd.tile_m * 128 == getattr(p, f"gated_narrow_bwd_{side}_tile_elems")
    assert cfg.bwd.grid == (132 * getattr(p, f"gated_narrow_bwd_{side}_blocks_per_sm"), 1)
    assert dict(cfg.bwd.hints).get("num_worker_warps", 0) == getattr(p, f"gated_narrow_bwd_{side}_worker_warps")
    assert dict(cfg.bwd.hints)["occupancy"] == p.gated_narrow_occupancy
    invariant = config.gated_config(1 << 18, 128, 128, torch.bfloat16, 132, invariant=True)
    assert invariant.fwd.tile_m == invariant.bwd.tile_m == 1
    assert invariant.fwd.walk


@pytest.mark.parametrize(
    "n,group_size,norm_before_gate,gate_dtype,warps",
    [
        (2048, 256, True, torch.bfloat16, "before"),  # rows of gated_bwd_grouped_before_row, groups of 128 and up
        (2048, 128, True, torch.bfloat16, "before"),
        (2048, 512, True, torch.bfloat16, "before"),
        (2048, 64, True, torch.bfloat16, "grouped"),  # narrower groups: where eight warps lost
        (4096, 256, True, torch.bfloat16, "grouped"),  # wider rows: likewise
        (2048, 256, False, torch.bfloat16, "grouped"),  # the gate before the norm: likewise
        (2048, 256, True, torch.float32, "gated"),  # an fp32 gate: the general gated settings
    ],
)
def test_cutile_grouped_backward_warps(n, group_size, norm_before_gate, gate_dtype, warps):
    """The grouped backward's warps with a 16-bit gate: gated_bwd_grouped_before_worker_warps for the norm before
    the gate on rows of gated_bwd_grouped_before_row padded columns in groups of at least
    gated_bwd_grouped_before_min_group, gated_bwd_grouped_worker_warps for other grouped rows (PERFORMANCE.md,
    "Gated RMSNorm"); an fp32 gate keeps gated_worker_warps."""
    from tilegym_rms.cutile import config

    p = config.HEURISTICS
    want = {
        "before": p.gated_bwd_grouped_before_worker_warps,
        "grouped": p.gated_bwd_grouped_worker_warps,
        "gated": p.gated_worker_warps,
    }[warps]
    cfg = config.gated_config(
        65536, n, group_size, torch.bfloat16, 132, gate_dtype=gate_dtype, norm_before_gate=norm_before_gate
    )
    assert dict(cfg.bwd.hints).get("num_worker_warps", 0) == want
    assert dict(cfg.bwd.hints)["occupancy"] == p.gated_occupancy
    with config.override(gated_bwd_grouped_before_worker_warps=0):  # the setting is what decides
        cfg = config.gated_config(
            65536, n, group_size, torch.bfloat16, 132, gate_dtype=gate_dtype, norm_before_gate=norm_before_gate
        )
        assert dict(cfg.bwd.hints).get("num_worker_warps", 0) == (0 if warps == "before" else want)


@pytest.mark.parametrize(
    "n,group_size,gate_dtype,invariant,grouped",
    [(8192, 1024, torch.bfloat16, False, True), (16384, 1024, torch.bfloat16, False, True),
     (8192, 2048, torch.bfloat16, False, False), (8192, 1024, torch.float32, False, False),
     (8192, 8192, torch.bfloat16, False, False), (8192, 1024, torch.bfloat16, True, False)],
)  # fmt: skip
def test_cutile_grouped_backward_keeps_its_settings_on_narrow_groups(n, group_size, gate_dtype, invariant, grouped):
    """Tile rows of 8192 columns take the wide backward's settings, except rows of several groups with a 16-bit gate
    (outside the batch-invariant mode) whose padded groups are narrower than gated_bwd_grouped_wide_min_group: those
    keep the grouped settings (PERFORMANCE.md, "Gated RMSNorm")."""
    from tilegym_rms.cutile import config

    p = config.HEURISTICS
    wide = {"occupancy": p.bwd_wide_occupancy, "num_worker_warps": p.bwd_wide_worker_warps}
    wide = {k: v for k, v in wide.items() if v}

    def bwd():
        return config.gated_config(65536, n, group_size, torch.bfloat16, 132, invariant, gate_dtype).bwd

    assert dict(bwd().hints) == wide  # the default: every wide row
    with config.override(gated_bwd_grouped_wide_min_group=2048):
        launch = bwd()
        assert (dict(launch.hints) != wide) == grouped
        if grouped:
            assert launch.grid[0] == 132 * p.gated_bwd_blocks_per_sm // launch.grid[1]
            assert dict(launch.hints).get("num_worker_warps", 0) == p.gated_bwd_grouped_worker_warps


@pytest.mark.parametrize(
    "group_size,tiles", [(768, (512, 256)), (1536, (1024, 512)), (1024, (1024, 0)), (80, (128, 0))]
)
def test_cutile_forward_holds_a_group_as_a_tile_and_a_tail_from_a_setting(group_size, tiles):
    """From gated_fwd_tail_min_group columns a group that is not a power of two is a tile and a narrower tail in the
    forward (config.split_row), narrower groups and powers of two keep one padded tile; the backward keeps its
    padded tiles; off by default."""
    from tilegym_rms.cutile import config

    n = 8 * group_size
    assert config.gated_config(40000, n, group_size, torch.bfloat16, 132).fwd.tail_s == 0
    with config.override(gated_fwd_tail_min_group=256):
        cfg = config.gated_config(40000, n, group_size, torch.bfloat16, 132)
    assert cfg.group_tiles(cfg.fwd) == tiles and cfg.bwd.tail_s == 0


def test_cutile_narrow_forward_walks_when_asked():
    """gated_narrow_fwd_walk on: the forward of narrow rows walks its row tiles with the general settings, as wider
    rows do; a partial last tile still gets a block."""
    from tilegym_rms.cutile import config

    p = config.HEURISTICS
    m = (1 << 18) + 3
    with config.override(gated_narrow_fwd_walk=True):
        cfg = config.gated_config(m, 128, 128, torch.bfloat16, 132)
        assert cfg.fwd.walk and cfg.bwd.walk and cfg.fwd.grid == (132 * p.gated_fwd_blocks_per_sm, 1)
        assert cfg.fwd.tile_m * 128 == min(p.gated_fwd_tile_elems, p.gated_max_tile_m * 128)
        assert dict(cfg.fwd.hints) == {"occupancy": p.gated_occupancy, "num_worker_warps": p.gated_worker_warps}
    cfg = config.gated_config(m, 128, 128, torch.bfloat16, 132)
    assert not cfg.fwd.walk and cfg.fwd.grid[0] * cfg.fwd.tile_m >= m > (cfg.fwd.grid[0] - 1) * cfg.fwd.tile_m
    assert config.gated_config(m, 4096, 512, torch.bfloat16, 132).fwd.walk


@pytest.mark.parametrize(
    "n,group_size,gate_dtype,tile_m",
    [
        (2048, 2048, torch.bfloat16, 4),  # 8192-element tiles below 4096 padded columns
        (4096, 4096, torch.bfloat16, 1),  # one group of 4096: two rows spill
        (4096, 512, torch.bfloat16, 2),  # eight groups with a 16-bit gate keep 8192-element tiles
        (4096, 512, torch.float32, 1),  # with an fp32 gate one row
    ],
)
def test_cutile_backward_rows_per_tile_follow_groups_and_gate(n, group_size, gate_dtype, tile_m):
    """The backward's rows per tile as measured fastest on an H100 (PERFORMANCE.md, "Gated RMSNorm"), as the
    compile check's host calls launch them (the gate's dtype reaches the rule)."""
    pytest.importorskip("cuda.tile")  # the [cuda] extra: the host builds its launches on the kernel module
    from tilegym_rms import aot

    found = aot.gated_variants_for(65536, n, group_size, torch.bfloat16, gate_dtype, every_path=False)
    tiles = {v.constants()["TILE_M"] for v in found if v.kernel_name == "gated_rms_norm_bwd"}
    assert tiles == {tile_m}


def test_cutile_tiles_in_the_batch_invariant_mode_do_not_follow_m():
    from tilegym_rms.cutile import config

    first = config.gated_config(1, 3072, 96, torch.bfloat16, 132, invariant=True)
    for m in (7, 4097, 65536, 1 << 20):
        cfg = config.gated_config(m, 3072, 96, torch.bfloat16, 132, invariant=True)
        assert (cfg.fwd.tile_m, cfg.fwd.tile_g, cfg.bwd.tile_m, cfg.bwd.tile_g) == (1, 32, 1, 32)
        assert cfg.fwd.grid == (m, 1) and cfg.fwd.hints == first.fwd.hints and cfg.bwd.hints == first.bwd.hints
    assert config.gated_config(4096, 32768, 32768, torch.bfloat16, 132) is None  # wider than any group tile


# ------------------------------------------------------------------------------------------------
# First contact: torch.compile(fullgraph=True) as the first call of a process
# ------------------------------------------------------------------------------------------------

GATED_COMPILE_FIRST = """
    import torch, tilegym_rms
    torch.manual_seed(0)
    norm = tilegym_rms.GatedRMSNorm(64, group_size=16, norm_before_gate=False, casting_mode="llama").to(DEVICE)
    x = torch.randn(3, 5, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    z = torch.randn(3, 5, 64, device=DEVICE, requires_grad=True)
    compiled = torch.compile(norm, fullgraph=True)  # before any eager tilegym_rms call
    compiled(x, z).float().square().sum().backward()
    got = [t.grad.clone() for t in (x, z, norm.weight)]
    for t in (x, z, norm.weight):
        t.grad = None
    norm(x, z).float().square().sum().backward()
    for a, t in zip(got, (x, z, norm.weight)):
        assert torch.equal(a, t.grad), (a, t.grad)
    print("ok")
"""


def test_compile_fullgraph_as_first_call_in_a_fresh_process():
    from test_dropin import run_fresh

    assert run_fresh("DEVICE = 'cpu'\n" + textwrap.dedent(GATED_COMPILE_FIRST)).strip().endswith("ok")


@pytest.mark.gpu
def test_compile_fullgraph_as_first_call_on_gpu():
    from test_dropin import run_fresh

    env = {"TILEGYM_RMS_SILENCE_EXPERIMENTAL": "1"}
    assert run_fresh("DEVICE = 'cuda'\n" + textwrap.dedent(GATED_COMPILE_FIRST), env).strip().endswith("ok")


@pytest.mark.parametrize("group_size", [None, 32])
def test_torch_rows_are_batch_invariant_in_the_mode(group_size):
    """The torch backend on the CPU, as for the plain norm: a row's y, dx and dz alone and in batches."""
    n = 128
    w = weight_of(n, torch.bfloat16).requires_grad_()

    def run(b):
        x, z = b["x"].detach().requires_grad_(), b["residual"].detach().requires_grad_()
        y = tilegym_rms.gated_rms_norm(x, z, w, 1e-6, group_size=group_size, casting_mode="llama", backend="torch")
        dx, dz = torch.autograd.grad(y, (x, z), b["dy"])
        return {"y": y.detach(), "dx": dx, "dz": dz}, {}

    with tilegym_rms.batch_invariant():
        assert_rows_invariant(RowOp(("x", "residual", "dy"), run), row_probes(n, torch.bfloat16), [1, 7, 600])
