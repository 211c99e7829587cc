"""The cuTile FP8 kernel on a CUDA GPU (marker ``gpu``; skipped without CUDA): ``rms_norm_fp8`` and
``fused_add_rms_norm_fp8`` against the checks of ``test_fp8.py`` (scales against the restatement of the
cuTile norm's own rounded output, each element within one fp8 step of the float64 norm), saturation, zero and
NaN rows, groups at the row's end, the fused add's sum bit for bit, CUDA graph capture and the batch-invariant
mode."""

import pytest
import torch
from test_batch_invariance import RowOp, assert_rows_invariant, row_probes, weight_of
from test_fp8 import E4M3, E5M2, EPS, MODES, _assert_same_bits, _quant_kwargs

import tilegym_rms
from tilegym_rms import reference
from tilegym_rms.cutile import config as cutile_config
from tilegym_rms.cutile.host import fp8 as fp8_host
from tilegym_rms.cutile.host.common import target
from tilegym_rms.testing import fp8_step_errors

pytestmark = pytest.mark.gpu

# Rows narrower than a group, a partial last group (1000: whole int64 words; 1001: not), the common
# widths, the widest fused row.
N_GRID = (32, 1000, 1001, 4096, 5120, 16384)
# Decode sizes (a row per tile) and prefill sizes (several rows per tile, a partial last tile).
M_GRID = (1, 7, 256, 2053)


@pytest.fixture(autouse=True)
def _quiet_experimental(monkeypatch):
    monkeypatch.setenv("TILEGYM_RMS_SILENCE_EXPERIMENTAL", "1")


def _config(m, n, group_size, device):
    """The FP8 kernel's configuration on ``device`` as the host builds it: its SM count and its table's settings."""
    tgt = target(device.index)
    return cutile_config.fp8_config(m, n, group_size, tgt.sms, params=tgt.params())


def _launches():
    return fp8_host.cached_launch.cache_info().misses + fp8_host.cached_launch.cache_info().hits


def _check(x, w, y_q, scales, kw, out_dtype=E4M3, casting_mode=reference.DEFAULT_CASTING_MODE):
    """Scales: the reference's (checked against the restatement in test_fp8.py) of the cuTile norm's rounded
    output (the same helpers compute it, but in tiles of another shape, so an amax may differ by a rounding of
    y: a step of x's dtype); values within one fp8 step of the float64 norm."""
    with torch.no_grad():
        y = tilegym_rms.rms_norm(x, w, EPS, casting_mode=casting_mode)
    _, want_s = reference.quantize_fp8(y, out_dtype=out_dtype, **kw)
    assert y_q.dtype == out_dtype and y_q.shape == x.shape and scales.shape == want_s.shape
    # fp32 x: no coarser rounding of y hides the kernels' other order of the sum of squares and rsqrt's
    # last bits, a few fp32 ulps of an amax (3.4e-7 measured on an H100).
    rtol = max(2 * torch.finfo(x.dtype).eps, 8 * torch.finfo(torch.float32).eps)
    torch.testing.assert_close(scales, want_s, rtol=rtol, atol=0)
    y64 = reference.rms_norm_forward(x.double(), None if w is None else w.double(), EPS)[0]
    assert fp8_step_errors(y_q, scales, y64, kw.get("group_size")) <= 1.0


@pytest.mark.parametrize("m", M_GRID)
@pytest.mark.parametrize("n", N_GRID)
@pytest.mark.parametrize("mode", ["token", "group128", "static"])
def test_kernel_against_float64(mode, n, m):
    torch.manual_seed(m + n)
    x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    kw = _quant_kwargs(mode, x)
    before = _launches()
    with torch.no_grad():
        y_q, scales = tilegym_rms.rms_norm_fp8(x, w, EPS, **kw)
    assert _launches() == before + 1  # the fused kernel, not the norm and torch's quantization
    _check(x, w, y_q, scales, kw)


@pytest.mark.parametrize("n", [5120, 5121], ids=["whole-words", "part-words"])
@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_mode_dtype_and_fp8_dtype(dtype, mode, out_dtype, n):
    """Each fp8 format stored either way: as int64 words (the per-group modes on rows of whole words) and value by
    value."""
    torch.manual_seed(3)
    x = torch.randn(300, n, dtype=dtype, device="cuda") * 2
    w = torch.randn(n, dtype=dtype, device="cuda")
    kw = _quant_kwargs(mode, x)
    with torch.no_grad():
        y_q, scales = tilegym_rms.rms_norm_fp8(x, w, EPS, out_dtype=out_dtype, **kw)
    _check(x, w, y_q, scales, kw, out_dtype)


