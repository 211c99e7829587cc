"""Gated RMSNorm: ``gated_rms_norm``, its eager Function and custom ops (``tilegym_rms::gated_rms_norm_fwd`` /
``gated_rms_norm_bwd``) and their DTensor sharding rules.

Backends with :class:`~tilegym_rms.dispatch.GatedBackend` run it in one pass each way; others run the
reference's torch math on the device."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _checks, reference
from ..dispatch import resolve_backend
from ..integrations import dtensor as _dtensor
from ..reference import DEFAULT_CASTING_MODE, compute_dtype, gated_groups
from .common import WIRING, _backend, _dense_weight, _rows, under_func_transform


def _gated_module(x, z, backend):
    """The backend module where it has :class:`~tilegym_rms.dispatch.GatedBackend` and ``x`` is not empty, else
    None (the torch math)."""
    module = _backend(x, backend)
    _checks.check_dtype_for_backend(z, backend, module.SUPPORTED_DTYPES, "z")
    return module if x.numel() > 0 and hasattr(module, "gated_forward") else None


def _gated_forward(x, z, weight, eps, group_size, norm_before_gate, offset, casting_mode, activation, backend,
                   store_rstd=True):  # fmt: skip
    """``(y, rstd)``: ``y`` contiguous like ``x``, ``rstd`` ``x.shape[:-1] + (n_groups,)`` (None unless
    ``store_rstd`` where a kernel runs)."""
    module = _gated_module(x, z, backend)
    if module is None:
        y, rstd = reference.gated_rms_norm_forward(
            x, z, weight, eps, group_size, norm_before_gate, offset, casting_mode, activation
        )
        return y.contiguous(), rstd.contiguous()
    n = x.shape[-1]
    n_groups, size = gated_groups(n, group_size)
    y, rstd = module.gated_forward(
        _rows(x, n), _rows(z, n), _dense_weight(weight), eps, offset, casting_mode,
        group_size=size, norm_before_gate=norm_before_gate, activation=activation, store_rstd=store_rstd,
    )  # fmt: skip
    return y.view(x.shape), (rstd.view(*x.shape[:-1], n_groups) if rstd is not None else None)


def _gated_backward(x, z, dy, weight, rstd, group_size, norm_before_gate, offset, casting_mode, activation, backend):
    """``(dx, dz, dw)``, contiguous like ``x`` and ``z``; ``dw`` None without a weight."""
    module = _gated_module(x, z, backend)
    if module is None:
        dx, dz, dw = reference.gated_rms_norm_backward(
            x, z, dy, weight, rstd, group_size, norm_before_gate, offset, casting_mode, activation
        )
        return dx.contiguous(), dz.contiguous(), dw
    n = x.shape[-1]
    n_groups, size = gated_groups(n, group_size)
    dx, dz, dw = module.gated_backward(
        _rows(x, n), _rows(z, n), _rows(dy, n), _dense_weight(weight), rstd.reshape(-1, n_groups), offset,
        casting_mode, group_size=size, norm_before_gate=norm_before_gate, activation=activation,
    )  # fmt: skip
    return dx.view(x.shape), dz.view(z.shape), dw


class GatedRMSNormFunction(torch.autograd.Function):
    """``y = gated_rms_norm(x, z)``; saves ``x``, ``z``, ``weight`` and ``rstd`` (double backward as in
    :class:`~tilegym_rms.ops.RMSNormFunction`: torch math when grad mode is on in the backward)."""

    @staticmethod
    def forward(ctx, x, z, weight, eps, group_size, norm_before_gate, offset, casting_mode, activation, backend):
        config = (group_size, norm_before_gate, offset, casting_mode, activation)
        y, rstd = _gated_forward(x, z, weight, eps, *config, backend)
        ctx.save_for_backward(x, z, weight, rstd)
        ctx.config = (*config, backend)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, z, weight, rstd = ctx.saved_tensors
        group_size, norm_before_gate, offset, _casting_mode, activation, _backend = ctx.config
        if torch.is_grad_enabled():
            grads = reference.gated_rms_norm_backward_differentiable(
                x, z, dy, weight, rstd, ctx.eps, group_size, norm_before_gate, offset, activation
            )
        else:
            grads = _gated_backward(x, z, dy, weight, rstd, *ctx.config)
        return *grads, None, None, None, None, None, None, None


@torch.library.custom_op("tilegym_rms::gated_rms_norm_fwd", mutates_args=())
def _gated_fwd_op(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    group_size: Optional[int],
    norm_before_gate: bool,
    offset: float,
    casting_mode: str,
    activation: str,
    backend: Optional[str],
    wiring: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    name = resolve_backend(x.device, backend)  # where the op runs, as in rms_norm_fwd
    return _gated_forward(x, z, weight, eps, group_size, norm_before_gate, offset, casting_mode, activation, name)


@_gated_fwd_op.register_fake
def _(x, z, weight, eps, group_size, norm_before_gate, offset, casting_mode, activation, backend, wiring):
    n_groups = gated_groups(x.shape[-1], group_size)[0]
    rstd = x.new_empty((*x.shape[:-1], n_groups), dtype=compute_dtype(x.dtype))
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), rstd


@torch.library.custom_op("tilegym_rms::gated_rms_norm_bwd", mutates_args=())
def _gated_bwd_op(
    x: torch.Tensor,
    z: torch.Tensor,
    dy: torch.Tensor,
    weight: Optional[torch.Tensor],
    rstd: torch.Tensor,
    group_size: Optional[int],
    norm_before_gate: bool,
    offset: float,
    casting_mode: str,
    activation: str,
    backend: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    name = resolve_backend(x.device, backend)
    config = (group_size, norm_before_gate, offset, casting_mode, activation)
    dx, dz, dw = _gated_backward(x, z, dy, weight, rstd, *config, name)
    return dx, dz, dw if dw is not None else x.new_empty((0,))  # a custom op cannot return None


@_gated_bwd_op.register_fake
def _(x, z, dy, weight, rstd, group_size, norm_before_gate, offset, casting_mode, activation, backend):
    dw = weight.new_empty(weight.shape) if weight is not None else x.new_empty((0,))
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(z.shape, dtype=z.dtype, device=z.device),
        dw,
    )


def _gated_op_setup_context(ctx, inputs, output):
    x, z, weight, _eps, group_size, norm_before_gate, offset, casting_mode, activation, backend, _wiring = inputs
    ctx.save_for_backward(x, z, weight, output[1])
    ctx.config = (group_size, norm_before_gate, offset, casting_mode, activation, backend)


def _gated_op_backward(ctx, dy, _drstd):
    x, z, weight, rstd = ctx.saved_tensors
    dx, dz, dw = _gated_bwd_op(x, z, dy, weight, rstd, *ctx.config)
    return dx, dz, (dw if weight is not None else None), None, None, None, None, None, None, None, None


_gated_fwd_op.register_autograd(_gated_op_backward, setup_context=_gated_op_setup_context)


@_dtensor.sharding_rule(_gated_fwd_op)
def _gated_fwd_rule(x, weight, **_):
    w = _dtensor.weight_placement(weight)
    return _dtensor.row_rules(x, lambda p: [p, p], lambda p: {"x": p, "z": p, "weight": w})


@_dtensor.sharding_rule(_gated_bwd_op)
def _gated_bwd_rule(x, weight, **_):
    w = _dtensor.weight_placement(weight)
    outputs = lambda p: [p, p, _dtensor.weight_grad_placement(p, weight)]  # dx, dz, dw
    return _dtensor.row_rules(x, outputs, lambda p: {"x": p, "z": p, "dy": p, "weight": w, "rstd": p})


def gated_rms_norm(
    x,
    z,
    weight=None,
    eps=1e-6,
    *,
    group_size=None,
    norm_before_gate=True,
    offset=0.0,
    casting_mode=DEFAULT_CASTING_MODE,
    activation="silu",
    backend=None,
):
    """Gated RMSNorm of hybrid linear-attention and state-space models, differentiable in ``x``, ``z`` and
    ``weight``. With ``s = silu(z)`` (or ``sigmoid(z)``, ``activation="sigmoid"``):

    * ``norm_before_gate=True`` (Qwen3-Next, FalconH1): ``y = rms_norm(x) * (offset + weight) * s``;
    * ``norm_before_gate=False`` (Mamba2, Bamba, NemotronH): ``y = rms_norm(x * s) * (offset + weight)``.

    Each group of ``group_size`` contiguous columns is normalized with its own rstd (None: the whole row).

    Args:
        x: ``(..., N)``, float32, float16 or bfloat16 (float64 on the torch backend); any strides.
        z: the gate, ``x``'s shape and device, any of those dtypes (an fp32 gate beside 16-bit ``x`` is fine).
        weight: ``(N,)`` or None; ``eps``, ``offset``, ``backend`` as in :func:`tilegym_rms.rms_norm`.
        group_size: None or a positive int dividing ``N``.
        casting_mode: where the roundings fall: ``"llama"`` rounds as Hugging Face's Qwen3-Next and Mamba2
            classes do, ``"torch"`` / ``"gemma"`` as FalconH1's (fp32 throughout); see
            :mod:`tilegym_rms.reference`.
        activation: the gate, ``"silu"`` or ``"sigmoid"`` (Kimi-Linear, Bailing-hybrid, GLM-5-Next).

    Returns:
        ``y``, with the shape and dtype of ``x`` (contiguous). Empty inputs give empty outputs.
    """
    eps, offset = _checks.check_inputs(x, weight, eps, offset, casting_mode)
    _checks.check_gated(x, z, group_size, norm_before_gate, activation)
    if group_size is not None:
        group_size = int(group_size)
    args = (x, z, weight, eps, group_size, norm_before_gate, offset, casting_mode, activation)
    if torch.compiler.is_compiling() or (type(x) is not torch.Tensor and _dtensor.is_dtensor(x)):
        _dtensor.register()  # as in rms_norm: the rules must exist before a traced call meets a DTensor
        return _gated_fwd_op(*args, backend, WIRING)[0]
    if under_func_transform():  # as in rms_norm: torch.func transforms see through the reference's math
        return reference.gated_rms_norm_forward(*args)[0]
    name = resolve_backend(x.device, backend)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, z, weight)):
        return GatedRMSNormFunction.apply(*args, name)
    return _gated_forward(*args, name, store_rstd=False)[0]
