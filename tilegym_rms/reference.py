"""Pure-torch RMSNorm: the semantics every kernel is tested against, and the CPU backend.

All functions normalize over the last dimension and accept any leading dims.

``casting_mode`` says where the 16-bit roundings fall. ``"torch"`` (the default) is what
``torch.nn.RMSNorm`` / ``F.rms_norm`` compute; the others follow the community convention (HF Llama /
Gemma, Liger):

* ``"torch"``: ``"gemma"``'s one rounding at the end, with the weight product in the promoted dtype
  of fp32 and the weight's (an fp64 weight multiplies in fp64, as torch's ``x * rstd * weight`` does).
  The kernels compute it as ``"gemma"`` (fp32 throughout).
* ``"llama"``: ``rstd`` in fp32; ``x * rstd`` is rounded to the input dtype, then multiplied by
  ``offset + weight`` (computed in fp32) and rounded again.
* ``"gemma"``: everything in fp32, ``(offset + weight)`` in fp32, one rounding at the end.
* ``"none"``: the input dtype wherever the data cannot overflow it: the mean square is accumulated in
  fp32 (in fp16 it would overflow once a row's RMS passes 256), ``rstd`` is rounded to the input dtype
  (in fp16 it is inf once ``mean(x^2) + eps`` falls below 2.3e-10: a row near zero with ``eps`` below that,
  as in models that round rstd to fp16), and ``x * rstd`` and the weight product are each
  rounded to the input dtype.

``rstd`` is returned in fp32 (fp64 for fp64 input, so that ``gradcheck`` is exact). The backward
is the exact derivative of the fp32 math for every mode: rounding steps pass gradients through.

Empty inputs give empty outputs. A last dim of 0 normalizes nothing: ``y`` and ``dx`` are empty,
``dw`` is zeros of shape ``(0,)``, and ``rstd`` is ``1 / sqrt(eps)`` (the mean square of no
elements is taken as 0).

Fused add: ``residual`` may have another floating dtype than ``x`` (an fp32 residual stream with
16-bit activations). The sum is taken in the promoted dtype and stored in ``residual``'s dtype;
``y``, the norm of that sum, has ``x``'s dtype.
"""

from __future__ import annotations

import torch

CASTING_MODES = ("torch", "llama", "gemma", "none")
DEFAULT_CASTING_MODE = "torch"
# The modes the kernels tell apart, each as the compile-time integer (its index here) the kernels of every
# backend take. "torch" is "gemma" in fp32, so the kernels run it as that (no variant of its own).
KERNEL_CASTING_MODES = ("llama", "gemma", "none")
CASTING_CODES = {
    **{m: code for code, m in enumerate(KERNEL_CASTING_MODES)},
    "torch": KERNEL_CASTING_MODES.index("gemma"),
}
FUSED_ADD_MODES = ("pre", "post")
# The gated norm's gate activations, each as the compile-time integer (its index here) the kernels take.
GATE_ACTIVATIONS = ("silu", "sigmoid")
GATE_CODES = {a: code for code, a in enumerate(GATE_ACTIVATIONS)}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for an input dtype: fp64 stays fp64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def effective_weight(weight, offset: float, dtype: torch.dtype):
    """``offset + weight`` in ``dtype``, or None for RMSNorm without affine."""
    if weight is None:
        return None
    return weight.to(dtype) + offset


def _mean_square(xf):
    """Row mean of squares, 0 for rows of no elements (``mean`` would give NaN)."""
    n = xf.shape[-1]
    return xf.square().sum(-1, keepdim=True) / max(n, 1)