@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
def test_casting_modes_and_no_weight(casting_mode):
    x = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")
    for w in (torch.randn(4096, dtype=torch.bfloat16, device="cuda"), None):
        with torch.no_grad():
            y_q, scales = tilegym_rms.rms_norm_fp8(x, w, EPS, casting_mode=casting_mode)
            y = tilegym_rms.rms_norm(x, w, EPS, casting_mode=casting_mode)
        torch.testing.assert_close(scales, y.float().abs().amax(-1, keepdim=True) / 448.0, rtol=2**-7, atol=0)
        assert fp8_step_errors(y_q, scales, y.double()) <= 1.0


@pytest.mark.parametrize("group_size", [None, 64])
def test_zero_and_nan_rows_and_saturation(group_size):
    x = torch.randn(8, 1000, dtype=torch.bfloat16, device="cuda")
    x[3] = 0
    clean_q, clean_s = tilegym_rms.rms_norm_fp8(x, None, group_size=group_size)
    x[5, 17] = float("nan")
    y_q, scales = tilegym_rms.rms_norm_fp8(x, None, group_size=group_size)
    floor = 1 / 512 if group_size is None else 1e-10
    assert torch.equal(scales[3], torch.full_like(scales[3], torch.tensor(floor).float().item() / 448.0))
    assert torch.equal(y_q[3].float(), torch.zeros_like(y_q[3].float()))
    assert torch.isnan(scales[5]).all() and torch.isnan(y_q[5].float()).all()
    others = [r for r in range(8) if r != 5]
    assert torch.equal(y_q[others].view(torch.uint8), clean_q[others].view(torch.uint8))
    assert torch.equal(scales[others], clean_s[others])
    sat, _ = tilegym_rms.rms_norm_fp8(x[others], None, scale=torch.tensor([1e-12], device="cuda"))
    nonzero = x[others] != 0
    assert torch.equal(sat.float().abs()[nonzero], torch.full_like(sat.float()[nonzero], 448.0))


@pytest.mark.parametrize(
    "m, n, mode, tail_n",
    [(300, 5120, "token", 1024), (300, 5120, "group128", 1024), (300, 3072, "static", 1024),
     (300, 5121, "token-ub", 2048), (300, 4160, "group64", 64), (300, 4160, "group128", 0),
     (4000, 10240, "group128", 2048), (4000, 12288, "token", 4096)],
)  # fmt: skip
def test_rows_held_as_a_tile_and_a_tail(m, n, mode, tail_n):
    """Tiles of one row that the kernel holds as a tile and a narrower tail (config.split_row; none where a group
    would straddle them), at decode sizes (a block a row) and in the walk: each row's largest value, in its tail,
    sets its row's or group's scale, and every value is within one fp8 step of float64."""
    torch.manual_seed(n)
    x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    x[:, n - 3] = 40.0
    w = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    kw = _quant_kwargs(mode, x)
    cfg = _config(m, n, kw.get("group_size"), x.device)
    assert cfg.tile_m == 1 and cfg.tail_n == tail_n
    with torch.no_grad():
        y_q, scales = tilegym_rms.rms_norm_fp8(x, w, EPS, **kw)
    _check(x, w, y_q, scales, kw)


def test_the_last_group_is_scaled_by_its_own_columns():
    x = torch.ones(4, 200, device="cuda")
    x[:, 150] = 50.0
    y_q, scales = tilegym_rms.rms_norm_fp8(x, None, group_size=128)
    y = tilegym_rms.rms_norm(x, None)
    torch.testing.assert_close(scales[:, 1], y[:, 128:].abs().amax(-1) / 448.0, rtol=2**-23, atol=0)
    torch.testing.assert_close(scales[:, 0], y[:, :128].abs().amax(-1) / 448.0, rtol=2**-23, atol=0)
    assert torch.equal(y_q[:, 150].float(), torch.full((4,), 448.0, device="cuda"))


