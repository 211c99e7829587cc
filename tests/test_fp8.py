"""``rms_norm_fp8`` and ``fused_add_rms_norm_fp8`` on the CPU (the torch backend): the reference against an
independent restatement of the stated rules, the values against float64, saturation, zero and NaN rows,
groups at the row's end, the fused add's residual, torch.compile and the errors."""

import math

import pytest
import torch
from test_batch_invariance import RowOp, assert_rows_invariant, row_probes, weight_of

import tilegym_rms
from tilegym_rms import dispatch, reference
from tilegym_rms.testing import fp8_step_errors

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-6
# (static, group_size, scale_ub, use_ue8m0): every quantization mode and its switches.
MODES = {
    "static": (True, None, None, False),
    "token": (False, None, None, False),
    "token-ub": (False, None, 0.05, False),
    "token-ue8m0": (False, None, None, True),
    "group64": (False, 64, None, False),
    "group128": (False, 128, None, False),
    "group128-ue8m0": (False, 128, None, True),
}


def _quant_kwargs(mode, y_like):
    static, group_size, ub, ue8m0 = MODES[mode]
    kw = {"group_size": group_size, "use_ue8m0": ue8m0}
    if static:
        kw["scale"] = torch.tensor([0.02], device=y_like.device)
    if ub is not None:
        kw["scale_ub"] = torch.tensor([ub], device=y_like.device)
    return kw


def restated(y, scale=None, group_size=None, scale_ub=None, out_dtype=E4M3, use_ue8m0=False):
    """The quantization restated from the rules, row by row and group by group in Python floats (float64):
    amax per row (per group: of its own columns, the last one possibly narrower), ``min`` with scale_ub, the
    floor (1/512 per row, 1e-10 per group), divided by fp8_max and rounded once to fp32 (exact: a correctly
    rounded float64 quotient of fp32 values rounds to the correctly rounded fp32 one); UE8M0: the next power of
    two. Values: ``y / scale`` saturated to +-fp8_max, rounded to nearest even in the fp8 dtype."""
    fp8_max = torch.finfo(out_dtype).max
    rows = y.double().reshape(-1, y.shape[-1])
    n = rows.shape[1]
    width = n if group_size is None else group_size
    floor = 1 / 512 if group_size is None else 1e-10
    fp32 = lambda v: torch.tensor(v, dtype=torch.float64).float().item()  # noqa: E731
    scales = []
    for row in rows.tolist():
        row_scales = []
        for start in range(0, max(n, 1), width):
            group = row[start : start + width]
            amax = math.nan if any(map(math.isnan, group)) else max(map(abs, group), default=0.0)
            if scale_ub is not None:
                amax = amax if math.isnan(amax) else min(amax, scale_ub)
            s = fp32(max(amax, fp32(floor)) / fp8_max) if not math.isnan(amax) else math.nan
            if use_ue8m0 and not math.isnan(s):
                mantissa, exp = math.frexp(s)
                s = s if mantissa == 0.5 else math.ldexp(1.0, exp)
            row_scales.append(s)
        scales.append(row_scales)
    s = torch.tensor(scales, dtype=torch.float64)
    if scale is not None:
        s = torch.full_like(s, scale)
    per_element = s.repeat_interleave(width, 1)[:, :n]
    q = (rows / per_element).clamp(-fp8_max, fp8_max).to(out_dtype)
    shape = (1,) if scale is not None else (*y.shape[:-1], s.shape[1])
    return q.view(y.shape), s.float()[: 1 if scale is not None else None].reshape(shape)


def _assert_same_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype.itemsize == 1:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert (
        torch.equal(got, want)
        or (torch.isnan(got) == torch.isnan(want)).all()
        and torch.equal(got.nan_to_num(), want.nan_to_num())
    )


