"""``rms_norm`` and its standalone forward and backward: the eager autograd Function and the custom ops
``tilegym_rms::rms_norm_fwd`` / ``rms_norm_bwd`` (the torch.compile and DTensor path)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _checks, reference
from ..dispatch import backend_module, resolve_backend
from ..integrations import dtensor as _dtensor
from ..reference import DEFAULT_CASTING_MODE
from .common import WIRING, _backward, _forward, under_func_transform

# ----------------------------------------------------------------------------------------------
# Eager autograd
# ----------------------------------------------------------------------------------------------


class RMSNormFunction(torch.autograd.Function):
    """``y = rms_norm(x)``; saves ``x``, ``weight`` and ``rstd`` for the backward.

    With ``create_graph=True`` (grad mode on inside backward) the backward is computed with
    differentiable torch math instead of the kernels, so that double backward is exact."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, backend, kernel):
        y, rstd = _forward(x, weight, eps, offset, casting_mode, backend, kernel)
        ctx.save_for_backward(x, weight, rstd)
        ctx.config = (offset, casting_mode, backend)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():
            dx, dw = reference.rms_norm_backward_differentiable(x, dy, weight, rstd, ctx.eps, ctx.config[0])
        else:
            dx, dw = _backward(x, dy, weight, rstd, *ctx.config)
        return dx, dw, None, None, None, None, None


@torch.library.custom_op("tilegym_rms::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    offset: float,
    casting_mode: str,
    backend: Optional[str],
    kernel: Optional[str],
    wiring: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    # ``backend`` None is resolved here, where the op runs, not where it was traced: a program that
    # torch.export saved on one machine picks the best backend of the machine that loads it.
    return _forward(x, weight, eps, offset, casting_mode, resolve_backend(x.device, backend), kernel)


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps, offset, casting_mode, backend, kernel, wiring):
    rstd_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), x.new_empty(x.shape[:-1], dtype=rstd_dtype)


@torch.library.custom_op("tilegym_rms::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(
    x: torch.Tensor,
    dy: torch.Tensor,
    weight: Optional[torch.Tensor],
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
    backend: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = _backward(x, dy, weight, rstd, offset, casting_mode, resolve_backend(x.device, backend))
    # A custom op cannot return None: without a weight, dw is an empty tensor.
    return dx, dw if dw is not None else x.new_empty((0,))


@_rms_norm_bwd_op.register_fake
def _rms_norm_bwd_fake(x, dy, weight, rstd, offset, casting_mode, backend):
    dw = weight.new_empty(weight.shape) if weight is not None else x.new_empty((0,))
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), dw


def _fwd_op_setup_context(ctx, inputs, output):
    x, weight, _eps, offset, casting_mode, backend, _kernel, _wiring = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.config = (offset, casting_mode, backend)


def _fwd_op_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_bwd_op(x, dy, weight, rstd, *ctx.config)
    return dx, (dw if weight is not None else None), None, None, None, None, None, None


_rms_norm_fwd_op.register_autograd(_fwd_op_backward, setup_context=_fwd_op_setup_context)


def _bwd_op_with_optional_dw(x, dy, weight, rstd, offset, casting_mode, backend):
    dx, dw = _rms_norm_bwd_op(x, dy, weight, rstd, offset, casting_mode, backend)
    return dx, (dw if weight is not None else None)


@_dtensor.sharding_rule(_rms_norm_fwd_op)
def _rms_norm_fwd_rule(x, weight, **_):
    w = _dtensor.weight_placement(weight)
    return _dtensor.row_rules(x, lambda p: [p, p], lambda p: {"x": p, "weight": w})


