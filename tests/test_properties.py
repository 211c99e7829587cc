"""Property-based tests (hypothesis): one generator of cases drives every backend.

A *case* is a shape (0-3 leading dims of size 0..5, N from 0 to 70000), dtypes, a memory layout
(contiguous, strided rows from a column slice, a permuted view, stride-0 broadcast rows), weight /
offset / casting mode / eps, a value scale (1e-3 .. 1000, so that fp16 overflow would show) and a
seed; the tensors are built from it in the test body. Each example is checked against

* float64 math written out here (``x * rsqrt(mean(x^2) + eps) * (offset + w)`` and its autograd
  gradients), within a bound derived from the number of roundings of the casting mode;
* the same-dtype rounding semantics of each casting mode (:func:`spec_forward`, emulated here in
  fp32 steps; for kernels also :func:`tilegym_rms.reference.rms_norm_forward` on the CPU), within
  a few ulps of the dtype.

Runs:

* ``backend="torch"`` on the CPU (plain ``pytest``);
* ``backend="triton"`` under the Triton interpreter on the CPU (N <= 512, M <= 64). As in
  test_triton_interpreter.py, ``TRITON_INTERPRET=1`` is set here on a host without CUDA before the kernels
  are imported; where the interpreter is still not on in this process (a CUDA host, or triton
  imported before this module), these tests re-run themselves in a fresh pytest process with
  ``TRITON_INTERPRET=1``. bf16 is compared with float64 only there: the interpreter rounds
  fp32 -> bf16 by truncation;
* ``backend="cutile"`` / ``"triton"`` on CUDA (marker ``gpu``), N from a fixed list of widths so
  that the number of compiled kernel variants stays bounded.

Examples are derandomized (the same cases on every run, no example database).
``TILEGYM_RMS_FUZZ_SCALE`` multiplies every example count (e.g. 10 for a long GPU fuzz run).
"""

import dataclasses
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    # Before anything imports the Triton kernels (see test_triton_interpreter.py): the interpreter is
    # chosen when a kernel is decorated. On a CUDA host it stays off so the GPU tests compile.
    os.environ["TRITON_INTERPRET"] = "1"

from hypothesis import HealthCheck, assume, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import tilegym_rms  # noqa: E402
from tilegym_rms import dispatch, reference  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALES = (1e-3, 1.0, 100.0, 1000.0)
LAYOUTS = ("contiguous", "slice", "permuted", "broadcast")
# GPU widths: each distinct N may compile new kernel variants, so N comes from this list there.
GPU_WIDTHS = (1, 3, 17, 64, 100, 128, 1000, 2048, 3000, 4096, 5120, 7168, 12288, 20000, 65537)
GPU_BIG_ROWS = (64, 777, 4097, 16384)

FUZZ_SCALE = float(os.environ.get("TILEGYM_RMS_FUZZ_SCALE", "1"))