def rms_norm_forward(x, weight=None, eps=1e-6, offset=0.0, casting_mode=DEFAULT_CASTING_MODE):
    """Returns ``(y, rstd)``: ``y`` like ``x``; ``rstd`` of shape ``x.shape[:-1]``, fp32 (fp64 for fp64)."""
    acc = compute_dtype(x.dtype)
    if casting_mode == "none":
        rstd = torch.rsqrt(_mean_square(x.to(acc)) + eps).to(x.dtype)
        y = x * rstd
        w = effective_weight(weight, offset, acc)
        if w is not None:
            y = y * w.to(x.dtype)
        return y, rstd.squeeze(-1).to(acc)
    xf = x.to(acc)
    rstd = torch.rsqrt(_mean_square(xf) + eps)
    w = effective_weight(weight, offset, acc)
    if casting_mode == "llama":
        y = (xf * rstd).to(x.dtype)
        if w is not None:
            y = (y.to(acc) * w).to(x.dtype)
    elif casting_mode in ("gemma", "torch"):
        if casting_mode == "torch" and weight is not None:  # torch multiplies in the promoted dtype
            w = effective_weight(weight, offset, torch.promote_types(acc, weight.dtype))
        y = xf * rstd if w is None else xf * rstd * w
        y = y.to(x.dtype)
    else:
        raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
    return y, rstd.squeeze(-1)


def rms_norm_backward(x, dy, weight, rstd, offset=0.0, casting_mode=DEFAULT_CASTING_MODE):
    """Returns ``(dx, dw)`` for ``y = rms_norm(x)``; ``dw`` is None when ``weight`` is None.

    ``dx = rstd * (w~ * dy - x^ * mean(x^ * w~ * dy))`` with ``x^ = x * rstd``, ``w~ = offset + w``;
    ``dw = sum over rows of dy * x^``. ``casting_mode`` does not change the formula (see module doc).
    """
    del casting_mode  # rounding steps pass gradients through unchanged
    acc = compute_dtype(x.dtype)
    xhat = x.to(acc) * rstd.to(acc).unsqueeze(-1)
    dyf = dy.to(acc)
    w = effective_weight(weight, offset, acc)
    g = dyf if w is None else dyf * w
    dx = rstd.to(acc).unsqueeze(-1) * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = None
    if weight is not None:
        per_row = dyf * xhat
        dw = per_row.sum(tuple(range(x.dim() - 1))) if x.dim() > 1 else per_row
        dw = dw.to(weight.dtype)
    return dx.to(x.dtype), dw


def rms_norm_backward_differentiable(x, dy, weight, rstd, eps, offset=0.0):
    """:func:`rms_norm_backward` as a function of ``x`` that autograd can differentiate again.

    The kernels and the saved ``rstd`` are constants to autograd; here ``rstd`` is recomputed from
    ``x`` so that its dependence on ``x`` enters the second derivatives. Its value stays the saved
    one (which may carry the ``"none"`` mode's rounding), so the first derivatives are unchanged.
    """
    acc = compute_dtype(x.dtype)
    live = torch.rsqrt(_mean_square(x.to(acc)) + eps).squeeze(-1)
    r = live + (rstd.to(acc) - live).detach()
    return rms_norm_backward(x, dy, weight, r, offset)


def fused_add_rms_norm_forward(
    x, residual, weight=None, eps=1e-6, mode="pre", offset=0.0, casting_mode=DEFAULT_CASTING_MODE
):
    """Residual add fused with RMSNorm. Returns ``(y, residual_out, rstd)``.

    ``s = x + residual`` (:func:`fused_add_sum`: in ``residual``'s dtype); ``y = rms_norm(s)`` in
    ``x``'s dtype. ``mode="pre"``: ``residual_out = s`` (pre-norm blocks carry the sum on);
    ``mode="post"``: ``residual_out = y``.
    """
    if mode not in FUSED_ADD_MODES:
        raise ValueError(f"mode must be one of {FUSED_ADD_MODES}, got {mode!r}")
    s = fused_add_sum(x, residual)
    y, rstd = rms_norm_forward(s, weight, eps, offset, casting_mode)
    y = y.to(x.dtype)
    return y, (s if mode == "pre" else y), rstd


def fused_add_sum(x, residual):
    """``x + residual`` in the promoted dtype, stored in ``residual``'s dtype (the residual stream's)."""
    s = x + residual
    return s if s.dtype == residual.dtype else s.to(residual.dtype)