@_dtensor.sharding_rule(_rms_norm_bwd_op)
def _rms_norm_bwd_rule(x, weight, **_):
    w = _dtensor.weight_placement(weight)
    outputs = lambda p: [p, _dtensor.weight_grad_placement(p, weight)]  # dx, dw
    return _dtensor.row_rules(x, outputs, lambda p: {"x": p, "dy": p, "weight": w, "rstd": p})


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def rms_norm(x, weight=None, eps=1e-6, *, offset=0.0, casting_mode=DEFAULT_CASTING_MODE, backend=None, kernel=None):
    """RMSNorm over the last dim of ``x``: ``y = x * rstd * (offset + weight)``,
    ``rstd = 1 / sqrt(mean(x^2) + eps)``. Differentiable in ``x`` and ``weight``.

    Args:
        x: any shape ``(..., N)``; float32, float16 or bfloat16 (float64 on the torch backend).
            Non-contiguous inputs are fine (strided rows are read in place; others are copied once).
        weight: ``(N,)`` of any floating dtype of 16 bits or more, or None for RMSNorm without affine.
        eps: added to the mean square; a real number ``>= 0`` (int, float, numpy scalar or 0-dim CPU tensor),
            or None for torch's default: the machine epsilon of fp32 (of fp64 for fp64 ``x``).
        offset: added to the weight (Gemma uses 1.0); must be 0 without a weight.
        casting_mode: where the 16-bit roundings fall: ``"torch"`` (what ``F.rms_norm`` computes),
            ``"llama"``, ``"gemma"`` or ``"none"``; see :mod:`tilegym_rms.reference`.
        backend: ``"cutile"``, ``"triton"``, ``"torch"`` or None (choose; ``TILEGYM_RMS_BACKEND``
            overrides the choice).
        kernel: force a forward kernel of the backend (cutile: ``"gather"`` / ``"persistent"`` / ``"tiles"`` /
            ``"split"``, the last for rows over 16384 columns, experimental; triton: ``"block"`` / ``"block_row"`` /
            ``"partitioned"``); None chooses. Other values, and values that cannot serve the input, raise.

    Returns:
        ``y``, with the shape and dtype of ``x``. Empty inputs (any dim 0) give empty outputs.

    Batch invariant: a row's ``y`` (and its gradient) is the same bits whatever other rows share the call
    and however many (README, "Batch invariance"); the weight's gradient, a sum over the rows, is only
    deterministic.

    Double backward (``create_graph=True``) works in eager mode (the backward is then computed with
    torch math); ``torch.compile`` does not support it. Under ``torch.func`` transforms (``vmap``, ``grad``,
    ``jacrev``, ``jvp``, ...) the call computes the reference's torch math (:mod:`tilegym_rms.reference`), which
    every transform sees through, instead of the kernels.
    """
    eps, offset = _checks.check_inputs(x, weight, eps, offset, casting_mode)
    name = resolve_backend(x.device, backend)
    if torch.compiler.is_compiling() or (type(x) is not torch.Tensor and _dtensor.is_dtensor(x)):
        # DTensor runs the op on local shards by its sharding rules, which must exist before a traced
        # call meets one (register() is a constant of the trace: it runs once while Dynamo traces).
        _dtensor.register()
        return _rms_norm_fwd_op(x, weight, eps, offset, casting_mode, backend, kernel, WIRING)[0]
    if under_func_transform():
        return reference.rms_norm_forward(x, weight, eps, offset, casting_mode)[0]
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return RMSNormFunction.apply(x, weight, eps, offset, casting_mode, name, kernel)
    return _forward(x, weight, eps, offset, casting_mode, name, kernel, store_rstd=False)[0]


def rms_norm_forward(
    x, weight=None, eps=1e-6, *, offset=0.0, casting_mode=DEFAULT_CASTING_MODE, backend=None, kernel=None
):
    """Forward without autograd: returns ``(y, rstd)``, ``rstd`` fp32 of shape ``x.shape[:-1]``
    (what :func:`rms_norm_backward` takes; fp64 for fp64 ``x``). Arguments as :func:`rms_norm`."""
    eps, offset = _checks.check_inputs(x, weight, eps, offset, casting_mode)
    name = resolve_backend(x.device, backend)
    with torch.no_grad():
        if type(x) is not torch.Tensor and _dtensor.is_dtensor(x):  # local shards, as in rms_norm
            return _rms_norm_fwd_op(x, weight, eps, offset, casting_mode, backend, kernel, WIRING)
        return _forward(x, weight, eps, offset, casting_mode, name, kernel)


def rms_norm_backward(x, dy, weight, rstd, *, offset=0.0, casting_mode=DEFAULT_CASTING_MODE, backend=None):
    """Standalone backward (no autograd graph): returns ``(dx, dw)`` for ``y = rms_norm(x, weight)``
    given the upstream gradient ``dy`` and the ``rstd`` of :func:`rms_norm_forward` (fp32, or fp64
    for fp64 ``x``; other dtypes raise TypeError). ``dw`` is None when ``weight`` is None.
    Deterministic: the same inputs give bitwise the same ``dw``."""
    _, offset = _checks.check_inputs(x, weight, 0.0, offset, casting_mode)
    _checks.check_like("dy", dy, x)
    _checks.check_rstd(rstd, x)
    name = resolve_backend(x.device, backend)
    with torch.no_grad():
        if type(x) is not torch.Tensor and _dtensor.is_dtensor(x):  # local shards, as in rms_norm
            return _bwd_op_with_optional_dw(x, dy, weight, rstd, offset, casting_mode, backend)
        return _backward(x, dy, weight, rstd, offset, casting_mode, name)


def backward_workspace_bytes(m: int, n: int, dtype: torch.dtype, backend: str, device=None) -> int:
    """Bytes of the fp32 dw partial buffer that ``backend``'s backward allocates for ``(m, n)``."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    module = backend_module(backend)
    fn = getattr(module, "backward_workspace_bytes", None)
    return fn(m, n, dtype, device) if fn is not None else 0
