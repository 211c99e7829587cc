"""The Ascend (triton-ascend) RMSNorm kernels under the Triton interpreter, on CPU tensors.

``TRITON_INTERPRET=1`` is set before anything imports the kernels module (Triton decides between
compiling and interpreting when a kernel is decorated). On a host with CUDA the module runs only
when ``TRITON_INTERPRET=1`` is set explicitly, so that a plain ``pytest`` there compiles the kernels
for the GPU tests in test_triton_gpu.py. Results are compared against
:mod:`tilegym_rms.reference` in float64. Shapes are kept small: the interpreter is slow.
"""

import os
import types

import pytest

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if torch.cuda.is_available():
        # Triton decides interpret-or-compile per process: setting it here would turn every Triton
        # kernel of this pytest run into an interpreted one, including the GPU tests.
        pytest.skip(
            "GPU host: the interpreter tests run only with TRITON_INTERPRET=1 set explicitly "
            "(e.g. TRITON_INTERPRET=1 pytest tests/test_triton_interpreter.py)",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"

import ast  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from conftest import rel_err, strided  # noqa: E402
from test_batch_invariance import assert_rows_invariant, plain_ops, row_probes, weight_of  # noqa: E402

pytest.importorskip("triton")
pytest.importorskip("numpy", reason="the Triton interpreter needs numpy")

from tilegym_rms import experimental  # noqa: E402
from tilegym_rms import reference as ref  # noqa: E402
from tilegym_rms.triton import config  # noqa: E402

if not config.interpreter_enabled():
    pytest.skip("TRITON_INTERPRET is set to something other than 1", allow_module_level=True)

import tilegym_rms  # noqa: E402
import tilegym_rms.triton as triton_backend  # noqa: E402
from tilegym_rms.triton import kernels  # noqa: E402
from tilegym_rms.triton import launch as launch_mod  # noqa: E402

if type(kernels.rms_norm_fwd_kernel).__name__ != "InterpretedFunction":
    pytest.skip("the kernels were compiled before TRITON_INTERPRET was set", allow_module_level=True)

EPS = 1e-6
TOL_FP32 = 1e-5
# Budgets that force the column-partitioned path (see config.max_tile_elems):
UB_TINY = 2048  # forward chunks of 64 columns, fused-add and backward chunks of 32
UB_SMALL = 8192  # forward chunks of 256 columns, fused-add and backward chunks of 128

# (M, N, TILEGYM_RMS_UB_BYTES or None, expected forward path)
SHAPES = [
    pytest.param(1, 1, None, "block", id="1x1"),
    pytest.param(7, 123, None, "block", id="7x123-ragged"),
    pytest.param(16, 64, None, "block", id="16x64-aligned"),
    pytest.param(5, 1000, None, "block", id="5x1000"),
    pytest.param(7, 123, UB_TINY, "partitioned", id="7x123-partitioned"),
    pytest.param(6, 128, UB_TINY, "partitioned", id="6x128-partitioned-aligned"),
    pytest.param(3, 1000, UB_SMALL, "partitioned", id="3x1000-partitioned"),
    pytest.param(4100, 8, None, "block_row", id="4100x8-block_row-ragged"),
    pytest.param(4096, 16, None, "block_row", id="4096x16-block_row-aligned"),
]


def rand(*shape, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def weight_for(N, kind, dtype=torch.float32):
    """``kind``: "w" (weight, offset 0), "w+1" (Gemma-style weight around 0, offset 1), "none"."""
    if kind == "none":
        return None, 0.0
    w = rand(N, dtype=dtype, seed=7)
    return (w, 1.0) if kind == "w+1" else (w.abs() + 0.5, 0.0)


@pytest.fixture
def ub(monkeypatch):
    def set_ub(value):
        if value is None:
            monkeypatch.delenv(config.UB_BYTES_ENV, raising=False)
        else:
            monkeypatch.setenv(config.UB_BYTES_ENV, str(value))

    set_ub(None)
    return set_ub


@pytest.fixture
def launches(monkeypatch):
    """Records (kernel, args, constexprs) of every launch, still launching for real."""
    calls = []
    real = launch_mod.launch

    def spy(kernel, grid, *args, **constexprs):
        calls.append((kernel, grid, args, constexprs))
        return real(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(launch_mod, "launch", spy)
    return calls


# ------------------------------------------------------------------------------------------------
# Dispatch (pure functions)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("M", "N", "op", "ub_bytes", "expected"),
    [
        (1, 1, "forward", None, "block"),
        (7, 123, "forward", None, "block"),
        (100, 4096, "forward", None, "block"),
        (100, 4097, "forward", None, "partitioned"),
        (100, 5120, "forward", None, "partitioned"),
        (100, 4096, "fused_add", None, "block"),
        (100, 8192, "fused_add", None, "partitioned"),
        (100, 2048, "backward", None, "block"),
        (100, 4096, "backward", None, "partitioned"),
        (config.BLOCK_ROW_MIN_M, config.BLOCK_ROW_MAX_N, "forward", None, "block_row"),
        (config.BLOCK_ROW_MIN_M, config.BLOCK_ROW_MAX_N, "backward", None, "block_row"),
        (config.BLOCK_ROW_MIN_M - 1, config.BLOCK_ROW_MAX_N, "forward", None, "block"),
        (config.BLOCK_ROW_MIN_M, config.BLOCK_ROW_MAX_N + 1, "forward", None, "block"),
        (65536, 1, "backward", None, "block_row"),
        (7, 123, "forward", UB_TINY, "partitioned"),
        (7, 64, "forward", UB_TINY, "block"),
        (8192, 123, "backward", UB_TINY, "partitioned"),
        (3, 1000, "backward", UB_SMALL, "partitioned"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_choose_path(ub, M, N, op, ub_bytes, expected, dtype):
    ub(ub_bytes)
    assert config.choose_path(M, N, dtype, op) == expected
    tiles = config.choose_tiles(M, N, dtype, op)
    assert tiles.path == expected
    budget = config.max_tile_elems(op)
    for size in (tiles.block_m, tiles.block_n):
        assert size & (size - 1) == 0, "tl.arange sizes must be powers of two"
    assert tiles.block_m * tiles.block_n <= budget, "the tile must fit the Unified Buffer budget"
    assert tiles.num_tasks == -(-M // tiles.block_m)
    assert tiles.even_m == (M % tiles.block_m == 0) and tiles.even_n == (N % tiles.block_n == 0)
    if expected == "partitioned":
        assert tiles.block_m == 1 and tiles.block_n < N, "a row that does not fit is split into column chunks"
    else:
        assert tiles.block_n >= N
    if expected == "block":
        assert tiles.block_m <= min(config.BLOCK_M_CAP, config.next_pow2(M))
    if expected == "block_row":
        assert 1 < tiles.block_m <= config.BLOCK_ROW_CAP


def test_ub_budget_default_and_override(ub):
    assert config.ub_bytes() == 192 * 1024
    # 192 KB, safety margin, double buffering, 3 fp32 tiles per element -> 4096-element tiles.
    assert config.max_tile_elems("forward") == 4096
    assert config.max_tile_elems("backward") == 2048
    ub(UB_TINY)
    assert config.max_tile_elems("forward") == 64
    ub(1)
    assert config.max_tile_elems("backward") == config.MIN_TILE_ELEMS
    ub("lots")
    with pytest.raises(ValueError, match=config.UB_BYTES_ENV):
        config.ub_bytes()


def test_grid_size_never_zero_and_trimmed():
    cpu = torch.device("cpu")
    assert config.num_programs(cpu) == config.INTERPRETER_NUM_PROGRAMS
    assert config.grid_size(0, cpu) == 1
    assert config.grid_size(2, cpu) == 2
    assert config.grid_size(1000, cpu) == config.INTERPRETER_NUM_PROGRAMS


@pytest.mark.parametrize(("M", "N", "ub_bytes"), [(7, 123, None), (7, 123, UB_TINY), (4100, 8, None), (4097, 16, None)])
def test_launch_uses_choose_path(ub, launches, M, N, ub_bytes):
    """The launch code takes the path choose_path names, for every op; grid and dw buffer agree."""
    ub(ub_bytes)
    x, w = strided(M, N), rand(N)
    y, rstd = triton_backend.forward(x, w, EPS, 0.0, "llama")
    triton_backend.fused_add_forward(x, rand(M, N), w, EPS, 0.0, "llama", mode="pre")
    triton_backend.backward(x, rand(M, N), w, rstd, 0.0, "llama")
    (fwd, fused, bwd, reduce) = launches
    for (kernel, grid, _args, flags), op in zip((fwd, fused, bwd), ("forward", "fused_add", "backward"), strict=True):
        path = config.choose_path(M, N, x.dtype, op)
        tiles = config.choose_tiles(M, N, x.dtype, op)
        if path == "partitioned":
            assert kernel in (kernels.rms_norm_fwd_partitioned_kernel, kernels.rms_norm_bwd_partitioned_kernel)
        else:
            assert kernel in (kernels.rms_norm_fwd_kernel, kernels.rms_norm_bwd_kernel)
            assert flags["BLOCK_ROW_SCHEDULE"] == (path == "block_row")
        assert (flags["BLOCK_M"], flags["BLOCK_N"]) == (tiles.block_m, tiles.block_n)
        assert (flags["EVEN_M"], flags["EVEN_N"]) == (tiles.even_m, tiles.even_n)
        assert 1 <= grid[0] <= min(config.INTERPRETER_NUM_PROGRAMS, tiles.num_tasks)
    partial = bwd[2][5]
    assert partial.shape == (bwd[1][0], N) and partial.dtype == torch.float32, "grid x N fp32 dw partials"
    assert reduce[0] is kernels.rms_norm_dw_reduce_kernel and reduce[2][0] is partial
    assert triton_backend.backward_workspace_bytes(M, N, x.dtype, x.device) == partial.numel() * 4


@pytest.mark.parametrize("path", config.PATHS)
def test_forward_forced_path(ub, launches, path):
    """``mode=`` forces a path (the dispatcher's forward contract); the result does not change."""
    M, N = 37, 123
    x, w = strided(M, N), rand(N)
    y, rstd = triton_backend.forward(x, w, EPS, 1.0, "gemma", kernel=path)
    kernel, _, _, flags = launches[-1]
    if path == "partitioned":
        assert kernel is kernels.rms_norm_fwd_partitioned_kernel
    else:
        assert kernel is kernels.rms_norm_fwd_kernel and flags["BLOCK_ROW_SCHEDULE"] == (path == "block_row")
    y_ref, rstd_ref = ref.rms_norm_forward(x.double(), w.double(), EPS, 1.0, "gemma")
    assert rel_err(y, y_ref) <= TOL_FP32 and rel_err(rstd, rstd_ref) <= TOL_FP32
    ub(UB_TINY)
    if path != "partitioned":
        with pytest.raises(ValueError, match="whole row"):
            triton_backend.forward(x, w, EPS, 1.0, "gemma", kernel=path)


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("M", "N", "ub_bytes", "path"), SHAPES)
@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
def test_forward_fp32(ub, M, N, ub_bytes, path, casting_mode):
    ub(ub_bytes)
    assert config.choose_path(M, N, torch.float32, "forward") == path
    x = strided(M, N)
    # Cycle the weight kinds over the casting modes to cover offset 1 and weight None cheaply.
    kind = {"torch": "w", "llama": "w", "gemma": "w+1", "none": "none"}[casting_mode]
    w, offset = weight_for(N, kind)
    y, rstd = triton_backend.forward(x, w, EPS, offset, casting_mode)
    y_ref, rstd_ref = ref.rms_norm_forward(x.double(), None if w is None else w.double(), EPS, offset, casting_mode)
    assert y.shape == (M, N) and y.is_contiguous() and y.dtype == x.dtype
    assert rstd.shape == (M,) and rstd.dtype == torch.float32
    assert rel_err(y, y_ref) <= TOL_FP32
    assert rel_err(rstd, rstd_ref) <= TOL_FP32


@pytest.mark.parametrize(("M", "N", "ub_bytes", "path"), [SHAPES[1], SHAPES[4], SHAPES[7]])
@pytest.mark.parametrize("kind", ["w", "w+1", "none"])
def test_forward_weight_kinds_llama(ub, M, N, ub_bytes, path, kind):
    ub(ub_bytes)
    x = strided(M, N)
    w, offset = weight_for(N, kind)
    y, _ = triton_backend.forward(x, w, EPS, offset, "llama")
    y_ref, _ = ref.rms_norm_forward(x.double(), None if w is None else w.double(), EPS, offset, "llama")
    assert rel_err(y, y_ref) <= TOL_FP32


@pytest.mark.parametrize(("M", "N", "ub_bytes"), [(7, 123, None), (7, 123, UB_TINY), (4100, 8, None)])
@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
def test_forward_fp16_matches_casting_mode(ub, M, N, ub_bytes, casting_mode):
    """Against the reference in fp16, the roundings of each casting mode must line up: only the fp32
    summation order differs, so nearly every element is bit-identical (a wrong rounding step would
    change most of them)."""
    ub(ub_bytes)
    x = strided(M, N, torch.float16)
    w, offset = rand(N, dtype=torch.float32, seed=3), 1.0  # weight dtype may differ from x
    y, rstd = triton_backend.forward(x, w, EPS, offset, casting_mode)
    y_ref, rstd_ref = ref.rms_norm_forward(x, w, EPS, offset, casting_mode)
    assert y.dtype == torch.float16
    if casting_mode == "none":
        # rstd is an fp16 value here. torch's scalar CPU rsqrt for fp16 is not correctly rounded (it
        # can be one ulp off), so allow one fp16 ulp and check the later roundings given our rstd.
        assert ((rstd - rstd_ref).abs() <= rstd_ref.abs() * 2.0**-10).all()
        assert torch.equal(rstd.half().float(), rstd), "mode none rounds rstd to fp16"
        y_ref = (x * rstd.half()[:, None]) * (w + offset).half()
    else:
        assert rel_err(rstd, rstd_ref) <= 1e-5
    mismatch = (y != y_ref).double().mean().item()
    assert mismatch <= 0.01, f"{mismatch:.2%} of elements differ from the fp16 reference"
    y64, _ = ref.rms_norm_forward(x.double(), w.double(), EPS, offset, casting_mode)
    assert rel_err(y, y64) <= 1e-2


def is_bf16_value(t):
    """Per element: whether the fp32 value is exactly a bf16 value."""
    return t.to(torch.bfloat16).float() == t


@pytest.mark.parametrize("ub_bytes", [None, UB_TINY])
def test_forward_bf16_casting_modes(ub, launches, ub_bytes):
    """bf16 under the interpreter, which rounds fp32 -> bf16 by truncation (hardware rounds to nearest):
    no bit-level agreement with torch's bf16 here, and the modes differ by about one rounding, less than
    a float64 tolerance can tell apart. What can be told apart: the host hands the kernel each mode's
    CASTING id (whose rounding steps test_forward_fp16_matches_casting_mode checks bit for bit; the
    kernels branch on CASTING, not on the dtype), the outputs of the modes differ where the reference's
    do, and rstd is rounded to bf16 in exactly the mode where the reference rounds it."""
    ub(ub_bytes)
    x, w = strided(7, 123, torch.bfloat16), rand(123, dtype=torch.bfloat16, seed=3)
    ys, refs = {}, {}
    for casting_mode in ref.CASTING_MODES:
        y, rstd = triton_backend.forward(x, w, EPS, 1.0, casting_mode)
        assert launches[-1][3]["CASTING"] == ref.CASTING_CODES[casting_mode]
        y_ref, rstd_ref = ref.rms_norm_forward(x, w, EPS, 1.0, casting_mode)
        ys[casting_mode], refs[casting_mode] = y, y_ref
        assert y.dtype == torch.bfloat16 and rstd.dtype == torch.float32
        assert torch.equal(is_bf16_value(rstd), is_bf16_value(rstd_ref)), casting_mode
        if is_bf16_value(rstd_ref).all():  # rounded to bf16: within two bf16 ulps (truncation here)
            assert ((rstd - rstd_ref).abs() <= rstd_ref * 2.0**-6).all()
        else:  # fp32: only the summation order differs
            assert rel_err(rstd, rstd_ref) <= 1e-5
        y64, _ = ref.rms_norm_forward(x.double(), w.double(), EPS, 1.0, casting_mode)
        assert rel_err(y, y64) <= 2e-2
    modes = ref.KERNEL_CASTING_MODES  # ("torch" is "gemma" here)
    for a, b in ((m1, m2) for i, m1 in enumerate(modes) for m2 in modes[i + 1 :]):
        assert (refs[a] != refs[b]).double().mean() > 0.1, "inputs on which the reference tells the modes apart"
        assert (ys[a] != ys[b]).double().mean() > 0.1, f"{a} and {b} give the same bf16 output"


def test_forward_store_rstd_false(ub):
    x, w = strided(7, 123), rand(123)
    y, rstd = triton_backend.forward(x, w, EPS, 0.0, "llama", store_rstd=False)
    assert rstd is None
    assert torch.equal(y, triton_backend.forward(x, w, EPS, 0.0, "llama")[0])
    ub(UB_TINY)
    y, rstd = triton_backend.forward(x, w, EPS, 0.0, "gemma", store_rstd=False)
    assert rstd is None
    assert rel_err(y, ref.rms_norm_forward(x.double(), w.double(), EPS, 0.0, "gemma")[0]) <= TOL_FP32


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("M", "N", "ub_bytes", "path"), SHAPES)
@pytest.mark.parametrize("kind", ["w", "w+1", "none"])
def test_backward_fp32(ub, M, N, ub_bytes, path, kind):
    ub(ub_bytes)
    x = strided(M, N)
    dy = strided(M, N, pad=5, seed=2)  # dy has its own row stride
    w, offset = weight_for(N, kind)
    w64 = None if w is None else w.double()
    _, rstd = ref.rms_norm_forward(x, w, EPS, offset, "llama")
    dx, dw = triton_backend.backward(x, dy, w, rstd, offset, "llama")
    dx_ref, dw_ref = ref.rms_norm_backward(x.double(), dy.double(), w64, rstd.double(), offset)
    assert dx.shape == (M, N) and dx.is_contiguous() and dx.dtype == x.dtype
    # dx = rstd*(g - x^*mean(x^*g)) cancels to ~0 when N == 1; measure against the scale of rstd*g.
    g = dy.double() if w is None else dy.double() * (w64 + offset)
    scale = max(dx_ref.norm().item(), (rstd.double()[:, None] * g).norm().item())
    assert (dx.double() - dx_ref).norm().item() <= TOL_FP32 * scale
    if w is None:
        assert dw is None
    else:
        assert dw.shape == (N,) and dw.dtype == w.dtype
        assert rel_err(dw, dw_ref) <= TOL_FP32


@pytest.mark.parametrize("ub_bytes", [None, UB_TINY])
def test_backward_deterministic_and_casting_independent(ub, ub_bytes):
    ub(ub_bytes)
    M, N = 37, 123
    x, dy, w = strided(M, N), rand(M, N), rand(N)
    rstd = triton_backend.forward(x, w, EPS, 0.0, "llama")[1]
    dx0, dw0 = triton_backend.backward(x, dy, w, rstd, 0.0, "llama")
    for mode in ref.CASTING_MODES:
        dx, dw = triton_backend.backward(x, dy, w, rstd, 0.0, mode)
        assert torch.equal(dx, dx0) and torch.equal(dw, dw0), "bitwise identical on every run"


@pytest.mark.parametrize("ub_bytes", [None, UB_TINY])
def test_backward_low_precision(ub, ub_bytes):
    ub(ub_bytes)
    M, N = 9, 123
    x, dy = strided(M, N, torch.bfloat16), rand(M, N, dtype=torch.bfloat16)
    w = rand(N, dtype=torch.float16, seed=4)
    rstd = triton_backend.forward(x, w, EPS, 0.0, "llama")[1]
    dx, dw = triton_backend.backward(x, dy, w, rstd, 0.0, "llama")
    dx_ref, dw_ref = ref.rms_norm_backward(x.double(), dy.double(), w.double(), rstd.double(), 0.0)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float16
    assert rel_err(dx, dx_ref) <= 1e-2
    assert rel_err(dw, dw_ref) <= 1e-2


# ------------------------------------------------------------------------------------------------
# Fused residual add
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("M", "N", "ub_bytes", "path"), SHAPES)
@pytest.mark.parametrize("mode", ref.FUSED_ADD_MODES)
def test_fused_add_fp32(ub, M, N, ub_bytes, path, mode):
    ub(ub_bytes)
    casting_mode = "gemma" if mode == "pre" else "llama"
    x, r = strided(M, N), strided(M, N, pad=1, seed=5)
    w, offset = weight_for(N, "w+1" if mode == "pre" else "w")
    y, res_out, rstd = triton_backend.fused_add_forward(x, r, w, EPS, offset, casting_mode, mode=mode)
    y_ref, res_ref, rstd_ref = ref.fused_add_rms_norm_forward(
        x.double(), r.double(), w.double(), EPS, mode, offset, casting_mode
    )
    assert rel_err(y, y_ref) <= TOL_FP32
    assert rel_err(res_out, res_ref) <= TOL_FP32
    assert rel_err(rstd, rstd_ref) <= TOL_FP32
    if mode == "pre":
        assert torch.equal(res_out, x + r), "the sum is rounded to x's dtype exactly like torch's add"


@pytest.mark.parametrize("ub_bytes", [None, UB_TINY])
@pytest.mark.parametrize("mode", ref.FUSED_ADD_MODES)
def test_fused_add_outputs_and_gradients(ub, launches, ub_bytes, mode):
    """Through the public API on this backend: ``residual_out`` is the sum ("pre") or the normalized sum
    ("post", which writes no sum: one (M, N) store fewer), and gradients through both outputs match
    autograd through the float64 reference (in "post" both gradients reach the norm)."""
    ub(ub_bytes)
    M, N = 7, 123
    x64, r64, w64 = strided(M, N).double(), rand(M, N, seed=5).double(), rand(N, seed=6).double()
    gy, gres = rand(M, N, seed=8), rand(M, N, seed=9)
    x, r, w = (t.float().requires_grad_() for t in (x64, r64, w64))
    y, res_out = tilegym_rms.fused_add_rms_norm(x, r, w, EPS, mode=mode, offset=0.5, backend="triton")
    assert launches[0][3]["STORE_RESIDUAL"] == (mode == "pre")
    ((y * gy).sum() + (res_out * gres).sum()).backward()
    x64, r64, w64 = (t.requires_grad_() for t in (x64, r64, w64))
    y_ref, res_ref, _ = ref.fused_add_rms_norm_forward(x64, r64, w64, EPS, mode, 0.5)
    ((y_ref * gy.double()).sum() + (res_ref * gres.double()).sum()).backward()
    assert rel_err(y, y_ref.detach()) <= TOL_FP32 and rel_err(res_out, res_ref.detach()) <= TOL_FP32
    for got, want in ((x.grad, x64.grad), (r.grad, r64.grad), (w.grad, w64.grad)):
        assert rel_err(got, want) <= 1e-4


@pytest.mark.parametrize("ub_bytes", [None, UB_TINY])
@pytest.mark.parametrize("mode", ref.FUSED_ADD_MODES)
def test_fused_add_fp16_no_weight_no_rstd(ub, ub_bytes, mode):
    ub(ub_bytes)
    M, N = 7, 123
    x, r = strided(M, N, torch.float16), rand(M, N, dtype=torch.float16)
    y, res_out, rstd = triton_backend.fused_add_forward(x, r, None, EPS, 0.0, "llama", mode=mode, store_rstd=False)
    y_ref, res_ref, _ = ref.fused_add_rms_norm_forward(x, r, None, EPS, mode, 0.0, "llama")
    assert rstd is None
    assert (y != y_ref).double().mean().item() <= 0.01
    assert rel_err(y, y_ref) <= 4e-3
    if mode == "pre":
        assert torch.equal(res_out, res_ref)


# ------------------------------------------------------------------------------------------------
# Batch invariance (the checker: test_batch_invariance.py)
# ------------------------------------------------------------------------------------------------

# Ms that reach every row tile of the block path (1 to 16 rows, with and without the row mask), the block-row
# path (N = 16 only: the interpreter is slow), and the column chunks (UB_TINY; one row per tile at every M).
INVARIANCE_CASES = [
    pytest.param(16, None, [1, 2, 3, 5, 9, 17, config.BLOCK_ROW_MIN_M + 1], id="16-block_row"),
    pytest.param(123, None, [1, 2, 3, 4, 5, 8, 9, 16, 17], id="123"),
    pytest.param(123, UB_TINY, [1, 2, 3, 17], id="123-partitioned"),
]


@pytest.mark.parametrize("op_name", ["forward", "backward", "fused_add", "in_place"])
@pytest.mark.parametrize(("N", "ub_bytes", "ms"), INVARIANCE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_are_batch_invariant(ub, dtype, N, ub_bytes, ms, op_name):
    """In the batch-invariant mode, at the Ms where the default path's tiles and schedule change."""
    ub(ub_bytes)
    op = plain_ops(weight_of(N, dtype), backend="triton")[op_name]
    with tilegym_rms.batch_invariant():
        describe = lambda m: config.choose_tiles(m, N, dtype, invariant=True)  # noqa: E731
        assert_rows_invariant(op, row_probes(N, dtype), ms, describe=describe)


# ------------------------------------------------------------------------------------------------
# Edge cases, launch helper, experimental marking, lazy imports
# ------------------------------------------------------------------------------------------------


def test_empty_rows_launch_nothing(launches):
    """The product never hands a backend an empty input: ops answers it without a launch."""
    x, w = torch.empty(0, 16), rand(16)
    y, rstd = tilegym_rms.rms_norm_forward(x, w, EPS, backend="triton")
    assert y.shape == (0, 16) and rstd.shape == (0,)
    y, res_out = tilegym_rms.fused_add_rms_norm(x, x, w, EPS, backend="triton")
    assert y.shape == res_out.shape == (0, 16)
    dx, dw = tilegym_rms.rms_norm_backward(x, x, w, rstd, backend="triton")
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros(16))
    assert tilegym_rms.rms_norm_backward(x, x, None, rstd, backend="triton")[1] is None
    assert launches == []


def test_kernels_marked_experimental_where_they_have_not_run():
    """Every kernel on the NPU (none has run on one); none on NVIDIA GPUs, where the GPU suite runs each."""
    assert {kernels.gated_rms_norm_fwd_kernel, kernels.gated_rms_norm_bwd_kernel} <= set(kernels.ALL_KERNELS)
    for kernel in kernels.ALL_KERNELS:
        assert experimental.is_experimental(kernel, "npu")
        assert not experimental.is_experimental(kernel, "cpu")
        assert not experimental.is_experimental(kernel, "cuda")


def test_no_experimental_warning_on_cpu(monkeypatch):
    monkeypatch.delenv(experimental.SILENCE_ENV, raising=False)
    experimental._reset_warnings()
    notified = []
    real = experimental.notify_launch
    monkeypatch.setattr(launch_mod, "notify_launch", lambda k, d: (notified.append((k, d)), real(k, d)))
    x, w = strided(5, 32), rand(32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", experimental.ExperimentalKernelWarning)
        _, rstd = triton_backend.forward(x, w, EPS, 0.0, "llama")
        triton_backend.backward(x, rand(5, 32), w, rstd, 0.0, "llama")
    assert [k for k, _ in notified] == [
        kernels.rms_norm_fwd_kernel,
        kernels.rms_norm_bwd_kernel,
        kernels.rms_norm_dw_reduce_kernel,
    ]
    assert {d for _, d in notified} == {"cpu"}


def test_launch_helper_warns_for_npu_launches(monkeypatch):
    """What an Ascend user sees: the launch helper passes the tensors' device type to the registry."""
    monkeypatch.delenv(experimental.SILENCE_ENV, raising=False)
    experimental._reset_warnings()
    monkeypatch.setattr(launch_mod, "_device_of", lambda args: types.SimpleNamespace(type="npu", index=0))
    # torch_npu's torch.npu, with device 0 current: the launch needs no other device made current.
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(current_device=lambda: 0), raising=False)

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    fake = experimental.experimental_kernel(on=("npu",))(FakeKernel())
    with pytest.warns(experimental.ExperimentalKernelWarning, match="on npu"):
        launch_mod.launch(fake, (1,))


def test_available():
    assert triton_backend.available(torch.device("cpu")) == (True, "")


def test_available_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = triton_backend.available(torch.device("cpu"))
    assert not ok and "TRITON_INTERPRET=1" in why


def test_import_without_triton():
    """Importing the package must not need triton; available() says what is missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, tilegym_rms.triton as a\n"
        "print(a.available(torch.device('cpu')))\n"
        "print(a.choose_path(8, 64, torch.float32))\n"
        "assert 'tilegym_rms.triton.kernels' not in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, check=True)
    assert out.stdout.splitlines() == [repr((False, triton_backend._TRITON_INSTALL_HINT)), "block"]


def test_kernel_source_avoids_what_triton_ascend_rejects():
    """No launch/load hints triton-ascend ignores or rejects, no atomics, no fp64, no unsigned types."""
    tree = ast.parse(Path(kernels.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
    banned = {"num_warps", "num_stages", "cache_modifier", "eviction_policy", "float64", "fp64"}
    assert not names & banned
    assert not [n for n in names if n.startswith(("atomic", "uint"))]


# --------------------------------------------------------------------------------------------------
# Gated RMSNorm (gated_rms_norm) on the Triton kernels
# --------------------------------------------------------------------------------------------------


def _gated_fp64(x, z, w, group_size, norm_before_gate, offset, activation="silu"):
    """The reference's math in float64 on float64 copies: what the fp32 kernels are held to."""
    d = [t.double() if t is not None else None for t in (x, z, w)]
    args = (group_size, norm_before_gate, offset, "gemma", activation)
    return ref.gated_rms_norm_forward(d[0], d[1], d[2], EPS, *args)


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize(
    "m,n,group_size,weight,offset,activation",
    [
        (7, 48, None, True, 0.0, "silu"),
        (9, 96, 32, True, 1.0, "silu"),
        (5, 60, 20, False, 0.0, "silu"),
        (33, 128, 16, True, 0.0, "silu"),
        (7, 48, None, True, 0.0, "sigmoid"),
        (9, 96, 32, True, 1.0, "sigmoid"),
        (5, 60, 20, False, 0.0, "sigmoid"),
    ],
)
def test_gated_kernels_match_fp64(m, n, group_size, weight, offset, activation, norm_before_gate, monkeypatch):
    """Forward, rstd and every gradient against float64, on row-strided x and a transposed gate (groups
    whose size is not a power of two, many row blocks), for either gate."""
    launched = []
    monkeypatch.setattr(launch_mod, "notify_launch", lambda kernel, device: launched.append(kernel))
    x = strided(m, n, seed=3).requires_grad_()
    z = rand(n, m, seed=4).t().requires_grad_()
    w = rand(n, seed=5).requires_grad_() if weight else None
    kw = dict(group_size=group_size, norm_before_gate=norm_before_gate, offset=offset, casting_mode="gemma")
    y = tilegym_rms.gated_rms_norm(x, z, w, EPS, backend="triton", activation=activation, **kw)
    expected, _ = _gated_fp64(x.detach(), z.detach(), None if w is None else w.detach(), group_size,
                              norm_before_gate, offset, activation)  # fmt: skip
    assert rel_err(y, expected) <= TOL_FP32
    _, rstd = triton_backend.gated_forward(x.detach(), z.detach().contiguous(), None if w is None else w.detach(),
                                           EPS, offset, "gemma", group_size=group_size or n,
                                           norm_before_gate=norm_before_gate, activation=activation)  # fmt: skip
    assert rstd.shape == (m, n // (group_size or n))
    want_rstd = _gated_fp64(x.detach(), z.detach(), None, group_size, norm_before_gate, 0.0, activation)[1]
    assert rel_err(rstd, want_rstd) <= TOL_FP32
    dy = rand(m, n, seed=6)
    inputs = [t for t in (x, z, w) if t is not None]
    grads = torch.autograd.grad(y, inputs, dy)
    copies = [t.detach().double().requires_grad_() for t in inputs]
    xd, zd, wd = copies[0], copies[1], (copies[2] if weight else None)
    out = ref.gated_rms_norm_forward(xd, zd, wd, EPS, group_size, norm_before_gate, offset, "gemma", activation)[0]
    for got, want in zip(grads, torch.autograd.grad(out, copies, dy.double()), strict=True):
        assert rel_err(got, want) <= TOL_FP32
    expected_launches = [kernels.gated_rms_norm_fwd_kernel] * 2 + [kernels.gated_rms_norm_bwd_kernel]
    assert launched == expected_launches + [kernels.rms_norm_dw_reduce_kernel] * weight


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("casting_mode", ["llama", "none"])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_kernels_round_as_the_reference(casting_mode, norm_before_gate, activation):
    """The 16-bit casting modes in fp32 storage would hide their roundings: the kernels take fp32, so check that
    they compute the reference's fp32 result for each mode (same rounding points, fp32 arithmetic)."""
    x, z, w = rand(6, 64, seed=7), rand(6, 64, seed=8), rand(64, seed=9)
    y = tilegym_rms.gated_rms_norm(x, z, w, EPS, group_size=16, norm_before_gate=norm_before_gate,
                                   casting_mode=casting_mode, activation=activation, backend="triton")  # fmt: skip
    expected, _ = ref.gated_rms_norm_forward(x, z, w, EPS, 16, norm_before_gate, 0.0, casting_mode, activation)
    assert rel_err(y, expected) <= TOL_FP32


def test_gated_groups_wider_than_the_budget_run_the_torch_math(monkeypatch):
    """A group that does not fit one tile of the UB budget: the reference's math, and no kernel launch."""
    monkeypatch.setenv(config.UB_BYTES_ENV, str(UB_TINY))
    launched = []
    monkeypatch.setattr(launch_mod, "notify_launch", lambda kernel, device: launched.append(kernel))
    x, z = rand(3, 256, seed=10), rand(3, 256, seed=11)
    y = tilegym_rms.gated_rms_norm(x, z, None, EPS, backend="triton")
    assert launched == []
    assert rel_err(y, _gated_fp64(x, z, None, None, True, 0.0)[0]) <= TOL_FP32


def test_a_residual_of_a_dtype_the_backend_lacks_is_named():
    """fp64 is the torch backend's alone: a residual of it is refused by its own name, not as x."""
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match=r"^backend 'triton' supports residual of dtype .* got torch.float64"):
        tilegym_rms.fused_add_rms_norm(x, x.double(), None, EPS, backend="triton")
    with pytest.raises(TypeError, match=r"supports residual of dtype"), torch.no_grad():
        tilegym_rms.fused_add_rms_norm_fp8(x, x.double(), None, EPS, backend="triton")