# ----------------------------------------------------------------------------------------------
# Gated RMSNorm (hybrid linear-attention / state-space models)
#
# ``s = silu(z)`` (Qwen3-Next, Mamba2, FalconH1) or ``sigmoid(z)`` (Kimi-Linear, Bailing-hybrid, GLM-5-Next),
# the ``activation``. Norm before gate (Qwen3-Next): ``y = rms_norm(x) * w~ * s``. Gate before norm (Mamba2):
# ``h = x * s``, then ``y = rms_norm(h) * w~``. Either way each group of ``group_size`` contiguous columns has
# its own rstd (``group_size=None``: one group of the whole row). ``rstd`` has shape
# ``x.shape[:-1] + (n_groups,)`` always, one group included, in compute_dtype(x.dtype).
#
# Roundings, as Hugging Face's gated classes place them (the gate is taken in fp32 of z and never rounded):
# * "llama" (Qwen3-Next, Mamba2, Bamba, NemotronH, GraniteMoeHybrid): ``x * s`` in fp32 (gate before norm), the
#   normalized value rounded to x's dtype, times ``w~`` rounded to x's dtype (HF rounds to the weight's and x's
#   promoted dtype: the same bits when the weight has x's dtype, as in HF models), then times ``s`` in fp32
#   (norm before gate) and rounded once more.
# * "gemma" / "torch" (FalconH1): fp32 throughout, one rounding at the end.
# * "none": x's dtype wherever it cannot overflow: ``s`` and ``x * s`` in x's dtype, then the plain "none" norm
#   and, norm before gate, the product with ``s`` rounded to x's dtype.
# ----------------------------------------------------------------------------------------------


