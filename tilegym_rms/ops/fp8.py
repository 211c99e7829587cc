"""RMSNorm with FP8 output for serving: ``rms_norm_fp8`` and ``fused_add_rms_norm_fp8`` (the norm's output
quantized for the next FP8 GEMM, :func:`tilegym_rms.reference.rms_norm_fp8_reference`), and their custom ops.

Inference only: no autograd (the outputs are quantized; the fused add writes the residual in place).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _checks, reference
from ..dispatch import resolve_backend
from ..integrations import dtensor as _dtensor
from ..reference import DEFAULT_CASTING_MODE
from .common import _backend, _dense_weight, _forward, _rows
from .fused_add import _fused_add_in_place


def _fp8_forward(x, residual, weight, eps, offset, casting_mode, out_dtype, scale, group_size, scale_ub, use_ue8m0,
                 backend):  # fmt: skip
    """``(y_q, scales)``, ``scales`` None for a static ``scale``; with ``residual`` the sum is written over it. The
    backend's one-pass kernel (:class:`tilegym_rms.dispatch.FP8Backend`) where it has one for these rows, else its
    norm followed by :func:`tilegym_rms.reference.quantize_fp8`."""
    module = _backend(x, backend)
    quant = dict(scale=scale, group_size=group_size, scale_ub=scale_ub, out_dtype=out_dtype, use_ue8m0=use_ue8m0)
    n = x.shape[-1]
    if residual is not None:
        _checks.check_dtype_for_backend(residual, backend, module.SUPPORTED_DTYPES, "residual")
    fused = getattr(module, "fp8_forward", None)
    if (
        fused is None
        or x.numel() == 0
        or n > module.FP8_MAX_N
        or not module.fp8_runs_on(x.device)
        or (residual is not None and residual.dtype != x.dtype and not module.FUSED_ADD_MIXED_DTYPES)
    ):
        if residual is None:
            y, _ = _forward(x, weight, eps, offset, casting_mode, backend, store_rstd=False)
        else:
            y = _fused_add_in_place(x, residual, weight, eps, offset, casting_mode, backend)
        y_q, scales = reference.quantize_fp8(y, **quant)
        return y_q, (None if scale is not None else scales)
    r2 = _rows(residual, n) if residual is not None else None  # a view of residual unless its rows were copied
    y_q, scales = fused(_rows(x, n), r2, _dense_weight(weight), eps, offset, casting_mode, **quant)
    if r2 is not None and r2.data_ptr() != residual.data_ptr():
        residual.copy_(r2.view(residual.shape))
    if scales is not None:
        scales = scales.view(reference.fp8_scale_shape(x.shape, group_size))
    return y_q.view(x.shape), scales


def _fp8_fake(x, out_dtype, scale, group_size):
    shape = (0,) if scale is not None else reference.fp8_scale_shape(x.shape, group_size)
    return torch.empty(x.shape, dtype=out_dtype, device=x.device), x.new_empty(shape, dtype=torch.float32)


# A static call's scales are its scale argument, which a custom op cannot return: the ops return an empty
# placeholder for them, and the public functions return the scale.
@torch.library.custom_op("tilegym_rms::rms_norm_fp8", mutates_args=())
def _fp8_op(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    offset: float,
    casting_mode: str,
    out_dtype: torch.dtype,
    scale: Optional[torch.Tensor],
    group_size: Optional[int],
    scale_ub: Optional[torch.Tensor],
    use_ue8m0: bool,
    backend: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    name = resolve_backend(x.device, backend)  # when the op runs, as in rms_norm_fwd
    y_q, scales = _fp8_forward(x, None, weight, eps, offset, casting_mode, out_dtype, scale, group_size, scale_ub,
                               use_ue8m0, name)  # fmt: skip
    return y_q, scales if scales is not None else x.new_empty((0,), dtype=torch.float32)


@_fp8_op.register_fake
def _(x, weight, eps, offset, casting_mode, out_dtype, scale, group_size, scale_ub, use_ue8m0, backend):
    return _fp8_fake(x, out_dtype, scale, group_size)


@torch.library.custom_op("tilegym_rms::fused_add_rms_norm_fp8", mutates_args=("residual",))
def _fused_add_fp8_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    offset: float,
    casting_mode: str,
    out_dtype: torch.dtype,
    scale: Optional[torch.Tensor],
    group_size: Optional[int],
    scale_ub: Optional[torch.Tensor],
    use_ue8m0: bool,
    backend: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    name = resolve_backend(x.device, backend)
    y_q, scales = _fp8_forward(x, residual, weight, eps, offset, casting_mode, out_dtype, scale, group_size, scale_ub,
                               use_ue8m0, name)  # fmt: skip
    return y_q, scales if scales is not None else x.new_empty((0,), dtype=torch.float32)


@_fused_add_fp8_op.register_fake
def _(x, residual, weight, eps, offset, casting_mode, out_dtype, scale, group_size, scale_ub, use_ue8m0, backend):
    return _fp8_fake(x, out_dtype, scale, group_size)


def _check_call(fn: str, x, residual, weight, eps, offset, casting_mode, scale, group_size, scale_ub, out_dtype,
                use_ue8m0):  # fmt: skip
    """The checks both functions share; returns ``(eps, offset)`` (see :func:`tilegym_rms._checks.check_inputs`)."""
    eps, offset = _checks.check_inputs(x, weight, eps, offset, casting_mode)
    if residual is not None:
        _checks.check_like("residual", residual, x)
    _checks.check_fp8_args(x, scale, group_size, scale_ub, out_dtype, use_ue8m0)
    named = (("x", x), ("residual", residual), ("weight", weight), ("scale", scale), ("scale_ub", scale_ub))
    tensors = [(n, t) for n, t in named if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for _, t in tensors):
        name = next(n for n, t in tensors if t.requires_grad)
        raise RuntimeError(
            f"{fn} is inference-only (its output is quantized; it builds no autograd graph) and {name} requires grad: "
            "call it under torch.no_grad() or torch.inference_mode()"
        )
    if any(type(t) is not torch.Tensor and _dtensor.is_dtensor(t) for _, t in tensors):
        raise TypeError(f"{fn} does not take DTensors: call it on the local shards (rows are independent)")
    return eps, offset


def rms_norm_fp8(
    x,
    weight=None,
    eps=1e-6,
    *,
    scale=None,
    group_size=None,
    scale_ub=None,
    out_dtype=torch.float8_e4m3fn,
    use_ue8m0=False,
    offset=0.0,
    casting_mode=DEFAULT_CASTING_MODE,
    backend=None,
):
    """RMSNorm with its output quantized to fp8 for an FP8 GEMM, in one pass: returns ``(y_q, scales)``, ``y_q``
    shaped like ``x`` in ``out_dtype`` (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``), ``y_q * scales`` (scales
    broadcast over their columns) approximating ``rms_norm(x, weight, eps)``.

    * ``scale`` (a one-element float32 tensor on x's device): static per-tensor, ``y_q = saturate(y * (1 / scale))``;
      ``scales`` is ``scale``.
    * otherwise dynamic, one fp32 scale per row, ``scales`` shaped ``(*x.shape[:-1], 1)``: ``amax(|y|) /
      fp8_max``, at most ``scale_ub`` (a one-element float32 tensor) times ``1 / fp8_max`` when given, at least
      ``1 / (fp8_max * 512)``; or with ``group_size`` (64 or 128) one per group of that many columns, ``scales``
      shaped ``(*x.shape[:-1], cdiv(N, group_size))`` row-major (the layout blockwise FP8 GEMMs read; the last
      group may be narrower). ``use_ue8m0`` rounds dynamic scales up to powers of two.

    ``y`` is the norm's output rounded to x's dtype, as the unfused norm stores it; ``offset`` and
    ``casting_mode`` as :func:`rms_norm` (``casting_mode="llama"`` computes vLLM's ``RMSNorm``). Semantics in
    :func:`tilegym_rms.reference.rms_norm_fp8_reference`. Values beyond fp8's range saturate; a NaN stays in its
    row (per group: its group). Batch invariant as :func:`rms_norm`.

    Inference only: raises RuntimeError when grad mode is on and an input requires grad (there is no gradient
    through a quantized output). On the cutile backend one kernel reads ``x`` and writes ``y_q`` and the scales,
    for rows of up to ``cutile.FP8_MAX_N`` elements; elsewhere (and for wider rows) the backend's norm is
    followed by the quantization in torch. No host synchronization: CUDA graphs capture it.
    """
    eps, offset = _check_call("rms_norm_fp8", x, None, weight, eps, offset, casting_mode, scale, group_size, scale_ub,
                              out_dtype, use_ue8m0)  # fmt: skip
    name = resolve_backend(x.device, backend)
    if torch.compiler.is_compiling():
        y_q, scales = _fp8_op(x, weight, eps, offset, casting_mode, out_dtype, scale, group_size, scale_ub, use_ue8m0,
                              backend)  # fmt: skip
    else:
        y_q, scales = _fp8_forward(x, None, weight, eps, offset, casting_mode, out_dtype, scale, group_size, scale_ub,
                                   use_ue8m0, name)  # fmt: skip
    return y_q, (scale if scale is not None else scales)


def fused_add_rms_norm_fp8(
    x,
    residual,
    weight=None,
    eps=1e-6,
    *,
    scale=None,
    group_size=None,
    scale_ub=None,
    out_dtype=torch.float8_e4m3fn,
    use_ue8m0=False,
    offset=0.0,
    casting_mode=DEFAULT_CASTING_MODE,
    backend=None,
):
    """:func:`rms_norm_fp8` of ``x + residual`` after ``residual += x`` in place (as :func:`fused_add_rms_norm_`:
    the sum in residual's dtype, which may differ from x's); returns ``(y_q, scales)``. The cutile kernel reads
    ``x`` and ``residual`` and writes the sum, ``y_q`` and the scales in one pass. Arguments as
    :func:`rms_norm_fp8`; inference only, as it."""
    eps, offset = _check_call("fused_add_rms_norm_fp8", x, residual, weight, eps, offset, casting_mode, scale,
                              group_size, scale_ub, out_dtype, use_ue8m0)  # fmt: skip
    name = resolve_backend(x.device, backend)
    if torch.compiler.is_compiling():
        y_q, scales = _fused_add_fp8_op(x, residual, weight, eps, offset, casting_mode, out_dtype, scale, group_size,
                                        scale_ub, use_ue8m0, backend)  # fmt: skip
    else:
        y_q, scales = _fp8_forward(x, residual, weight, eps, offset, casting_mode, out_dtype, scale, group_size,
                                   scale_ub, use_ue8m0, name)  # fmt: skip
    return y_q, (scale if scale is not None else scales)
