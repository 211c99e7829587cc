"""The Ascend (triton-ascend) RMSNorm kernels compiled by standard Triton on an NVIDIA GPU.

Run alone, without ``TRITON_INTERPRET``: ``pytest -m gpu tests/test_triton_gpu.py``. The
module skips when ``TRITON_INTERPRET`` is set (the interpreter tests in test_triton_interpreter.py set it
for the whole process) or when CUDA is missing. Everything is compared against
:mod:`tilegym_rms.reference` in float64.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0"):
    pytest.skip("TRITON_INTERPRET is set: these tests need compiled Triton", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from conftest import BIG_GPU_ELEMS, big_gpu_memory_if, chunked_errors, rel_err, strided  # noqa: E402

import tilegym_rms  # noqa: E402
import tilegym_rms.triton as triton_backend  # noqa: E402
from tilegym_rms import reference as ref  # noqa: E402
from tilegym_rms.triton import config, kernels  # noqa: E402

if type(kernels.rms_norm_fwd_kernel).__name__ == "InterpretedFunction":
    pytest.skip("the kernels were created under the interpreter in this process", allow_module_level=True)

pytestmark = pytest.mark.gpu

EPS = 1e-6
DEVICE = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
TOL_DW = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
MS = (1, 7, 128, 4097, 65536)
NS = (1, 64, 123, 512, 1000, 2001, 4096, 5120, 7168, 16384, 65536)
MAX_ELEMS = 1 << 28  # trims the biggest combinations (e.g. 65536 x 65536) to keep the run modest

SHAPES = [(M, N) for M in MS for N in NS if M * N <= MAX_ELEMS]
# The float64 reference runs in row chunks of about this many elements: its memory stays bounded.
REF_CHUNK_ELEMS = 1 << 24


def test_available():
    assert triton_backend.available(DEVICE) == (True, "")


SHAPE_PARAMS = [pytest.param(m, n, id=f"{m}x{n}", marks=big_gpu_memory_if(m * n >= BIG_GPU_ELEMS)) for m, n in SHAPES]


@pytest.mark.parametrize(("M", "N"), SHAPE_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_forward_backward(M, N, dtype):
    x = strided(M, N, dtype, seed=0, pad=8, device=DEVICE)
    dy = strided(M, N, dtype, seed=1, device=DEVICE)
    w = (torch.rand(N, device=DEVICE) + 0.5).to(dtype)
    y, rstd = triton_backend.forward(x, w, EPS, 0.0, "llama")
    assert y.dtype == dtype and y.is_contiguous()
    dx, dw = triton_backend.backward(x, dy, w, rstd, 0.0, "llama")
    assert dw.dtype == dtype
    err = chunked_errors(x, w, dy, {"y": y, "rstd": rstd, "dx": dx, "dw": dw}, eps=EPS, chunk_elems=REF_CHUNK_ELEMS)
    assert err["y"] <= TOL[dtype], err
    assert err["rstd"] <= 1e-5, err
    assert err["dx"] <= TOL[dtype], err
    assert err["dw"] <= TOL_DW[dtype], err


FEW = [(7, 123), (4097, 64), (128, 5120), (7, 65536), (65536, 512)]


@pytest.mark.parametrize(("M", "N"), FEW, ids=[f"{m}x{n}" for m, n in FEW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
@pytest.mark.parametrize("kind", ["w+1", "none"])
def test_casting_modes_offset_and_no_weight(M, N, dtype, casting_mode, kind):
    x = strided(M, N, dtype, seed=2, pad=8, device=DEVICE)
    w, offset = (None, 0.0) if kind == "none" else ((0.1 * torch.randn(N, device=DEVICE)).to(dtype), 1.0)
    w64 = None if w is None else w.double()
    y, rstd = triton_backend.forward(x, w, EPS, offset, casting_mode, store_rstd=casting_mode != "gemma")
    y_ref, _ = ref.rms_norm_forward(x.double(), w64, EPS, offset, casting_mode)
    assert rel_err(y, y_ref) <= TOL[dtype]
    assert (rstd is None) == (casting_mode == "gemma")
    if rstd is None:
        return
    dy = strided(M, N, dtype, seed=3, pad=8, device=DEVICE)
    dx, dw = triton_backend.backward(x, dy, w, rstd, offset, casting_mode)
    dx_ref, dw_ref = ref.rms_norm_backward(x.double(), dy.double(), w64, rstd.double(), offset)
    assert rel_err(dx, dx_ref) <= TOL[dtype]
    assert (dw is None) == (w is None)
    if dw is not None:
        assert rel_err(dw, dw_ref) <= TOL_DW[dtype]


@pytest.mark.parametrize(("M", "N"), FEW, ids=[f"{m}x{n}" for m, n in FEW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ref.FUSED_ADD_MODES)
def test_fused_add(M, N, dtype, mode):
    x, r = strided(M, N, dtype, seed=4, pad=8, device=DEVICE), strided(M, N, dtype, seed=5, pad=1, device=DEVICE)
    w = (torch.rand(N, device=DEVICE) + 0.5).to(dtype)
    y, res_out, rstd = triton_backend.fused_add_forward(x, r, w, EPS, 0.0, "llama", mode=mode)
    y_ref, res_ref, rstd_ref = ref.fused_add_rms_norm_forward(x.double(), r.double(), w.double(), EPS, mode)
    assert rel_err(y, y_ref) <= TOL[dtype]
    assert rel_err(res_out, res_ref) <= TOL[dtype]
    assert rel_err(rstd, rstd_ref) <= 1e-2
    if mode == "pre":
        assert torch.equal(res_out, x + r)


@pytest.mark.parametrize(("M", "N"), [(7, 123), (4097, 1000), (300, 8192)], ids=["7x123", "4097x1000", "300x8192"])
@pytest.mark.parametrize("mode", ref.FUSED_ADD_MODES)
def test_fused_add_gradients(M, N, mode):
    """Through the public API on this backend, fp32: gradients through y and residual_out against autograd
    through the float64 reference ("post": residual_out is the normalized sum, its gradient reaches the norm)."""
    x64, r64 = (
        strided(M, N, torch.float64, seed=10, pad=8, device=DEVICE),
        strided(M, N, torch.float64, seed=11, pad=1, device=DEVICE),
    )
    w64 = torch.randn(N, device=DEVICE, dtype=torch.float64)
    gy, gres = (
        strided(M, N, torch.float32, seed=12, pad=8, device=DEVICE),
        strided(M, N, torch.float32, seed=13, pad=8, device=DEVICE),
    )
    x, r, w = (t.float().requires_grad_() for t in (x64, r64, w64))
    y, res_out = tilegym_rms.fused_add_rms_norm(x, r, w, EPS, mode=mode, offset=0.5, backend="triton")
    ((y * gy).sum() + (res_out * gres).sum()).backward()
    x64, r64, w64 = (t.detach().clone().requires_grad_() for t in (x64, r64, w64))
    y_ref, res_ref, _ = ref.fused_add_rms_norm_forward(x64, r64, w64, EPS, mode, 0.5)
    ((y_ref * gy.double()).sum() + (res_ref * gres.double()).sum()).backward()
    assert rel_err(y, y_ref.detach()) <= 1e-5 and rel_err(res_out, res_ref.detach()) <= 1e-5
    for got, want in ((x.grad, x64.grad), (r.grad, r64.grad), (w.grad, w64.grad)):
        assert rel_err(got, want) <= 1e-4


@pytest.mark.parametrize(("M", "N"), [(4097, 5120), (4097, 64), (300, 1000)])
def test_backward_deterministic(M, N):
    """Two runs give bitwise-identical dx and dw (no atomics; fixed reduction order)."""
    x, dy = (
        strided(M, N, torch.float32, seed=6, pad=8, device=DEVICE),
        strided(M, N, torch.float32, seed=7, pad=8, device=DEVICE),
    )
    w = torch.randn(N, device=DEVICE)
    rstd = triton_backend.forward(x, w, EPS, 0.0, "llama")[1]
    first = triton_backend.backward(x, dy, w, rstd, 0.0, "llama")
    for _ in range(3):
        again = triton_backend.backward(x, dy, w, rstd, 0.0, "llama")
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_forced_partitioned_path(monkeypatch):
    """A small Unified Buffer budget forces column chunks even for small rows on the GPU too."""
    monkeypatch.setenv(config.UB_BYTES_ENV, "2048")
    M, N = 513, 1000
    assert config.choose_path(M, N, torch.float32, "backward") == "partitioned"
    x, dy = (
        strided(M, N, torch.float32, seed=8, pad=8, device=DEVICE),
        strided(M, N, torch.float32, seed=9, pad=8, device=DEVICE),
    )
    w = torch.randn(N, device=DEVICE)
    y, rstd = triton_backend.forward(x, w, EPS, 0.0, "llama")
    assert rel_err(y, ref.rms_norm_forward(x.double(), w.double(), EPS)[0]) <= TOL[torch.float32]
    dx, dw = triton_backend.backward(x, dy, w, rstd, 0.0, "llama")
    dx_ref, dw_ref = ref.rms_norm_backward(x.double(), dy.double(), w.double(), rstd.double(), 0.0)
    assert rel_err(dx, dx_ref) <= TOL[torch.float32]
    assert rel_err(dw, dw_ref) <= TOL_DW[torch.float32]


def test_empty_rows():
    x = torch.empty(0, 64, device=DEVICE)
    y, rstd = tilegym_rms.rms_norm_forward(x, None, EPS, backend="triton")
    assert y.shape == (0, 64) and rstd.shape == (0,)