def gated_groups(n: int, group_size) -> tuple[int, int]:
    """``(n_groups, group_size)`` for a last dim of ``n``: ``group_size=None`` is one group of the row."""
    if group_size is None:
        return 1, n
    return (n // group_size if group_size else 0), group_size


def _grouped(t, n_groups: int, group_size: int):
    return t.reshape(*t.shape[:-1], n_groups, group_size)


def _gate_and_slope(z, acc, activation):
    """The gate ``s`` of ``activation`` and its derivative, in ``acc``: silu, ``sigmoid(z) * (1 + z * (1 -
    sigmoid(z)))``; sigmoid, ``s * (1 - s)``. silu is torch's own (``z / (1 + exp(-z))``), whose last fp32 bit
    ``z * sigmoid(z)`` misses at about a quarter of the values: HF's fp32 gated norms call it, as they call
    ``torch.sigmoid``."""
    zf = z.to(acc)
    sig = torch.sigmoid(zf)
    if activation == "sigmoid":
        return sig, sig * (1 - sig)
    return torch.nn.functional.silu(zf), sig * (1 + zf * (1 - sig))


def gate(z, activation):
    """The gate of ``activation`` alone, in ``z``'s dtype (the ``"none"`` casting mode's)."""
    return torch.sigmoid(z) if activation == "sigmoid" else torch.nn.functional.silu(z)


def gated_rms_norm_forward(
    x,
    z,
    weight=None,
    eps=1e-6,
    group_size=None,
    norm_before_gate=True,
    offset=0.0,
    casting_mode=DEFAULT_CASTING_MODE,
    activation="silu",
):
    """Returns ``(y, rstd)``: ``y`` like ``x``; ``rstd`` of shape ``x.shape[:-1] + (n_groups,)``, fp32 (fp64
    for fp64 ``x``). ``z`` (the gate's input) has ``x``'s shape and any floating dtype; ``group_size`` divides
    the last dim (None: one group); ``activation`` one of :data:`GATE_ACTIVATIONS`."""
    acc = compute_dtype(x.dtype)
    n_groups, size = gated_groups(x.shape[-1], group_size)
    w = effective_weight(weight, offset, acc)
    if casting_mode == "none":
        s = gate(z.to(x.dtype), activation)
        h = _grouped(x if norm_before_gate else x * s, n_groups, size)
        rstd = torch.rsqrt(_mean_square(h.to(acc)) + eps).to(x.dtype)
        y = (h * rstd).reshape(x.shape)
        if w is not None:
            y = y * w.to(x.dtype)
        return (y * s if norm_before_gate else y), rstd.squeeze(-1).to(acc)
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
    s = _gate_and_slope(z, acc, activation)[0]
    h = _grouped(x.to(acc) if norm_before_gate else x.to(acc) * s, n_groups, size)
    rstd = torch.rsqrt(_mean_square(h) + eps)
    y = (h * rstd).reshape(x.shape)
    if casting_mode == "llama":
        y = y.to(x.dtype)
        if w is not None:
            y = (y.to(acc) * w).to(x.dtype)
        y = y.to(acc)
    elif w is not None:
        if casting_mode == "torch":  # the weight product in the promoted dtype, as in rms_norm_forward
            w = effective_weight(weight, offset, torch.promote_types(acc, weight.dtype))
        y = y * w
    if norm_before_gate:
        y = y * s
    return y.to(x.dtype), rstd.squeeze(-1)


def _gated_backward(x, z, dy, weight, rstd, group_size, norm_before_gate, offset, activation):
    """``(dx, dz, dw)`` in the compute dtype (dw None without a weight), differentiable in every tensor."""
    acc = compute_dtype(x.dtype)
    n_groups, size = gated_groups(x.shape[-1], group_size)
    xf, dyf = x.to(acc), dy.to(acc)
    s, slope = _gate_and_slope(z, acc, activation)
    h = xf if norm_before_gate else xf * s
    r = rstd.to(acc).unsqueeze(-1)
    nhat = _grouped(h, n_groups, size) * r  # (..., n_groups, size)
    nflat = nhat.reshape(x.shape)
    w = effective_weight(weight, offset, acc)
    dn = dyf * s if norm_before_gate else dyf  # the gradient of the normalized value times w~
    per_row = dn * nflat  # dw's summands
    if w is not None:
        dn = dn * w
    dng = _grouped(dn, n_groups, size)
    dh = (r * (dng - nhat * (dng * nhat).sum(-1, keepdim=True) / max(size, 1))).reshape(x.shape)
    if norm_before_gate:
        y_pre = nflat if w is None else nflat * w
        dx, dz = dh, dyf * y_pre * slope
    else:
        dx, dz = dh * s, dh * xf * slope
    dw = None
    if weight is not None:
        dw = per_row.sum(tuple(range(x.dim() - 1))) if x.dim() > 1 else per_row
    return dx, dz, dw


def gated_rms_norm_backward(
    x,
    z,
    dy,
    weight,
    rstd,
    group_size=None,
    norm_before_gate=True,
    offset=0.0,
    casting_mode=DEFAULT_CASTING_MODE,
    activation="silu",
):
    """Returns ``(dx, dz, dw)`` for :func:`gated_rms_norm_forward`, each in its input's dtype (``dw`` None
    without a weight): the exact derivative of the fp32 math; ``casting_mode``'s roundings pass gradients
    through (as in :func:`rms_norm_backward`)."""
    del casting_mode
    dx, dz, dw = _gated_backward(x, z, dy, weight, rstd, group_size, norm_before_gate, offset, activation)
    return dx.to(x.dtype), dz.to(z.dtype), (dw.to(weight.dtype) if dw is not None else None)


def gated_rms_norm_backward_differentiable(x, z, dy, weight, rstd, eps, group_size=None, norm_before_gate=True,
                                           offset=0.0, activation="silu"):  # fmt: skip
    """:func:`gated_rms_norm_backward` as a function autograd can differentiate again: ``rstd`` is recomputed
    from ``x`` and ``z`` (its value stays the saved one), as in :func:`rms_norm_backward_differentiable`."""
    acc = compute_dtype(x.dtype)
    n_groups, size = gated_groups(x.shape[-1], group_size)
    h = x.to(acc) if norm_before_gate else x.to(acc) * _gate_and_slope(z, acc, activation)[0]
    live = torch.rsqrt(_mean_square(_grouped(h, n_groups, size)) + eps).squeeze(-1)
    r = live + (rstd.to(acc) - live).detach()
    dx, dz, dw = _gated_backward(x, z, dy, weight, r, group_size, norm_before_gate, offset, activation)
    return dx.to(x.dtype), dz.to(z.dtype), (dw.to(weight.dtype) if dw is not None else None)


# FP8 output: the norm's y quantized for an FP8 GEMM (rms_norm_fp8, fused_add_rms_norm_fp8)
# ----------------------------------------------------------------------------------------------

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_GROUP_SIZES = (64, 128)
# The floor of a dynamic scale's amax, so that an all-zero row or group gets a finite scale: vLLM's per-token
# minimum scale 1 / (fp8_max * 512) is amax >= 1/512 before the division; per_token_group_quant_fp8 clamps amax
# at its eps, 1e-10. Both then divide by fp8_max (division is monotonic: clamping before or after is the same).
FP8_TOKEN_AMAX_FLOOR = 1.0 / 512.0
FP8_GROUP_AMAX_FLOOR = 1e-10


def fp8_amax_floor(group_size) -> float:
    """The floor of a dynamic scale's amax: per token (``group_size`` None) or per group."""
    return FP8_TOKEN_AMAX_FLOOR if group_size is None else FP8_GROUP_AMAX_FLOOR


def fp8_scale_shape(shape, group_size) -> tuple:
    """The shape of the dynamic scales of a ``shape`` input: ``(..., 1)`` per token, ``(..., cdiv(N, group_size))``
    per group (row-major: a row's group scales side by side)."""
    n = shape[-1]
    return (*shape[:-1], 1 if group_size is None else -(-n // group_size))


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= s`` for positive normal fp32 ``s`` (a UE8M0 scale), exactly; NaN stays NaN.
    Adding a mantissa's worth of ones carries into the exponent unless the mantissa is zero (already a power)."""
    bits = (s.view(torch.int32) + 0x7FFFFF) & 0x7F800000
    return torch.where(torch.isnan(s), s, bits.view(torch.float32))


def quantize_fp8(y, *, scale=None, group_size=None, scale_ub=None, out_dtype=torch.float8_e4m3fn, use_ue8m0=False):
    """``(y_q, scales)``: ``y`` quantized to ``out_dtype`` with fp32 scales, as vLLM quantizes a norm's output.

    * ``scale`` (a one-element fp32 tensor): static per-tensor, ``y_q = saturate(y * (1 / scale))``; ``scales``
      is ``scale``.
    * otherwise dynamic: ``scale = max(min(amax(|y|), scale_ub), floor) / fp8_max`` per row (``scales`` shaped
      ``(..., 1)``, ``floor`` = 1/512: vLLM's minimum scale ``1 / (fp8_max * 512)``) or per group of
      ``group_size`` columns (``(..., cdiv(N, group_size))``, ``floor`` = 1e-10 as ``per_token_group_quant_fp8``;
      a last group narrower than ``group_size`` covers the row's remaining columns), in fp32; ``use_ue8m0``
      rounds each scale up to a power of two (:func:`pow2_ceil`).

    Every element is multiplied by the fp32 reciprocal of its scale (rounded once), as vLLM's static fused kernel
    does, not divided by it: a kernel then spends one division per row or group instead of one per element. The
    fp8 value differs from that of a true division only where the quotient lies within an fp32 ulp or two of a
    rounding boundary between fp8 values (one fp8 step; a scale below fp32's normal range has an infinite
    reciprocal, and a zero times it is NaN). ``saturate`` clamps to ``[-fp8_max, fp8_max]`` before the round to
    nearest even, so no finite value becomes infinite or NaN. NaN propagates: a NaN in a row (a group) makes its
    scale NaN and every element it scales NaN.
    """
    fp8_max = torch.finfo(out_dtype).max
    yf = y.float()
    if scale is not None:
        s = scale.float().reshape(())
    elif group_size is None:
        # A row of no elements has amax 0 (as its mean square, see _mean_square); torch's amax refuses it.
        amax = yf.abs().amax(-1, keepdim=True) if yf.shape[-1] else yf.new_zeros((*yf.shape[:-1], 1))
        s = _fp8_dynamic_scale(amax, scale_ub, FP8_TOKEN_AMAX_FLOOR, fp8_max, use_ue8m0)
    else:
        n = yf.shape[-1]
        groups = -(-n // group_size)
        padded = torch.nn.functional.pad(yf, (0, groups * group_size - n))  # zeros never raise an amax
        amax = padded.unflatten(-1, (groups, group_size)).abs().amax(-1)
        s = _fp8_dynamic_scale(amax, scale_ub, FP8_GROUP_AMAX_FLOOR, fp8_max, use_ue8m0)
    inv = 1.0 / s
    per_element = inv if group_size is None or scale is not None else inv.repeat_interleave(group_size, -1)[..., :n]
    y_q = (yf * per_element).clamp(-fp8_max, fp8_max).to(out_dtype)
    return y_q, (scale if scale is not None else s)


def _fp8_dynamic_scale(amax, scale_ub, floor, fp8_max, use_ue8m0):
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.float().reshape(()))
    s = amax.clamp(min=floor) / fp8_max  # clamp and minimum propagate NaN
    return pow2_ceil(s) if use_ue8m0 else s


def rms_norm_fp8_reference(
    x,
    weight=None,
    eps=1e-6,
    *,
    residual=None,
    scale=None,
    group_size=None,
    scale_ub=None,
    out_dtype=torch.float8_e4m3fn,
    use_ue8m0=False,
    offset=0.0,
    casting_mode=DEFAULT_CASTING_MODE,
):
    """RMSNorm with FP8 output: ``(y_q, scales, residual_out)`` (``residual_out``: the sum, or None without
    ``residual``). Follows vLLM's fused norm-and-quant kernels (``rms_norm_static_fp8_quant``,
    ``rms_norm_dynamic_per_token_quant``, ``rms_norm_per_block_quant`` and their ``fused_add`` variants), whose
    tests compare them with the norm's output in the input dtype quantized by ``scaled_fp8_quant`` (static, or
    dynamic per token with ``scale_ub``) or ``per_token_group_quant_fp8`` (per group, ``use_ue8m0``):

    * ``y`` is :func:`rms_norm_forward` of ``x`` (or of ``s = x + residual``, :func:`fused_add_sum`, in
      residual's dtype), **rounded to x's dtype**, as the unfused pair would store it, and then quantized by
      :func:`quantize_fp8` (scales from that rounded ``y``). ``casting_mode`` places the norm's roundings as in
      :func:`rms_norm_forward`: ``"llama"`` is vLLM's ``RMSNorm``, ``"gemma"`` with ``offset=1`` its
      ``GemmaRMSNorm``.
    * scales are fp32; ``y`` is multiplied by the scale's fp32 reciprocal, as :func:`quantize_fp8` says (vLLM's
      static kernel inverts the scale too; its per-token one divides).
    * ``use_ue8m0`` is the exact smallest power of two at or above the scale. vLLM computes
      ``exp2(ceil(log2(s)))`` in fp32, which for a scale just above a power of two can round ``log2`` down to an
      integer and return the power below (the amax then saturates).
    * a last group narrower than ``group_size`` (``N % group_size != 0``) is scaled by its own columns; vLLM
      requires ``N % group_size == 0``.
    """
    if residual is not None:
        y, residual_out, _ = fused_add_rms_norm_forward(x, residual, weight, eps, "pre", offset, casting_mode)
    else:
        y, residual_out = rms_norm_forward(x, weight, eps, offset, casting_mode)[0], None
    y_q, scales = quantize_fp8(
        y.to(x.dtype), scale=scale, group_size=group_size, scale_ub=scale_ub, out_dtype=out_dtype,
        use_ue8m0=use_ue8m0,
    )  # fmt: skip
    return y_q, scales, residual_out
