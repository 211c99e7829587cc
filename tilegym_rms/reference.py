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
* ``"none"``: the input dtype wherever it cannot overflow: the mean square is accumulated in fp32
  (in fp16 it would overflow once a row's RMS passes 256), ``rstd`` is rounded to the input dtype,
  and ``x * rstd`` and the weight product are each rounded to the input dtype.

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