@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_matches_the_restatement(dtype, mode, out_dtype):
    """Scales bit for bit; values within one fp8 step (the restatement divides in float64, the reference in
    fp32: a quotient near a rounding boundary may round to the neighbouring value), and saturated values
    exactly +-fp8_max."""
    torch.manual_seed(0)
    x = torch.randn(6, 1000, dtype=dtype) * 3
    x[1, 5] = 400.0  # one outlier: its row's scale, and (static) a saturated value
    w = torch.rand(1000) + 0.5
    kw = _quant_kwargs(mode, x)
    y_q, scales, _ = reference.rms_norm_fp8_reference(x, w, EPS, out_dtype=out_dtype, **kw)
    y = reference.rms_norm_forward(x, w, EPS)[0].to(dtype)
    args = {**kw, "scale": kw["scale"].item() if "scale" in kw else None}
    args["scale_ub"] = kw["scale_ub"].item() if "scale_ub" in kw else None
    want_q, want_s = restated(y, out_dtype=out_dtype, **args)
    assert torch.equal(scales, want_s)
    assert fp8_step_errors(y_q, scales, y.double(), kw["group_size"]) <= 0.5 + 1e-5  # a rounding, of y / scale
    assert fp8_step_errors(y_q, torch.ones(1), want_q.double()) <= 1.0
    per_element = (
        want_s.double() if want_s.numel() == 1 else want_s.double().repeat_interleave(kw["group_size"] or 1000, -1)
    )
    saturated = (y.double() / per_element[..., :1000]).abs()
    fp8_max = torch.finfo(out_dtype).max
    beyond = saturated > fp8_max
    assert torch.equal(y_q.float().abs()[beyond], torch.full_like(y_q.float()[beyond], fp8_max))
    if mode == "static" and out_dtype == E4M3:
        assert beyond.any()  # the outlier saturates (e5m2 reaches 57344)


@pytest.mark.parametrize("n", [1, 100, 1000, 4096])
@pytest.mark.parametrize("mode", list(MODES))
def test_values_against_float64(mode, n):
    """Through the public API: exact scales of the norm's rounded output (as the plain rms_norm stores it), and
    each element within one fp8 step of the float64 norm scaled by them."""
    torch.manual_seed(n)
    x, w = torch.randn(3, 5, n, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    kw = _quant_kwargs(mode, x)
    with torch.no_grad():
        y_q, scales = tilegym_rms.rms_norm_fp8(x, w, EPS, **kw)
        y = tilegym_rms.rms_norm(x, w, EPS)
    args = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    _, want_s = restated(y, **args)
    assert y_q.shape == x.shape and y_q.dtype == E4M3
    assert torch.equal(scales, want_s)
    if "scale" in kw:
        assert scales is kw["scale"]
    y64 = reference.rms_norm_forward(x.double(), w.double(), EPS)[0]
    assert fp8_step_errors(y_q, scales, y64, kw["group_size"]) <= 1.0


def test_all_zero_rows_get_the_floor_scale_and_zeros():
    x = torch.zeros(2, 300, dtype=torch.bfloat16)
    for group_size, floor in ((None, 1 / 512), (64, 1e-10), (128, 1e-10)):
        y_q, scales = tilegym_rms.rms_norm_fp8(x, None, group_size=group_size)
        assert torch.equal(y_q.float(), torch.zeros(2, 300))
        want = torch.tensor(floor, dtype=torch.float32) / torch.finfo(E4M3).max
        assert torch.equal(scales, torch.full_like(scales, want.item())), group_size


@pytest.mark.parametrize("group_size", [None, 64])
def test_a_nan_row_stays_in_its_row(group_size):
    torch.manual_seed(1)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    clean_q, clean_s = tilegym_rms.rms_norm_fp8(x, None, group_size=group_size)
    x[2, 7] = float("nan")
    y_q, scales = tilegym_rms.rms_norm_fp8(x, None, group_size=group_size)
    assert torch.isnan(scales[2]).all() and torch.isnan(y_q[2].float()).all()
    others = [0, 1, 3]
    assert torch.equal(y_q[others].view(torch.uint8), clean_q[others].view(torch.uint8))
    assert torch.equal(scales[others], clean_s[others])


@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_static_scale_saturates_to_the_finite_range(out_dtype):
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    y_q, scales = tilegym_rms.rms_norm_fp8(x, None, scale=torch.tensor([1e-12]), out_dtype=out_dtype)
    fp8_max = torch.finfo(out_dtype).max
    assert torch.isfinite(y_q.float()).all()
    assert torch.equal(y_q.float().abs(), torch.full((3, 512), fp8_max))
    assert torch.equal(torch.sign(y_q.float()), torch.sign(x.float()))


def test_the_last_group_is_scaled_by_its_own_columns():
    """N = 200 with groups of 128: the second group holds 72 columns, its scale their amax alone."""
    x = torch.ones(2, 200, dtype=torch.float32)
    x[:, 150] = 50.0  # in the last group only
    y_q, scales = tilegym_rms.rms_norm_fp8(x, None, group_size=128)
    y = tilegym_rms.rms_norm(x, None)
    fp8_max = torch.finfo(E4M3).max
    assert scales.shape == (2, 2)
    assert torch.equal(scales[:, 0], (y[:, :128].abs().amax(-1) / fp8_max))
    assert torch.equal(scales[:, 1], (y[:, 128:].abs().amax(-1) / fp8_max))
    assert torch.equal(y_q[:, 150].float(), torch.full((2,), fp8_max))


@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["token", "group128", "static"])
def test_fused_add_writes_the_sum_and_quantizes_its_norm(mode, residual_dtype):
    torch.manual_seed(2)
    x = torch.randn(4, 3, 384, dtype=torch.bfloat16)
    residual = torch.randn(4, 3, 384, dtype=residual_dtype)
    w = torch.randn(384, dtype=torch.bfloat16)
    kw = _quant_kwargs(mode, x)
    want_sum = reference.fused_add_sum(x, residual)
    want_q, want_s, _ = reference.rms_norm_fp8_reference(x, w, EPS, residual=residual.clone(), **kw)
    with torch.no_grad():
        y_q, scales = tilegym_rms.fused_add_rms_norm_fp8(x, residual, w, EPS, **kw)
    assert torch.equal(residual, want_sum)
    _assert_same_bits(y_q, want_q)
    assert torch.equal(scales, want_s)


