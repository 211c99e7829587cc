"""Pure-torch RMSNorm: the semantics every kernel is tested against, and the CPU backend.

All functions normalize over the last dimension and accept any leading dims.

``casting_mode`` follows the community convention (HF Llama / Gemma, Liger):

* ``"llama"``: ``rstd`` in fp32; ``x * rstd`` is rounded to the input dtype, then multiplied by
  ``offset + weight`` (computed in fp32) and rounded again.
* ``"gemma"``: everything in fp32, ``(offset + weight)`` in fp32, one rounding at the end.
* ``"none"``: the input dtype throughout (the mean square, ``rstd``, ``x * rstd`` and the weight
  product are each rounded to the input dtype).

``rstd`` is returned in fp32 (fp64 for fp64 input, so that ``gradcheck`` is exact). The backward
is the exact derivative of the fp32 math for every mode: rounding steps pass gradients through.
"""

from __future__ import annotations

import torch

CASTING_MODES = ("llama", "gemma", "none")
FUSED_ADD_MODES = ("pre", "post")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for an input dtype: fp64 stays fp64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def effective_weight(weight, offset: float, dtype: torch.dtype):
    """``offset + weight`` in ``dtype``, or None for RMSNorm without affine."""
    if weight is None:
        return None
    return weight.to(dtype) + offset


def rms_norm_forward(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    """Returns ``(y, rstd)``: ``y`` like ``x``; ``rstd`` of shape ``x.shape[:-1]``, fp32 (fp64 for fp64)."""
    acc = compute_dtype(x.dtype)
    if casting_mode == "none":
        mean_sq = (x.to(acc).square().mean(-1, keepdim=True)).to(x.dtype)
        rstd = torch.rsqrt(mean_sq + eps)
        y = x * rstd
        w = effective_weight(weight, offset, acc)
        if w is not None:
            y = y * w.to(x.dtype)
        return y, rstd.squeeze(-1).to(acc)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    w = effective_weight(weight, offset, acc)
    if casting_mode == "llama":
        y = (xf * rstd).to(x.dtype)
        if w is not None:
            y = (y.to(acc) * w).to(x.dtype)
    elif casting_mode == "gemma":
        y = xf * rstd if w is None else xf * rstd * w
        y = y.to(x.dtype)
    else:
        raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
    return y, rstd.squeeze(-1)


def rms_norm_backward(dy, x, weight, rstd, offset=0.0, casting_mode="llama"):
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
        dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx.to(x.dtype), dw


def fused_add_rms_norm_forward(x, residual, weight=None, eps=1e-6, mode="pre", offset=0.0, casting_mode="llama"):
    """Residual add fused with RMSNorm. Returns ``(y, residual_out, rstd)``.

    ``s = x + residual`` (in the input dtype); ``y = rms_norm(s)``. ``mode="pre"``: ``residual_out = s``
    (pre-norm blocks carry the sum on); ``mode="post"``: ``residual_out = y``.
    """
    if mode not in FUSED_ADD_MODES:
        raise ValueError(f"mode must be one of {FUSED_ADD_MODES}, got {mode!r}")
    s = x + residual
    y, rstd = rms_norm_forward(s, weight, eps, offset, casting_mode)
    return y, (s if mode == "pre" else y), rstd