def fuzz_settings(max_examples: int):
    return settings(
        max_examples=max(1, round(max_examples * FUZZ_SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ------------------------------------------------------------------------------------------------
# The shared generator
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    lead: tuple  # leading dims (0-3 of them; a 0 makes the input empty)
    n: int  # the normalized last dim (0 = empty rows)
    dtype: torch.dtype
    weight: str  # "none", "same" (x's dtype) or "fp32"
    offset: float
    casting_mode: str
    eps: float
    scale: float  # x = randn * scale
    layout: str  # x's memory layout, see make_tensor
    pad: int  # "slice": extra columns of the wider tensor
    start: int  # "slice": first column taken
    perm: tuple  # "permuted": the memory order of the dims
    dy_layout: str
    zero_rows: bool  # the first row of x is zero ("broadcast": all of x)
    residual: str  # fused add: "same" dtype as x or "fp32"
    residual_layout: str
    fused_mode: str
    seed: int

    @property
    def shape(self):
        return (*self.lead, self.n)

    @property
    def rows(self):
        return math.prod(self.lead)


def _fp32(v: float) -> float:
    """``v`` rounded to the nearest float32 (kernels take eps and offset as fp32 scalars)."""
    return struct.unpack("f", struct.pack("f", v))[0]


# Width buckets for the size-weighted N: (share in %, smallest, largest). The empty width is placed
# mid-table so that hypothesis' bias towards the ends of a range does not make it common.
_WIDTH_BUCKETS = ((40, 1, 64), (3, 0, 0), (15, 1, 64), (27, 65, 2048), (10, 2049, 16384), (5, 16385, 70000))


def _size_weighted_width(draw, max_n: int, zero_n: bool) -> int:
    """Mostly small N, some medium, a few large (up to ``max_n``); N = 0 ~3% of the time when ``zero_n``."""
    pick = draw(st.integers(0, 99))
    for bucket in _WIDTH_BUCKETS:
        if pick < bucket[0]:
            break
        pick -= bucket[0]
    _, lo, hi = bucket if bucket[2] > 0 or zero_n else (0, 1, 64)
    return draw(st.integers(min(lo, max_n), min(hi, max_n)))


def _rarely(draw, percent: int) -> bool:
    """True about ``percent``% of the time (a value away from the ends of the drawn range)."""
    return 50 <= draw(st.integers(0, 99)) < 50 + percent


def cases(
    *,
    max_n: int = 70000,
    widths=None,
    max_numel: int = 1 << 20,
    max_rows: int | None = None,
    big_rows: bool = False,
    zero_n: bool = True,
    dtypes=DTYPES,
):
    """Strategy of :class:`Case`. ``widths``: draw N from this list (GPU) instead of a size-weighted
    range up to ``max_n``; ``max_numel`` caps M * N; ``max_rows`` caps M; ``big_rows`` lets the first
    leading dim be large (GPU)."""

    @st.composite
    def build(draw):
        if widths is not None:
            n = 0 if zero_n and _rarely(draw, 3) else draw(st.sampled_from(widths))
        else:
            n = _size_weighted_width(draw, max_n, zero_n)
        lead, rows = [], 1
        for i in range((draw(st.integers(0, 3)) + 1) % 4):  # 0 leading dims (1-D x) last, not first
            cap = 5 if rows == 0 else min(5, max_numel // (max(n, 1) * rows))
            if max_rows is not None and rows > 0:
                cap = min(cap, max_rows // rows)
            size = 0 if _rarely(draw, 5) else draw(st.integers(min(1, cap), cap))
            if big_rows and i == 0:
                big = [b for b in GPU_BIG_ROWS if b * max(n, 1) <= max_numel]
                if big and draw(st.booleans()):
                    size = draw(st.sampled_from(big))
            lead.append(size)
            rows *= size
        ndim = len(lead) + 1
        dtype = draw(st.sampled_from(dtypes))
        weight = draw(st.sampled_from(("none", "same", "fp32")))
        offset = 0.0
        if weight != "none":
            offset = draw(st.sampled_from((0.0, 1.0)) | st.floats(-1.0, 1.0, width=32))
        eps = draw(st.just(1e-6) | st.floats(-12.0, -2.0).map(lambda e: _fp32(10.0**e)))
        layout = draw(st.sampled_from(LAYOUTS))
        pad = draw(st.integers(1, 8))
        return Case(
            lead=tuple(lead),
            n=n,
            dtype=dtype,
            weight=weight,
            offset=float(offset),
            casting_mode=draw(st.sampled_from(reference.CASTING_MODES)),
            eps=eps,
            scale=draw(st.sampled_from(SCALES)),
            layout=layout,
            pad=pad,
            start=draw(st.integers(0, pad)),
            perm=tuple(draw(st.permutations(range(ndim)))),
            dy_layout=draw(st.sampled_from(LAYOUTS)),
            # A zero row has rstd = eps^-1/2: keep that (and its gradients) inside fp16's range.
            zero_rows=eps >= 1e-6 and _rarely(draw, 10),
            residual=draw(st.sampled_from(("same", "fp32"))) if dtype != torch.float32 else "same",
            residual_layout=draw(st.sampled_from(("contiguous", "slice", "permuted"))),
            fused_mode=draw(st.sampled_from(reference.FUSED_ADD_MODES)),
            seed=draw(st.integers(0, 2**31 - 1)),
        )

    return build()


def edge_case(**changes) -> Case:
    """A hand-picked case (run on every test run, before the generated ones)."""
    fields = dict(
        lead=(2, 3), n=100, dtype=torch.float32, weight="fp32", offset=0.0, casting_mode="llama", eps=1e-6,
        scale=1.0, layout="contiguous", pad=3, start=1, perm=None, dy_layout="contiguous", zero_rows=False,
        residual="same", residual_layout="contiguous", fused_mode="pre", seed=0,
    )  # fmt: skip
    fields.update(changes)
    if fields["perm"] is None:
        fields["perm"] = tuple(reversed(range(len(fields["lead"]) + 1)))
    return Case(**fields)


# The behaviours every backend must get right, pinned so that no draw of the generator can miss them.
EDGE_CASES = (
    edge_case(n=0, dtype=torch.float16, layout="slice"),  # rows of no elements: dw is zeros (0,)
    edge_case(lead=(0, 4), dtype=torch.bfloat16, weight="same", offset=1.0),  # no rows: dw is zeros (N,)
    # mode "none" in fp16 with an RMS far above 256: the mean square overflows fp16.
    edge_case(lead=(4,), dtype=torch.float16, casting_mode="none", scale=1000.0, offset=1.0, layout="slice"),
    edge_case(lead=(3,), dtype=torch.float16, casting_mode="none", scale=1e-3, weight="same"),  # tiny mean square
    # An fp32 residual stream with 16-bit activations.
    edge_case(dtype=torch.bfloat16, residual="fp32", casting_mode="gemma", layout="permuted"),
    edge_case(lead=(5,), dtype=torch.float16, residual="fp32", fused_mode="post", weight="same", offset=1.0),
    # N = 1 read through a transposed view: shape (3, 1), strides (1, 3); torch calls it contiguous.
    edge_case(lead=(3,), n=1, layout="permuted", dy_layout="permuted", residual_layout="permuted"),
)


def with_edge_cases(test):
    for case in reversed(EDGE_CASES):
        test = example(case=case)(test)
    return test


def make_tensor(case: Case, shape, dtype, layout, gen, device, scale=1.0):
    """``randn * scale`` in ``dtype`` with logical ``shape`` and the memory ``layout``:
    "contiguous"; "slice" (columns ``start:start+N`` of a tensor ``pad`` columns wider: strided rows,
    a storage offset); "permuted" (stored in the dim order ``case.perm``); "broadcast" (one row
    expanded over the leading dims: row stride 0)."""
    n = shape[-1]

    def values(s):
        return (torch.randn(s, generator=gen, device=device) * scale).to(dtype)

    if layout == "slice":
        return values((*shape[:-1], n + case.pad))[..., case.start : case.start + n]
    if layout == "permuted":
        perm = case.perm if len(case.perm) == len(shape) else tuple(reversed(range(len(shape))))
        base = values(tuple(shape[p] for p in perm))
        return base.permute(tuple(perm.index(i) for i in range(len(shape))))
    if layout == "broadcast":
        return values((n,)).expand(shape)
    return values(shape)


@dataclasses.dataclass
class Tensors:
    x: torch.Tensor
    w: torch.Tensor | None
    dy: torch.Tensor
    residual: torch.Tensor


def make_tensors(case: Case, device="cpu") -> Tensors:
    gen = torch.Generator(device=device).manual_seed(case.seed)
    x = make_tensor(case, case.shape, case.dtype, case.layout, gen, device, case.scale)
    if case.zero_rows:
        if case.layout == "broadcast":
            x = torch.zeros(case.n, dtype=case.dtype, device=device).expand(case.shape)
        elif case.rows > 0:
            x[(0,) * len(case.lead)].zero_()
    w = None
    if case.weight != "none":
        w_dtype = case.dtype if case.weight == "same" else torch.float32
        w = make_tensor(case, (case.n,), w_dtype, "contiguous", gen, device)
    dy = make_tensor(case, case.shape, case.dtype, case.dy_layout, gen, device)
    r_dtype = case.dtype if case.residual == "same" else torch.float32
    residual = make_tensor(case, case.shape, r_dtype, case.residual_layout, gen, device, case.scale)
    return Tensors(x, w, dy, residual)


# ------------------------------------------------------------------------------------------------
# Oracles and tolerances
# ------------------------------------------------------------------------------------------------


def fp64_forward(x, w, eps, offset):
    """``(y, rstd)`` in float64 (autograd-able). A row of no elements has mean square 0."""
    x64 = x.double()
    rstd = torch.rsqrt(x64.square().sum(-1, keepdim=True) / max(x.shape[-1], 1) + eps)
    y = x64 * rstd
    if w is not None:
        y = y * (offset + w.double())
    return y, rstd.squeeze(-1)


def fp64_grads(x, w, eps, offset, dy):
    """``(dx, dw)`` of :func:`fp64_forward` by float64 autograd (``dw`` None without weight)."""
    x64 = x.detach().double().requires_grad_()
    w64 = None if w is None else w.detach().double().requires_grad_()
    y, _ = fp64_forward(x64, w64, eps, offset)
    grads = torch.autograd.grad(y, [x64] if w64 is None else [x64, w64], dy.double())
    return grads[0], (grads[1] if w64 is not None else None)


def spec_forward(x, w, eps, offset, casting_mode, rstd=None):
    """The rounding steps of each casting mode, written out in fp32 (independent of reference.py).

    llama: rstd fp32; ``x*rstd`` rounded to x's dtype, times ``offset + w`` (fp32), rounded.
    gemma, and torch (whose weights here are never wider than fp32): all fp32, one rounding. none: mean
    square and rstd in fp32, rstd rounded to x's dtype; ``x*rstd`` rounded; times ``(offset + w)`` rounded
    to x's dtype; rounded.
    ``rstd``: use these values (e.g. a kernel's) instead of computing them.
    """
    dt = x.dtype
    xf = x.float()
    if rstd is None:
        rstd = torch.rsqrt(xf.square().sum(-1, keepdim=True) / max(x.shape[-1], 1) + eps)
    else:
        rstd = rstd.float().unsqueeze(-1)
    weff = None if w is None else w.float() + offset
    if casting_mode == "none":
        rstd = rstd.to(dt).float()
        y = (xf * rstd).to(dt)
        if weff is not None:
            y = (y.float() * weff.to(dt).float()).to(dt)
    elif casting_mode == "llama":
        y = (xf * rstd).to(dt)
        if weff is not None:
            y = (y.float() * weff).to(dt)
    else:
        y = (xf * rstd if weff is None else xf * rstd * weff).to(dt)
    return y, rstd.squeeze(-1)


def unit(dtype, truncating=False) -> float:
    """The largest relative error of one rounding to ``dtype`` (round-to-nearest, or truncation)."""
    eps = torch.finfo(dtype).eps
    return eps if truncating else eps / 2


def n_roundings(casting_mode, has_w) -> int:
    """Roundings to the input dtype on the way from exact inputs to y (see spec_forward)."""
    return {"llama": 2 if has_w else 1, "gemma": 1, "torch": 1, "none": 4 if has_w else 2}[casting_mode]


def fwd_rtol(dtype, casting_mode, has_w, truncating=False) -> float:
    if dtype == torch.float32:
        return 1e-5
    return n_roundings(casting_mode, has_w) * unit(dtype, truncating) + 1e-5


def dx_rtol(dtype, casting_mode, truncating=False) -> float:
    """dx is fp32 math rounded once; mode "none" hands the backward an rstd rounded to x's dtype,
    which moves rstd*(g - x^ mean(x^ g)) by up to 4 of its roundings."""
    if dtype == torch.float32:
        return 1e-5
    return (5 if casting_mode == "none" else 1) * unit(dtype, truncating) + 1e-5


def dw_rtol(x_dtype, w_dtype, casting_mode, truncating=False) -> float:
    rstd_rounding = unit(x_dtype, truncating) if casting_mode == "none" and x_dtype != torch.float32 else 0.0
    w_rounding = unit(w_dtype, truncating) if w_dtype != torch.float32 else 0.0
    return w_rounding + rstd_rounding + 1e-4  # fp32 accumulation over the rows


def dw_scale(dw64, x, dy, rstd64) -> float:
    """What dw's error is measured against: the size of the terms of its row sums, not only of the
    sums (terms of opposite sign cancel, e.g. N = 1 where x^ = +-1 and dw is nearly 0)."""
    terms = (dy.double() * x.double() * rstd64.unsqueeze(-1)).abs().reshape(-1, x.shape[-1]).sum(0)
    return max(dw64.norm().item(), terms.norm().item())


def subnormal_step(dtype) -> float:
    fi = torch.finfo(dtype)
    return fi.tiny * fi.eps


def assert_close_norm(out, ref, rtol, what, *, scale=None, atol=0.0):
    """``||out - ref|| <= rtol * scale + atol * sqrt(numel)`` in float64, ``scale`` = ``||ref||`` by
    default; ``out`` must be finite."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if out.numel() == 0:
        return
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out64).all(), f"{what}: {int((~torch.isfinite(out64)).sum())} non-finite values"
    denom = ref64.norm().item() if scale is None else scale
    err = (out64 - ref64).norm().item()
    bound = rtol * denom + atol * math.sqrt(out.numel())
    assert err <= bound, f"{what}: ||err|| = {err:.3e} > {bound:.3e} (relative {err / max(denom, 1e-300):.3e})"


def assert_ulps(out, ref, dtype, ulps, what, rel_slack=4e-6):
    """Elementwise: ``|out - ref| <= (ulps * eps(dtype) + rel_slack) * |ref|`` (plus ``ulps``
    subnormal steps). ``rel_slack`` covers fp32 differences before the roundings (summation order,
    rsqrt approximations); each rounding downstream of them may then flip by one ulp."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if out.numel() == 0:
        return
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(ref64).all(), f"{what}: the reference itself is not finite"
    assert torch.isfinite(out64).all(), f"{what}: {int((~torch.isfinite(out64)).sum())} non-finite values"
    tol = (ulps * torch.finfo(dtype).eps + rel_slack) * ref64.abs() + ulps * subnormal_step(dtype)
    diff = (out64 - ref64).abs()
    bad = diff > tol
    if bad.any():
        i = int(torch.argmax((diff - tol).reshape(-1)))
        got, want = out64.reshape(-1)[i].item(), ref64.reshape(-1)[i].item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {out.numel()} elements beyond {ulps} ulps of {dtype}; "
            f"worst: got {got!r}, expected {want!r}"
        )


def assert_mostly_identical(out, ref, what, fraction=0.01, allowance=2):
    """At most ``fraction`` of the elements (plus ``allowance``) differ from ``ref`` at all: room for
    rare one-ulp flips where fp32 intermediates differ in their last bits, none for a systematic
    difference in rounding."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    differ = int((out.cpu() != ref.cpu()).sum())
    assert differ <= fraction * out.numel() + allowance, f"{what}: {differ} of {out.numel()} elements differ"


def assume_representable(dtype, *tensors):
    """Skip inputs whose exact results do not fit ``dtype`` (e.g. fp16 dx of a near-zero row)."""
    limit = torch.finfo(dtype).max / 8
    for t in tensors:
        if t is not None and t.numel():
            assume(bool((t.abs() < limit).all()))


# ------------------------------------------------------------------------------------------------
# The properties (shared by every backend and device)
# ------------------------------------------------------------------------------------------------


def _is_kernel(backend):
    return backend != "torch"


def check_forward(case: Case, backend: str, device="cpu", truncating_bf16=False):
    t = make_tensors(case, device)
    x, w = t.x, t.w
    kw = dict(offset=case.offset, casting_mode=case.casting_mode, backend=backend)
    truncating = truncating_bf16 and case.dtype == torch.bfloat16
    y64, rstd64 = fp64_forward(x, w, case.eps, case.offset)
    if case.casting_mode == "none":
        assume_representable(case.dtype, rstd64)  # rstd rounded to x's dtype must stay finite
    assume_representable(case.dtype, y64)

    y, rstd = tilegym_rms.rms_norm_forward(x, w, case.eps, **kw)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert rstd.shape == x.shape[:-1] and rstd.dtype == torch.float32

    # The autograd-free path (no rstd stored) gives bitwise the same y.
    y_plain = tilegym_rms.rms_norm(x, w, case.eps, **kw)
    assert torch.equal(y_plain, y), "rms_norm and rms_norm_forward disagree"

    has_w = w is not None
    assert_close_norm(
        y, y64, fwd_rtol(case.dtype, case.casting_mode, has_w, truncating), "y vs float64",
        atol=n_roundings(case.casting_mode, has_w) * subnormal_step(case.dtype),
    )  # fmt: skip
    # (a row of no elements has rstd = eps^-1/2: its mean square is taken as 0)
    if case.casting_mode == "none" and case.dtype != torch.float32:
        assert torch.equal(rstd.to(case.dtype).float(), rstd), "mode none rounds rstd to x's dtype"
        assert_ulps(rstd, rstd64, case.dtype, 2 if truncating else 1, "rstd (none) vs float64", rel_slack=1e-6)
    else:
        assert_close_norm(rstd, rstd64, 1e-5, "rstd vs float64")
        assert_ulps(rstd, rstd64, torch.float32, 0, "rstd vs float64 (elementwise)", rel_slack=1e-5)
    if truncating:
        return  # bitwise-level comparisons need round-to-nearest
    ulps = n_roundings(case.casting_mode, has_w) + 1
    y_spec, _ = spec_forward(x, w, case.eps, case.offset, case.casting_mode)
    assert_ulps(y, y_spec, case.dtype, ulps, "y vs the casting-mode spec")
    if case.dtype != torch.float32:
        # Given the backend's own rstd, the later roundings are exact operations: nearly every element
        # must match bit for bit (a rounding step in the wrong place changes many; llama and gemma
        # differ by one ulp here and there, which the ulp bounds above cannot tell apart).
        y_given, _ = spec_forward(x, w, case.eps, case.offset, case.casting_mode, rstd=rstd)
        assert_mostly_identical(y, y_given, "y vs the casting-mode spec given the backend's rstd")
    if _is_kernel(backend):
        w_cpu = None if w is None else w.cpu()
        y_ref, _ = reference.rms_norm_forward(x.cpu(), w_cpu, case.eps, case.offset, case.casting_mode)
        assert_ulps(y.cpu(), y_ref, case.dtype, ulps, "y vs reference.rms_norm_forward")


def check_backward(case: Case, backend: str, device="cpu", truncating_bf16=False):
    t = make_tensors(case, device)
    truncating = truncating_bf16 and case.dtype == torch.bfloat16
    # detach() keeps the strides: the kernels see the strided / permuted / broadcast layout.
    x = t.x.detach().requires_grad_()
    w = None if t.w is None else t.w.detach().requires_grad_()
    dx64, dw64 = fp64_grads(x, w, case.eps, case.offset, t.dy)
    _, rstd64 = fp64_forward(x.detach(), None, case.eps, 0.0)
    if case.casting_mode == "none":
        assume_representable(case.dtype, rstd64)
    assume_representable(case.dtype, dx64)
    if w is not None:
        assume_representable(w.dtype, dw64)

    kw = dict(offset=case.offset, casting_mode=case.casting_mode, backend=backend)
    y = tilegym_rms.rms_norm(x, w, case.eps, **kw)
    grads = torch.autograd.grad(y, [x] if w is None else [x, w], t.dy)
    dx, dw = grads[0], (grads[1] if w is not None else None)
    assert dx.shape == x.shape and dx.dtype == x.dtype

    if case.n > 0:
        g64 = t.dy.double() if w is None else t.dy.double() * (case.offset + t.w.double())
        # dx cancels to ~0 when N == 1: measure it against the size of its terms, rstd * g.
        scale = max(dx64.norm().item(), (rstd64.unsqueeze(-1) * g64).norm().item())
        assert_close_norm(dx, dx64, dx_rtol(case.dtype, case.casting_mode, truncating), "dx vs float64", scale=scale)
    if w is not None:
        assert dw.shape == w.shape and dw.dtype == w.dtype
        if case.rows == 0 or case.n == 0:
            assert torch.equal(dw, torch.zeros_like(w)), "dw of an empty input is zeros"
        else:
            tol = dw_rtol(case.dtype, w.dtype, case.casting_mode, truncating)
            scale = dw_scale(dw64, t.x, t.dy, rstd64)
            assert_close_norm(dw, dw64, tol, "dw vs float64", scale=scale, atol=subnormal_step(w.dtype))

    # The standalone backward on the forward's rstd gives bitwise the same gradients.
    with torch.no_grad():
        _, rstd = tilegym_rms.rms_norm_forward(x, w, case.eps, **kw)
    dx2, dw2 = tilegym_rms.rms_norm_backward(x.detach(), t.dy, None if w is None else w.detach(), rstd, **kw)
    assert torch.equal(dx2, dx), "rms_norm_backward and autograd disagree on dx"
    assert (dw2 is None) if w is None else torch.equal(dw2, dw), "rms_norm_backward and autograd disagree on dw"


def check_fused_add(case: Case, backend: str, device="cpu", truncating_bf16=False):
    t = make_tensors(case, device)
    truncating = truncating_bf16 and case.dtype == torch.bfloat16
    mode = case.fused_mode
    x = t.x.detach().requires_grad_()
    r = t.residual.detach().requires_grad_()
    w = None if t.w is None else t.w.detach().requires_grad_()
    # The sum: computed in the promoted dtype, stored in residual's dtype.
    promoted = torch.promote_types(x.dtype, r.dtype)
    s = (t.x.to(promoted) + t.residual.to(promoted)).to(r.dtype)

    # float64 oracle: y = norm(s) of the stored sum; the rounding of the sum passes gradients through.
    x64 = t.x.double().requires_grad_()
    r64 = t.residual.double().requires_grad_()
    w64 = None if w is None else t.w.double().requires_grad_()
    s64 = x64 + r64 + (s.double() - t.x.double() - t.residual.double())
    y64, rstd64 = fp64_forward(s64, w64, case.eps, case.offset)
    if case.casting_mode == "none":
        assume_representable(case.dtype, rstd64)
    assume_representable(case.dtype, y64)

    kw = dict(mode=mode, offset=case.offset, casting_mode=case.casting_mode, backend=backend)
    y, res_out = tilegym_rms.fused_add_rms_norm(x, r, w, case.eps, **kw)
    assert y.shape == x.shape and y.dtype == x.dtype, f"y: {y.dtype} {tuple(y.shape)}"
    assert res_out.shape == x.shape
    if mode == "pre":
        assert res_out.dtype == r.dtype, f"residual_out is {res_out.dtype}, residual is {r.dtype}"
        if truncating:
            assert_ulps(res_out, s, res_out.dtype, 1, "residual_out vs x + residual", rel_slack=0.0)
        else:
            assert torch.equal(res_out.detach(), s), "residual_out is the sum, rounded once to residual's dtype"
    else:
        assert torch.equal(res_out.detach(), y.detach()), "post mode: residual_out is y"

    has_w = w is not None
    # +1 rounding: a kernel may normalize the fp32 sum before it is rounded for storage.
    rtol = fwd_rtol(case.dtype, case.casting_mode, has_w, truncating) + unit(case.dtype, truncating)
    atol = (n_roundings(case.casting_mode, has_w) + 1) * subnormal_step(case.dtype)
    assert_close_norm(y, y64.detach(), rtol, "fused y vs float64 norm of the sum", atol=atol)
    if r.dtype == x.dtype and not truncating:
        y_spec, _ = spec_forward(s, t.w, case.eps, case.offset, case.casting_mode)
        assert_ulps(y, y_spec, case.dtype, n_roundings(case.casting_mode, has_w) + 2, "fused y vs the spec of the sum")

    # Gradients: both outputs carry one (post mode: residual_out is y, its gradient adds to dy).
    gen = torch.Generator(device=device).manual_seed(case.seed + 1)
    dres = torch.randn(res_out.shape, generator=gen, device=device).to(res_out.dtype)
    inputs = [x, r] if w is None else [x, r, w]
    grads = torch.autograd.grad([y, res_out], inputs, [t.dy, dres])
    inputs64 = [x64, r64] if w64 is None else [x64, r64, w64]
    outs64 = [y64, s64] if mode == "pre" else [y64, y64]
    grads64 = torch.autograd.grad(outs64, inputs64, [t.dy.double(), dres.double()])
    dy_total = t.dy.double() + (dres.double() if mode == "post" else 0.0)  # what reaches the norm
    if case.n > 0:
        g64 = dy_total if w is None else dy_total * (case.offset + t.w.double())
        dres_norm = dres.double().norm().item() if mode == "pre" else 0.0
        scale = max(grads64[0].norm().item(), (rstd64.unsqueeze(-1) * g64).norm().item()) + dres_norm
        assume_representable(case.dtype, grads64[0])
        tol = dx_rtol(case.dtype, case.casting_mode, truncating) + unit(case.dtype, truncating)
        assert_close_norm(grads[0], grads64[0], tol, "fused dx vs float64", scale=scale)
        assert_close_norm(grads[1], grads64[1], tol, "fused dresidual vs float64", scale=scale)
    if w is not None:
        dw, dw64 = grads[2], grads64[2]
        assert dw.shape == w.shape and dw.dtype == w.dtype
        if case.rows == 0 or case.n == 0:
            assert torch.equal(dw, torch.zeros_like(w)), "dw of an empty input is zeros"
        else:
            tol = dw_rtol(case.dtype, w.dtype, case.casting_mode, truncating) + unit(case.dtype, truncating)
            scale = dw_scale(dw64, s, dy_total, rstd64.detach())
            assert_close_norm(dw, dw64, tol, "fused dw vs float64", scale=scale, atol=subnormal_step(w.dtype))


# ------------------------------------------------------------------------------------------------
# CPU: the torch backend
# ------------------------------------------------------------------------------------------------

CPU_CASES = cases()


@fuzz_settings(600)
@given(case=CPU_CASES)
@with_edge_cases
def test_forward_torch(case):
    check_forward(case, "torch")


@fuzz_settings(400)
@given(case=CPU_CASES)
@with_edge_cases
def test_backward_torch(case):
    check_backward(case, "torch")


@fuzz_settings(300)
@given(case=CPU_CASES)
@with_edge_cases
def test_fused_add_torch(case):
    check_fused_add(case, "torch")


# ------------------------------------------------------------------------------------------------
# CPU: the Triton kernels under the interpreter
# ------------------------------------------------------------------------------------------------

INTERPRETER_CASES = cases(max_n=512, max_rows=64)
_CHILD_ENV = "TILEGYM_RMS_PROPERTIES_CHILD"  # set in the fresh process below: no second re-run


def _interpreter_unusable_reason():
    """None when the Triton kernels run under the interpreter in this process, else why they do not."""
    from tilegym_rms.triton import config

    if not config.interpreter_enabled():
        return "TRITON_INTERPRET=1 is not set in this process (a CUDA host compiles Triton instead)"
    import triton.language as tl

    if type(tl.cdiv).__name__ != "InterpretedFunction":
        return "triton was imported (e.g. by torch._dynamo) before TRITON_INTERPRET=1 was set"
    from tilegym_rms.triton import kernels

    if type(kernels.rms_norm_fwd_kernel).__name__ != "InterpretedFunction":
        return "the Triton kernels were created before TRITON_INTERPRET=1 was set"
    return None


def run_under_interpreter(request, fuzz) -> None:
    """Runs ``fuzz`` (a hypothesis test) here if the interpreter is on in this process; otherwise runs
    this pytest test in a fresh process with TRITON_INTERPRET=1 (Triton picks interpret-or-compile
    once per process, so a CUDA host or an early triton import cannot switch here)."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy", reason="the Triton interpreter needs numpy")
    reason = _interpreter_unusable_reason()
    if reason is None:
        fuzz()
        return
    if os.environ.get(_CHILD_ENV):
        pytest.fail(f"the Triton interpreter is unusable in a fresh process too: {reason}")
    test = f"{Path(__file__).resolve()}::{request.node.name}"
    env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_ENV: "1"}
    cmd = [sys.executable, "-m", "pytest", test, "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    assert proc.returncode == 0, f"{test} under TRITON_INTERPRET=1 ({reason} here):\n{proc.stdout[-8000:]}"
    assert " passed" in proc.stdout, f"{test} did not run in the fresh process:\n{proc.stdout[-2000:]}"


@fuzz_settings(250)
@given(case=INTERPRETER_CASES)
@with_edge_cases
def fuzz_forward_backward_interpreter(case):
    check_forward(case, "triton", truncating_bf16=True)
    check_backward(case, "triton", truncating_bf16=True)


@fuzz_settings(150)
@given(case=INTERPRETER_CASES)
@with_edge_cases
def fuzz_fused_add_interpreter(case):
    check_fused_add(case, "triton", truncating_bf16=True)


def test_forward_backward_triton_interpreter(request):
    run_under_interpreter(request, fuzz_forward_backward_interpreter)


def test_fused_add_triton_interpreter(request):
    run_under_interpreter(request, fuzz_fused_add_interpreter)


# ------------------------------------------------------------------------------------------------
# GPU fuzz: cutile and triton on CUDA (skipped without a GPU by conftest.py)
# ------------------------------------------------------------------------------------------------

GPU_CASES = cases(widths=GPU_WIDTHS, max_numel=1 << 24, big_rows=True)
GPU_BACKENDS = ("cutile", "triton")


@pytest.fixture
def gpu_backend(request):
    name = request.param
    if name == "triton":
        pytest.importorskip("triton")
        from tilegym_rms.triton import config

        if config.interpreter_enabled():
            pytest.skip("TRITON_INTERPRET is set: the GPU fuzz needs compiled Triton")
    ok, why = dispatch.backend_module(name).available(torch.device("cuda"))
    if not ok:
        pytest.skip(f"backend {name!r} cannot run: {why}")
    return name


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_backend", GPU_BACKENDS, indirect=True)
@fuzz_settings(100)
@given(case=GPU_CASES)
@with_edge_cases
def test_forward_backward_gpu(gpu_backend, case):
    check_forward(case, gpu_backend, device="cuda")
    check_backward(case, gpu_backend, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_backend", GPU_BACKENDS, indirect=True)
@fuzz_settings(50)
@given(case=GPU_CASES)
@with_edge_cases
def test_fused_add_gpu(gpu_backend, case):
    check_fused_add(case, gpu_backend, device="cuda")
