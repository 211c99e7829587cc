"""Checks against float64, shared by the tests, the benchmarks and ``tilegym-rms``.

Errors are relative norms computed in float64. Non-finite outputs give a NaN or infinite error, which
fails every ``error <= tolerance`` comparison, so nothing here needs to raise.
"""

from __future__ import annotations

import torch

from . import reference

__all__ = ["chunked_errors", "fp8_dequantize", "fp8_step_errors", "fused_add_errors", "rel_err", "strided"]


def rel_err(out: torch.Tensor, ref: torch.Tensor, scale: float | None = None) -> float:
    """``||out - ref|| / ||ref||`` (or ``/ scale``) in float64; 0 when both are empty.

    The shapes must match: a broadcast comparison would hide a wrong output shape."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} against the reference's {tuple(ref.shape)}"
    if ref.numel() == 0:
        return 0.0
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    denom = ref.norm().item() if scale is None else scale
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def strided(m: int, n: int, dtype=torch.float32, *, pad: int = 3, seed: int = 0, device="cpu") -> torch.Tensor:
    """A random ``(m, n)`` view with row stride ``n + pad``: the kernels take any row stride."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(m, n + pad, generator=g, device=device).to(dtype)[:, :n]


def chunked_errors(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    dy: torch.Tensor | None,
    outputs: dict,
    *,
    eps: float,
    offset: float = 0.0,
    casting_mode: str = reference.DEFAULT_CASTING_MODE,
    chunk_elems: int = 1 << 24,
) -> dict[str, float]:
    """Relative errors of the ``outputs`` present (``y``, ``rstd``, ``dx``, ``dw``) against
    :mod:`tilegym_rms.reference` in float64, computed in row chunks so that the reference's memory
    stays bounded whatever the shape.

    ``dx`` is measured against the larger of ``||dx_ref||`` and ``||rstd * w~ * dy||``: at N = 1 the
    exact ``dx`` cancels to about 0 and a plain relative error would measure only rounding."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    dy2 = dy.reshape(-1, n) if dy is not None else None
    outs = {k: (v.reshape(-1, n) if k in ("y", "dx") else v.reshape(-1)) for k, v in outputs.items() if k != "dw"}
    w64 = weight.detach().double() if weight is not None else None
    w_eff = reference.effective_weight(w64, offset, torch.float64)
    sq = {k: [0.0, 0.0] for k in outs}
    dx_scale = 0.0
    dw_ref = torch.zeros(n, dtype=torch.float64, device=x.device)
    step = max(1, chunk_elems // max(n, 1))
    for start in range(0, x2.shape[0], step):
        rows = slice(start, start + step)
        xc = x2[rows].detach().double()
        y_ref, rstd_ref = reference.rms_norm_forward(xc, w64, eps, offset, casting_mode)
        refs = {"y": y_ref, "rstd": rstd_ref}
        if dy2 is not None and ("dx" in outs or "dw" in outputs):
            dyc = dy2[rows].double()
            dx_ref, dw_part = reference.rms_norm_backward(xc, dyc, w64, rstd_ref, offset)
            refs["dx"] = dx_ref
            g = dyc if w_eff is None else dyc * w_eff
            dx_scale += (rstd_ref[:, None] * g).square().sum().item()
            if dw_part is not None:
                dw_ref += dw_part
        for k, out in outs.items():
            got = out[rows].detach().double()
            sq[k][0] += (got - refs[k]).square().sum().item()
            sq[k][1] += refs[k].square().sum().item()
    errs = {}
    for k, (err, ref) in sq.items():
        denom = max(ref, dx_scale) if k == "dx" else ref
        errs[k] = (err / denom) ** 0.5 if denom > 0 else err**0.5
    if "dw" in outputs and outputs["dw"] is not None:
        errs["dw"] = rel_err(outputs["dw"].detach().reshape(-1), dw_ref)
    return errs


def fused_add_errors(
    x: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor | None,
    eps: float,
    outputs: dict,
    dy: torch.Tensor | None = None,
    dres: torch.Tensor | None = None,
    *,
    mode: str = "pre",
    offset: float = 0.0,
    casting_mode: str = reference.DEFAULT_CASTING_MODE,
    chunk_elems: int = 1 << 24,
) -> dict[str, float]:
    """Relative errors of the fused add + RMSNorm outputs present in ``outputs`` (``y``, ``res`` for
    residual_out, ``rstd``; ``dx``, ``dr``, ``dw``) against :func:`tilegym_rms.reference.fused_add_rms_norm_forward`
    in float64 and its float64 autograd gradients for ``(dy, dres)`` (``dres`` None: residual_out unused), in
    row chunks so that the reference's memory stays bounded."""
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n), r.reshape(-1, n)
    rows_outs = {k: v.reshape(-1, n) for k, v in outputs.items() if k in ("y", "res", "dx", "dr")}
    if "rstd" in outputs:
        rows_outs["rstd"] = outputs["rstd"].reshape(-1, 1)
    need_grad = any(k in outputs for k in ("dx", "dr", "dw"))
    w64 = w.detach().double().requires_grad_(need_grad) if w is not None else None
    sq = {k: [0.0, 0.0] for k in rows_outs}
    dw_ref = torch.zeros(n, dtype=torch.float64, device=x.device)
    step = max(1, chunk_elems // max(n, 1))
    for start in range(0, x2.shape[0], step):
        rows = slice(start, start + step)
        with torch.enable_grad():
            xc = x2[rows].detach().double().requires_grad_(need_grad)
            rc = r2[rows].detach().double().requires_grad_(need_grad)
            y_ref, res_ref, rstd_ref = reference.fused_add_rms_norm_forward(
                xc, rc, w64, eps, mode, offset, casting_mode
            )
            refs = {"y": y_ref.detach(), "res": res_ref.detach(), "rstd": rstd_ref.detach().reshape(-1, 1)}
            if need_grad:
                outs, grads = [y_ref], [dy.reshape(-1, n)[rows].double()]
                if dres is not None:
                    outs.append(res_ref)
                    grads.append(dres.reshape(-1, n)[rows].double())
                inputs = (xc, rc) + ((w64,) if w64 is not None else ())
                got_grads = torch.autograd.grad(outs, inputs, grads)
                refs["dx"], refs["dr"] = got_grads[:2]
                if w64 is not None:
                    dw_ref += got_grads[2]
        for k, out in rows_outs.items():
            got = out[rows].detach().double()
            sq[k][0] += (got - refs[k]).square().sum().item()
            sq[k][1] += refs[k].square().sum().item()
    errs = {k: ((e / d) ** 0.5 if d > 0 else e**0.5) for k, (e, d) in sq.items()}
    if outputs.get("dw") is not None:
        errs["dw"] = rel_err(outputs["dw"].detach().reshape(-1), dw_ref)
    return errs


# (smallest normal exponent, mantissa bits) of each fp8 dtype: the spacing of its values at a magnitude.
_FP8_LAYOUT = {torch.float8_e4m3fn: (-6, 3), torch.float8_e5m2: (-14, 2)}


def _element_scales(scales: torch.Tensor, n: int, group_size) -> torch.Tensor:
    """``scales`` (one element, ``(..., 1)`` or per group of ``group_size`` columns) in float64, broadcastable
    to rows of ``n`` elements."""
    s = scales.double()
    if s.numel() == 1:
        return s.reshape(())
    return s if group_size is None else s.repeat_interleave(group_size, -1)[..., :n]


def fp8_dequantize(y_q: torch.Tensor, scales: torch.Tensor, group_size=None) -> torch.Tensor:
    """``y_q * scales`` in float64 (exact: an fp8 value times an fp32 scale fits float64's mantissa), ``scales``
    as :func:`fp8_step_errors` takes them: what an FP8 GEMM reads back of a quantized output."""
    return y_q.double() * _element_scales(scales, y_q.shape[-1], group_size)


def fp8_step_errors(y_q: torch.Tensor, scales: torch.Tensor, y64: torch.Tensor, group_size=None) -> float:
    """The largest distance of ``y_q`` from ``saturate(y64 / scale)`` (``y64``: the norm in float64; ``scales``:
    the call's, one element, ``(..., 1)`` or per group of ``group_size`` columns), in steps of ``y_q``'s fp8 dtype
    at the larger of the two magnitudes: a correct quantization of a ``y`` within rounding of ``y64`` is at most
    about half a step off. A NaN where the other has none counts as infinitely far; NaN against NaN as 0."""
    emin, mbits = _FP8_LAYOUT[y_q.dtype]
    fp8_max = torch.finfo(y_q.dtype).max
    want = (y64.double() / _element_scales(scales, y64.shape[-1], group_size)).clamp(-fp8_max, fp8_max)
    got = y_q.double()
    magnitude = torch.maximum(got.abs(), want.abs()).clamp(min=2.0**emin)
    err = (got - want).abs() / torch.exp2(torch.floor(torch.log2(magnitude)) - mbits)
    err = torch.where(torch.isnan(got) & torch.isnan(want), 0.0, err)
    err = torch.where(torch.isnan(got) != torch.isnan(want), float("inf"), err)
    return err.max().item() if err.numel() else 0.0