def test_fused_add_updates_a_residual_whose_rows_are_not_dense():
    x = torch.randn(4, 64)
    base = torch.randn(64, 4)
    residual = base.t()  # a transposed view: the rows are copied to be read, then written back
    want = residual + x
    tilegym_rms.fused_add_rms_norm_fp8(x, residual, None)
    assert torch.equal(base.t(), want)


@pytest.mark.parametrize("mode", ["token", "group64", "static"])
def test_compile_fullgraph_matches_eager(mode):
    x, w = torch.randn(2, 7, 256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16)
    kw = _quant_kwargs(mode, x)

    def block(x, residual):
        y_q, scales = tilegym_rms.fused_add_rms_norm_fp8(x, residual, w, **kw)
        z_q, z_scales = tilegym_rms.rms_norm_fp8(residual, w, **kw)
        return y_q, scales, z_q, z_scales

    residual = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    eager_res, compiled_res = residual.clone(), residual.clone()
    with torch.no_grad():
        want = block(x, eager_res)
        got = torch.compile(block, fullgraph=True, backend="aot_eager")(x, compiled_res)
    assert torch.equal(compiled_res, eager_res)
    for g, e in zip(got, want, strict=True):
        _assert_same_bits(g, e)


def test_rows_are_batch_invariant_on_the_torch_backend():
    w = weight_of(512, torch.bfloat16)

    def run(b):
        y_q, scales = tilegym_rms.rms_norm_fp8(b["x"], w, group_size=128)
        t_q, t_scales = tilegym_rms.rms_norm_fp8(b["x"], w)
        return {"y_q (group)": y_q, "scales (group)": scales, "y_q": t_q, "scales": t_scales}, {}

    with tilegym_rms.batch_invariant():
        assert_rows_invariant(RowOp(("x",), run), row_probes(512, torch.bfloat16), [1, 3, 64, 300])


def test_empty_inputs():
    y_q, scales = tilegym_rms.rms_norm_fp8(torch.empty(0, 64), None, group_size=64)
    assert y_q.shape == (0, 64) and y_q.dtype == E4M3 and scales.shape == (0, 1)
    y_q, scales = tilegym_rms.rms_norm_fp8(torch.empty(3, 0), None)
    assert y_q.shape == (3, 0) and scales.shape == (3, 1)
    assert torch.equal(scales, torch.full((3, 1), (1 / 512) / torch.finfo(E4M3).max))


