"""Residual add fused with RMSNorm: ``fused_add_rms_norm`` (autograd) and ``fused_add_rms_norm_`` (in
place, inference), their eager Function and custom ops."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _checks, reference
from ..dispatch import backend_module, resolve_backend
from ..integrations import dtensor as _dtensor
from ..reference import DEFAULT_CASTING_MODE
from .common import WIRING, _backend, _backward, _dense_weight, _forward, _rows, under_func_transform
from .norm import _bwd_op_with_optional_dw, _rms_norm_bwd_fake


def _fused_add_forward(x, residual, weight, eps, mode, offset, casting_mode, backend, store_rstd=True, in_place=False):
    """``(y, residual_out or None, rstd)``; ``in_place`` (mode "pre"): the sum is written into ``residual``
    where the backend can (the returned residual_out then shares its memory), else the caller copies it."""
    module = _backend(x, backend)
    _checks.check_dtype_for_backend(residual, backend, module.SUPPORTED_DTYPES, "residual")
    fused = getattr(module, "fused_add_forward", None)
    if fused is not None and x.numel() > 0 and (residual.dtype == x.dtype or module.FUSED_ADD_MIXED_DTYPES):
        n, w = x.shape[-1], _dense_weight(weight)
        r2 = _rows(residual, n)  # a view of residual unless its rows could not be viewed densely
        kw = {"residual_out": r2} if in_place else {}
        y, res_out, rstd = fused(_rows(x, n), r2, w, eps, offset, casting_mode, mode=mode, store_rstd=store_rstd, **kw)
        rstd = rstd.view(x.shape[:-1]) if rstd is not None else None
        return y.view(x.shape), (res_out.view(x.shape) if mode == "pre" else None), rstd
    # No fused kernel for this backend or dtype pair: the add in torch, the norm in the backend.
    s = reference.fused_add_sum(x, residual)
    y, rstd = _forward(s, weight, eps, offset, casting_mode, backend, store_rstd=store_rstd)
    return y.to(x.dtype), (s if mode == "pre" else None), rstd


def _fused_add_saved(x, residual, res_out, mode):
    """What the backward needs to rebuild the sum: "pre" wrote it, "post" never did (recomputed)."""
    return (res_out, None) if mode == "pre" else (x, residual)


def _fused_add_backward(norm_backward, a, b, weight, rstd, mode, offset, casting_mode, backend, dy, dres,
                        fused_backward=None):  # fmt: skip
    """Gradients ``(ds, dw)`` of the fused add (``ds`` in the sum's dtype, the gradient of ``x`` and
    of ``residual`` up to a cast); ``norm_backward`` is the RMSNorm backward to use (eager function
    or custom op), ``dres`` the gradient of a written ``residual_out``. ``fused_backward`` (same
    arguments plus ``dres`` after ``dy``), where the backend has one, adds ``dres`` of mode "pre" in the
    norm's own pass instead of a torch add over ``ds``."""
    s = a if mode == "pre" else reference.fused_add_sum(a, b)
    if dy is None:  # only residual_out was used
        dy = torch.zeros_like(s)
    if mode == "post" and dres is not None:
        dy = dy + dres  # residual_out is y: its gradient flows into the norm too
    dy = dy.to(s.dtype)
    if mode == "pre" and dres is not None and fused_backward is not None:
        return fused_backward(s, dy, dres.to(s.dtype), weight, rstd, offset, casting_mode, backend)
    ds, dw = norm_backward(s, dy, weight, rstd, offset, casting_mode, backend)
    if mode == "pre" and dres is not None:
        ds = ds + dres
    return ds, dw


def _has_fused_backward(backend: str) -> bool:
    return hasattr(backend_module(backend), "fused_add_backward")


def _fused_norm_backward(s, dy, dres, weight, rstd, offset, casting_mode, backend):
    """A ``fused_backward`` for :func:`_fused_add_backward` in eager mode."""
    return _backward(s, dy, weight, rstd, offset, casting_mode, backend, dres)


def _differentiable_norm_backward(eps):
    """A ``norm_backward`` for :func:`_fused_add_backward` that autograd can differentiate again."""

    def norm_backward(s, dy, weight, rstd, offset, casting_mode, backend):
        return reference.rms_norm_backward_differentiable(s, dy, weight, rstd, eps, offset)

    return norm_backward