@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["token", "group128", "static"])
@pytest.mark.parametrize("m", [5, 2053])
@pytest.mark.parametrize("n", [4096, 5120])  # 5120: a row per block as a tile and a tail
def test_fused_add(n, m, mode, residual_dtype):
    torch.manual_seed(m)
    x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn(m, n, dtype=residual_dtype, device="cuda")
    w = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    kw = _quant_kwargs(mode, x)
    want_sum = reference.fused_add_sum(x, residual)
    with torch.no_grad():
        y_q, scales = tilegym_rms.fused_add_rms_norm_fp8(x, residual, w, EPS, **kw)
        unfused_q, unfused_s = tilegym_rms.rms_norm_fp8(want_sum, w, EPS, **kw)
    assert torch.equal(residual, want_sum)
    # The norm of the sum, rounded to x's dtype: as rms_norm_fp8 of the sum, whose y is rounded to the sum's. Bit
    # for bit where a block holds one row; in a tile of several rows the fused and plain builds may sum a row's
    # squares in another order (seen on an H100 at 2053 rows), so there the scales agree to a rounding of y.
    if residual_dtype == x.dtype:
        one_row = _config(m, n, kw.get("group_size"), x.device).tile_m == 1
        if one_row:
            _assert_same_bits(y_q, unfused_q)
            assert torch.equal(scales, unfused_s)
        else:
            torch.testing.assert_close(scales, unfused_s, rtol=2 * torch.finfo(x.dtype).eps, atol=0)
    y64 = reference.rms_norm_forward(want_sum.double(), w.double(), EPS)[0]
    assert fp8_step_errors(y_q, scales, y64, kw.get("group_size")) <= 1.0


@pytest.mark.parametrize("mode", ["token", "group128", "static"])
def test_cuda_graph_capture_replays_new_inputs(mode):
    x = torch.randn(16, 4096, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x)
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    kw = _quant_kwargs(mode, x)
    with torch.no_grad():
        tilegym_rms.rms_norm_fp8(x, w, **kw)  # compiles the kernels outside the capture
        tilegym_rms.fused_add_rms_norm_fp8(x, residual.clone(), w, **kw)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_q, scales = tilegym_rms.rms_norm_fp8(x, w, **kw)
            f_q, f_scales = tilegym_rms.fused_add_rms_norm_fp8(x, residual, w, **kw)
        x.copy_(torch.randn_like(x))
        start = torch.randn_like(residual)
        residual.copy_(start)
        graph.replay()
        want_q, want_s = tilegym_rms.rms_norm_fp8(x, w, **kw)
        check = start.clone()
        want_fq, want_fs = tilegym_rms.fused_add_rms_norm_fp8(x, check, w, **kw)
    _assert_same_bits(y_q, want_q)
    _assert_same_bits(f_q, want_fq)
    assert torch.equal(scales, want_s) and torch.equal(f_scales, want_fs) and torch.equal(residual, check)


def test_compile_fullgraph_matches_eager():
    x, w = torch.randn(32, 2048, dtype=torch.bfloat16, device="cuda"), torch.randn(2048, device="cuda")
    with torch.no_grad():
        want = tilegym_rms.rms_norm_fp8(x, w, group_size=128)
        got = torch.compile(lambda x: tilegym_rms.rms_norm_fp8(x, w, group_size=128), fullgraph=True)(x)
    _assert_same_bits(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_rows_wider_than_the_kernel_take_the_unfused_path():
    n = fp8_host.FP8_MAX_N + 1000
    x = torch.randn(4, n, dtype=torch.bfloat16, device="cuda")
    before = _launches()
    with torch.no_grad():
        y_q, scales = tilegym_rms.rms_norm_fp8(x, None, group_size=128)
    assert _launches() == before
    _check(x, None, y_q, scales, {"group_size": 128})


@pytest.mark.parametrize("n", [1000, 4096, 5120])
@pytest.mark.parametrize("mode", ["token", "group128"])
def test_batch_invariant_mode(mode, n):
    """In the mode, each probe row's y_q and scales are those of the row alone, at decode and prefill Ms (where
    the default launch would tile several rows)."""
    w = weight_of(n, torch.bfloat16, "cuda")
    kw = {"group_size": MODES[mode][1]}

    def run(b):
        y_q, scales = tilegym_rms.rms_norm_fp8(b["x"], w, **kw)
        r = b["residual"].clone()
        f_q, f_scales = tilegym_rms.fused_add_rms_norm_fp8(b["x"], r, w, **kw)
        return {"y_q": y_q, "scales": scales, "fused y_q": f_q, "fused scales": f_scales, "sum": r}, {}

    with torch.no_grad(), tilegym_rms.batch_invariant():
        assert_rows_invariant(RowOp(("x", "residual"), run), row_probes(n, torch.bfloat16, "cuda"), [1, 5, 600, 4100])