def test_only_cutile_fuses_the_quantization():
    fused = {name for name in tilegym_rms.BACKENDS if isinstance(dispatch.backend_module(name), dispatch.FP8Backend)}
    assert fused == {"cutile"}


def test_inference_only():
    x, w = torch.randn(2, 64), torch.nn.Parameter(torch.randn(64))
    with pytest.raises(RuntimeError, match="rms_norm_fp8 is inference-only .* weight requires grad: .*no_grad"):
        tilegym_rms.rms_norm_fp8(x, w)
    with pytest.raises(RuntimeError, match="fused_add_rms_norm_fp8 is inference-only .* x requires grad"):
        tilegym_rms.fused_add_rms_norm_fp8(x.requires_grad_(), torch.randn(2, 64), None)
    with torch.no_grad():
        tilegym_rms.rms_norm_fp8(x, w)  # fine without grad mode


@pytest.mark.parametrize(
    "kw, error, message",
    [
        ({"out_dtype": torch.bfloat16}, TypeError, "out_dtype must be one of float8_e4m3fn, float8_e5m2, got"),
        ({"group_size": 32}, ValueError, r"group_size must be None \(one scale per row\) or one of \(64, 128\)"),
        ({"scale": 0.5}, ValueError, "scale must be a one-element float32 tensor on the device of x"),
        ({"scale": torch.tensor([0.5, 1.0])}, ValueError, "scale must be a one-element float32 tensor .* 2 elements"),
        ({"scale_ub": torch.tensor([1.0], dtype=torch.float64)}, ValueError, "scale_ub must be a one-element float32"),
        ({"scale": torch.tensor([1.0]), "group_size": 64}, ValueError, "group_size applies to dynamic scales"),
        ({"scale": torch.tensor([1.0]), "use_ue8m0": True}, ValueError, "use_ue8m0 applies to dynamic scales"),
        ({"scale_ub": torch.tensor([1.0]), "group_size": 64}, ValueError, "scale_ub bounds per-row scales"),
        ({"use_ue8m0": 1}, TypeError, "use_ue8m0 must be True or False"),
        ({"casting_mode": "fp8"}, ValueError, "casting_mode must be one of"),
    ],
)
def test_errors(kw, error, message):
    with pytest.raises(error, match=message):
        tilegym_rms.rms_norm_fp8(torch.randn(2, 128), None, **kw)


def test_fused_add_residual_must_match_x():
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        tilegym_rms.fused_add_rms_norm_fp8(torch.randn(2, 128), torch.randn(2, 64), None)


def test_a_device_without_fp8_types_quantizes_after_the_norm(monkeypatch):
    """The one-pass kernel runs only where the backend says it can (cuTile: compute capability 8.9 and up);
    elsewhere the backend's norm runs, then the reference's quantization, with the same results."""
    from tilegym_rms import _torch_backend, cutile

    assert [cutile.fp8_cc_supported(cc) for cc in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))] == [
        False, False, True, True, True, True,
    ]  # fmt: skip
    x, w = torch.randn(4, 256), torch.randn(256)
    stub = (torch.zeros(4, 256, dtype=E4M3), torch.ones(4, 1))  # what a one-pass kernel would have returned
    calls = []
    monkeypatch.setattr(_torch_backend, "FP8_MAX_N", 1 << 14, raising=False)
    monkeypatch.setattr(_torch_backend, "fp8_forward", lambda *a, **k: calls.append(a) or stub, raising=False)
    want = reference.rms_norm_fp8_reference(x, w, 1e-6)[:2]
    monkeypatch.setattr(_torch_backend, "fp8_runs_on", lambda device: False, raising=False)
    y_q, scales = tilegym_rms.rms_norm_fp8(x, w, 1e-6, backend="torch")
    assert not calls and torch.equal(scales, want[1]) and torch.equal(y_q.view(torch.uint8), want[0].view(torch.uint8))
    monkeypatch.setattr(_torch_backend, "fp8_runs_on", lambda device: True, raising=False)
    y_q, scales = tilegym_rms.rms_norm_fp8(x, w, 1e-6, backend="torch")
    assert len(calls) == 1 and torch.equal(scales, stub[1])