class FusedAddRMSNormFunction(torch.autograd.Function):
    """``(y, residual_out)`` of :func:`fused_add_rms_norm` (eager path; double backward as in
    :class:`RMSNormFunction`)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, mode, offset, casting_mode, backend):
        y, res_out, rstd = _fused_add_forward(x, residual, weight, eps, mode, offset, casting_mode, backend)
        ctx.save_for_backward(*_fused_add_saved(x, residual, res_out, mode), weight, rstd)
        ctx.config = (mode, offset, casting_mode, backend)
        ctx.eps, ctx.x_dtype = eps, x.dtype
        # An unused output's gradient arrives as None rather than zeros: no zeros to read and add.
        ctx.set_materialize_grads(False)
        # "post": residual_out is y; a second output slot lets autograd hand its gradient to backward.
        return y, (res_out if mode == "pre" else y.detach())

    @staticmethod
    def backward(ctx, dy, dres):
        if torch.is_grad_enabled():  # double backward: differentiable torch math throughout
            norm_backward, fused = _differentiable_norm_backward(ctx.eps), None
        else:
            norm_backward = _backward
            fused = _fused_norm_backward if _has_fused_backward(ctx.config[-1]) else None
        ds, dw = _fused_add_backward(norm_backward, *ctx.saved_tensors, *ctx.config, dy, dres, fused)
        # The same tensor for both inputs where dtypes match (autograd accumulates each separately).
        return ds.to(ctx.x_dtype), ds, dw, None, None, None, None, None


@torch.library.custom_op("tilegym_rms::fused_add_rms_norm_fwd", mutates_args=())
def _fused_add_fwd_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    mode: str,
    offset: float,
    casting_mode: str,
    backend: Optional[str],
    wiring: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    name = resolve_backend(x.device, backend)  # as in rms_norm_fwd
    y, res_out, rstd = _fused_add_forward(x, residual, weight, eps, mode, offset, casting_mode, name)
    # A custom op cannot return an alias of another output: in "post" mode the caller returns y twice.
    return y, (res_out if mode == "pre" else x.new_empty((0,))), rstd


@_fused_add_fwd_op.register_fake
def _(x, residual, weight, eps, mode, offset, casting_mode, backend, wiring):
    res_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if mode == "pre" else x.new_empty((0,))
    rstd = x.new_empty(x.shape[:-1], dtype=reference.compute_dtype(residual.dtype))
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), res_out, rstd


def _fused_op_setup_context(ctx, inputs, output):
    x, residual, weight, _eps, mode, offset, casting_mode, backend, _wiring = inputs
    ctx.save_for_backward(*_fused_add_saved(x, residual, output[1], mode), weight, output[2])
    ctx.config = (mode, offset, casting_mode, backend)
    ctx.x_dtype = x.dtype
    ctx.set_materialize_grads(False)  # as in FusedAddRMSNormFunction


@torch.library.custom_op("tilegym_rms::fused_add_rms_norm_bwd", mutates_args=())
def _fused_add_bwd_op(
    s: torch.Tensor,
    dy: torch.Tensor,
    dres: torch.Tensor,
    weight: Optional[torch.Tensor],
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
    backend: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    ds, dw = _backward(s, dy, weight, rstd, offset, casting_mode, resolve_backend(s.device, backend), dres)
    return ds, dw if dw is not None else s.new_empty((0,))  # as in rms_norm_bwd


@_fused_add_bwd_op.register_fake
def _(s, dy, dres, weight, rstd, offset, casting_mode, backend):
    return _rms_norm_bwd_fake(s, dy, weight, rstd, offset, casting_mode, backend)


def _fused_bwd_op_with_optional_dw(s, dy, dres, weight, rstd, offset, casting_mode, backend):
    ds, dw = _fused_add_bwd_op(s, dy, dres, weight, rstd, offset, casting_mode, backend)
    return ds, (dw if weight is not None else None)


def _fused_op_backward(ctx, dy, dres, _drstd):
    a, b, weight, rstd = ctx.saved_tensors
    mode, backend = ctx.config[0], ctx.config[-1]
    fused = _fused_bwd_op_with_optional_dw if _has_fused_backward(resolve_backend(a.device, backend)) else None
    ds, dw = _fused_add_backward(
        _bwd_op_with_optional_dw, a, b, weight, rstd, *ctx.config, dy, dres if mode == "pre" else None, fused
    )
    return ds.to(ctx.x_dtype), ds, dw, None, None, None, None, None, None


_fused_add_fwd_op.register_autograd(_fused_op_backward, setup_context=_fused_op_setup_context)


@_dtensor.sharding_rule(_fused_add_fwd_op)
def _fused_add_fwd_rule(x, weight, mode, **_):
    w = _dtensor.weight_placement(weight)

    def outputs(p):
        # mode "post" returns an empty placeholder for residual_out (the caller returns y twice).
        return [p, p if mode == "pre" else _dtensor.placeholder(), p]

    return _dtensor.row_rules(x, outputs, lambda p: {"x": p, "residual": p, "weight": w})


@_dtensor.sharding_rule(_fused_add_bwd_op)
def _fused_add_bwd_rule(s, weight, **_):
    # As rms_norm_bwd's, dres sharded like s.
    w = _dtensor.weight_placement(weight)
    outputs = lambda p: [p, _dtensor.weight_grad_placement(p, weight)]  # ds, dw
    return _dtensor.row_rules(s, outputs, lambda p: {"s": p, "dy": p, "dres": p, "weight": w, "rstd": p})


def fused_add_rms_norm(
    x, residual, weight=None, eps=1e-6, *, mode="pre", offset=0.0, casting_mode=DEFAULT_CASTING_MODE, backend=None
):
    """Residual add fused with RMSNorm: returns ``(y, residual_out)``.

    ``mode="pre"`` (pre-norm blocks): ``residual_out = x + residual``, ``y = rms_norm(residual_out)``.
    ``mode="post"``: ``y = rms_norm(x + residual)``, ``residual_out = y`` (the sum is never written).
    Differentiable in ``x``, ``residual`` and ``weight`` (double backward as :func:`rms_norm`).

    ``residual`` may have another floating dtype than ``x`` (an fp32 residual stream beside 16-bit
    activations): the sum is taken in the promoted dtype and kept in ``residual``'s dtype, so
    ``residual_out`` (mode "pre") has ``residual``'s dtype and ``y`` has ``x``'s. Other arguments as
    :func:`rms_norm`. Batch invariant as :func:`rms_norm`: a row's ``y``, ``residual_out`` and gradients.
    """
    eps, offset = _checks.check_inputs(x, weight, eps, offset, casting_mode)
    _checks.check_like("residual", residual, x)
    _checks.check_fused_mode(mode)
    name = resolve_backend(x.device, backend)
    if torch.compiler.is_compiling() or (type(x) is not torch.Tensor and _dtensor.is_dtensor(x)):
        _dtensor.register()  # as in rms_norm
        y, res_out, _ = _fused_add_fwd_op(x, residual, weight, eps, mode, offset, casting_mode, backend, WIRING)
        return y, (res_out if mode == "pre" else y)
    if under_func_transform():  # as in rms_norm: torch.func transforms see through the reference's math
        return reference.fused_add_rms_norm_forward(x, residual, weight, eps, mode, offset, casting_mode)[:2]
    needs_grad = x.requires_grad or residual.requires_grad or (weight is not None and weight.requires_grad)
    if torch.is_grad_enabled() and needs_grad:
        return FusedAddRMSNormFunction.apply(x, residual, weight, eps, mode, offset, casting_mode, name)
    y, res_out, _ = _fused_add_forward(x, residual, weight, eps, mode, offset, casting_mode, name, store_rstd=False)
    return y, (res_out if mode == "pre" else y)


def _fused_add_in_place(x, residual, weight, eps, offset, casting_mode, backend):
    y, s, _ = _fused_add_forward(x, residual, weight, eps, "pre", offset, casting_mode, backend, False, True)
    if s.data_ptr() != residual.data_ptr():  # the torch add, or residual rows that were copied to be read
        residual.copy_(s)
    return y


@torch.library.custom_op("tilegym_rms::fused_add_rms_norm_inplace", mutates_args=("residual",))
def _fused_add_in_place_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    offset: float,
    casting_mode: str,
    backend: Optional[str],
) -> torch.Tensor:
    name = resolve_backend(x.device, backend)  # as in rms_norm_fwd
    return _fused_add_in_place(x, residual, weight, eps, offset, casting_mode, name)


@_fused_add_in_place_op.register_fake
def _(x, residual, weight, eps, offset, casting_mode, backend):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def fused_add_rms_norm_(
    x, residual, weight=None, eps=1e-6, *, offset=0.0, casting_mode=DEFAULT_CASTING_MODE, backend=None
):
    """In-place residual add fused with RMSNorm, for inference: ``residual`` becomes ``x + residual``
    (:func:`fused_add_rms_norm`'s ``residual_out`` of mode "pre", in ``residual``'s dtype); returns
    ``y = rms_norm(x + residual)`` (a new tensor in ``x``'s dtype). ``x`` is left unchanged: unlike vLLM's
    ``fused_add_rms_norm(input, residual, ...)``, which also writes the output over ``input``.

    No autograd: raises RuntimeError when grad mode is on and an input requires grad (use
    :func:`fused_add_rms_norm`). On the cutile backend the kernel writes the sum over ``residual`` in
    the same pass; other backends copy it there. Arguments as :func:`fused_add_rms_norm`.
    """
    eps, offset = _checks.check_inputs(x, weight, eps, offset, casting_mode)
    _checks.check_like("residual", residual, x)
    tensors = (x, residual) if weight is None else (x, residual, weight)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        name = next(n for n, t in zip(("x", "residual", "weight"), tensors, strict=False) if t.requires_grad)
        raise RuntimeError(
            f"fused_add_rms_norm_ is inference-only (it builds no autograd graph) and {name} requires grad: call "
            "it under torch.no_grad() or torch.inference_mode(), or use fused_add_rms_norm for training"
        )
    if any(type(t) is not torch.Tensor and _dtensor.is_dtensor(t) for t in tensors):
        raise TypeError("fused_add_rms_norm_ does not take DTensors; use fused_add_rms_norm")
    name = resolve_backend(x.device, backend)
    if torch.compiler.is_compiling():
        return _fused_add_in_place_op(x, residual, weight, eps, offset, casting_mode, backend)
    return _fused_add_in_place(x, residual, weight, eps, offset, casting_mode, name)
