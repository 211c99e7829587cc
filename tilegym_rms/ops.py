"""Public functional API and its PyTorch wiring.

Eager calls go through :class:`RMSNormFunction` / :class:`FusedAddRMSNormFunction` (plain autograd
Functions: the least host work per call). Under ``torch.compile`` the same computation is reached
through the custom ops ``tilegym_rms::rms_norm_fwd``, ``tilegym_rms::rms_norm_bwd`` and
``tilegym_rms::fused_add_rms_norm_fwd``, which have fake (meta) implementations and registered
autograd, so a compiled model traces without graph breaks, and ``torch.export`` records them. Called
with ``backend=None``, an op chooses the backend when it runs, so an exported program picks the best
one of the machine that runs it. DTensor inputs take the custom ops in eager mode too: DTensor runs
them on the local shards by the rules of :mod:`tilegym_rms.integrations.dtensor`. With
``create_graph=True`` the eager Functions compute the backward with differentiable torch math (double
backward).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Optional

import torch

from . import _checks, reference
from .dispatch import backend_module, resolve_backend
from .integrations import dtensor as _dtensor
from .reference import DEFAULT_CASTING_MODE

# ----------------------------------------------------------------------------------------------
# Shape plumbing shared by every path: N-D tensors <-> the 2-D row views the backends take
# ----------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """A 2-D ``(M, N)`` view with a dense last dim; copies only when no such view exists."""
    if t.is_contiguous():  # the common cases, kept cheap: this runs on every call
        return t if t.dim() == 2 else t.view(-1, n)
    t2 = t.reshape(-1, n)
    if (n > 1 and t2.stride(1) != 1) or (t2.shape[0] > 1 and t2.stride(0) < n):
        t2 = t2.contiguous()  # a gather along the row, or rows that overlap (broadcast grads)
    return t2


def _backend(x: torch.Tensor, name: str):
    module = backend_module(name)
    _checks.check_dtype_for_backend(x, name, module.SUPPORTED_DTYPES)
    return module


def _dense_weight(weight):
    # is_contiguous() first: contiguous() is a dispatcher call even when it returns its input.
    return weight if weight is None or weight.is_contiguous() else weight.contiguous()


def _empty_forward(x, eps, casting_mode, store_rstd):
    """Empty input: no kernel runs. A last dim of 0 still has rows, whose rstd the reference defines."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, (reference.rms_norm_forward(x, None, eps, 0.0, casting_mode)[1] if store_rstd else None)


def _check_kernel(module, name: str, kernel) -> None:
    if kernel not in module.FORWARD_KERNELS:
        if not module.FORWARD_KERNELS:
            raise ValueError(f"backend {name!r} has one forward kernel: kernel must be None, got {kernel!r}")
        choices = ", ".join(map(repr, module.FORWARD_KERNELS))
        raise ValueError(f"backend {name!r} has the forward kernels {choices}: got kernel={kernel!r}")


def _forward(x, weight, eps, offset, casting_mode, backend, kernel=None, store_rstd=True):
    """``(y, rstd)`` with ``y`` shaped like ``x`` and ``rstd`` shaped ``x.shape[:-1]`` (or None
    when not ``store_rstd``: no backward will follow)."""
    module = _backend(x, backend)
    if kernel is not None:
        _check_kernel(module, backend, kernel)
    if x.numel() == 0:
        return _empty_forward(x, eps, casting_mode, store_rstd)
    x2, w = _rows(x, x.shape[-1]), _dense_weight(weight)
    if kernel is None:  # the common call, without the keyword
        y, rstd = module.forward(x2, w, eps, offset, casting_mode, store_rstd=store_rstd)
    else:
        y, rstd = module.forward(x2, w, eps, offset, casting_mode, store_rstd=store_rstd, kernel=kernel)
    if x2 is x:
        return y, rstd
    return y.view(x.shape), (rstd.view(x.shape[:-1]) if rstd is not None else None)


def _backward(x, dy, weight, rstd, offset, casting_mode, backend, dres=None):
    """``(dx, dw)``; with ``dres`` (the gradient of a fused add's residual_out, like ``x``) ``dx + dres``
    from the backend's one-pass :meth:`~tilegym_rms.dispatch.FusedAddBackwardBackend.fused_add_backward`."""
    module = _backend(x, backend)
    if x.numel() == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format), (
            torch.zeros_like(weight) if weight is not None else None
        )
    n = x.shape[-1]
    rows = rstd if rstd.dim() == 1 else rstd.reshape(-1)
    x2, dy2, w = _rows(x, n), _rows(dy, n), _dense_weight(weight)
    if dres is None:
        dx, dw = module.backward(x2, dy2, w, rows, offset, casting_mode)
    else:
        dx, dw = module.fused_add_backward(x2, dy2, _rows(dres, n), w, rows, offset, casting_mode)
    return (dx if x.dim() == 2 else dx.view(x.shape)), dw


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


# ----------------------------------------------------------------------------------------------
# torch.library custom ops (the torch.compile path)
# ----------------------------------------------------------------------------------------------


def _wiring_fingerprint() -> str:
    try:
        return hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:16]
    except OSError:  # no source file (a frozen or zipped install): the version stands in
        from . import __version__

        return __version__


# torch's AOTAutograd cache keys a compiled graph on the Dynamo graph, which names the forward ops, but not
# on the backward registered for them: a cached backward of an older version of this file was reused with
# a newer op signature and gave wrong gradients (PERFORMANCE.md, "Host path"). The forward ops take
# this fingerprint of the file as an argument, so that the graph, and the cache key, change with it.
WIRING = _wiring_fingerprint()


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


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def rms_norm(x, weight=None, eps=1e-6, *, offset=0.0, casting_mode=DEFAULT_CASTING_MODE, backend=None, kernel=None):
    """RMSNorm over the last dim of ``x``: ``y = x * rstd * (offset + weight)``,
    ``rstd = 1 / sqrt(mean(x^2) + eps)``. Differentiable in ``x`` and ``weight``.

    Args:
        x: any shape ``(..., N)``; float32, float16 or bfloat16 (float64 on the torch backend).
            Non-contiguous inputs are fine (strided rows are read in place; others are copied once).
        weight: ``(N,)`` of any floating dtype, or None for RMSNorm without affine.
        eps: added to the mean square; a real number ``>= 0`` (int, float, numpy scalar or 0-dim CPU tensor),
            or None for torch's default: the machine epsilon of fp32 (of fp64 for fp64 ``x``).
        offset: added to the weight (Gemma uses 1.0); must be 0 without a weight.
        casting_mode: where the 16-bit roundings fall: ``"torch"`` (what ``F.rms_norm`` computes),
            ``"llama"``, ``"gemma"`` or ``"none"``; see :mod:`tilegym_rms.reference`.
        backend: ``"cutile"``, ``"triton"``, ``"torch"`` or None (choose; ``TILEGYM_RMS_BACKEND``
            overrides the choice).
        kernel: force a forward kernel of the backend (cutile: ``"gather"`` / ``"persistent"``; triton:
            ``"block"`` / ``"block_row"`` / ``"partitioned"``); None chooses. Other values raise.

    Returns:
        ``y``, with the shape and dtype of ``x``. Empty inputs (any dim 0) give empty outputs.

    Batch invariant: a row's ``y`` (and its gradient) is the same bits whatever other rows share the call
    and however many (README, "Batch invariance"); the weight's gradient, a sum over the rows, is only
    deterministic.

    Double backward (``create_graph=True``) works in eager mode (the backward is then computed with
    torch math); ``torch.compile`` does not support it.
    """
    eps, offset = _checks.check_inputs(x, weight, eps, offset, casting_mode)
    name = resolve_backend(x.device, backend)
    if torch.compiler.is_compiling() or (type(x) is not torch.Tensor and _dtensor.is_dtensor(x)):
        # DTensor runs the op on local shards by its sharding rules, which must exist before a traced
        # call meets one (register() is a constant of the trace: it runs once while Dynamo traces).
        _dtensor.register()
        return _rms_norm_fwd_op(x, weight, eps, offset, casting_mode, backend, kernel, WIRING)[0]
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


# ----------------------------------------------------------------------------------------------
# Fused residual add + RMSNorm
# ----------------------------------------------------------------------------------------------


def _fused_add_forward(x, residual, weight, eps, mode, offset, casting_mode, backend, store_rstd=True, in_place=False):
    """``(y, residual_out or None, rstd)``; ``in_place`` (mode "pre"): the sum is written into ``residual``
    where the backend can (the returned residual_out then shares its memory), else the caller copies it."""
    module = _backend(x, backend)
    _checks.check_dtype_for_backend(residual, backend, module.SUPPORTED_DTYPES)
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


def _bwd_op_with_optional_dw(x, dy, weight, rstd, offset, casting_mode, backend):
    dx, dw = _rms_norm_bwd_op(x, dy, weight, rstd, offset, casting_mode, backend)
    return dx, (dw if weight is not None else None)


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


# ----------------------------------------------------------------------------------------------
# QK-norm: queries and keys normalized per head, in one launch each way where the backend can
#
# Layout: rows are independent, so each tensor is read in its memory order: its leading dims permuted by
# decreasing stride ("stride order"; a no-op for contiguous tensors, the (B, S, H) order of a (B, H, S, D)
# transpose of a projection output), then grouped into a 3-D (G, H, D) view. Every projection layout has
# one (contiguous, heads transposed, a slice of a fused qkv output); other tensors are copied once. The
# outputs are dense with the inputs' stride order, as torch's elementwise ops give them; rstd is flat, one
# value per row in that order.
# ----------------------------------------------------------------------------------------------


def _stride_order(t: torch.Tensor) -> list[int]:
    """The leading dims of ``t`` by decreasing stride (stable: contiguous tensors keep their order)."""
    lead = range(t.dim() - 1)
    return list(lead) if t.is_contiguous() else sorted(lead, key=lambda i: -t.stride(i))


def _in_order(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    return t.permute(*order, t.dim() - 1)


def _from_order(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Undoes :func:`_in_order` on an output shaped like the permuted input (or its rstd, one dim less)."""
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return t.permute(*inverse, *range(len(order), t.dim()))


def _empty_in_order(t: torch.Tensor) -> torch.Tensor:
    """An output for ``t``: dense, dims in ``t``'s stride order (what the qk functions return)."""
    order = _stride_order(t)
    return _from_order(torch.empty(_in_order(t, order).shape, dtype=t.dtype, device=t.device), order)


def _rows_apart(t3: torch.Tensor) -> bool:
    """Whether the rows of a ``(G, H, D)`` view are dense and never overlap (what the kernels assume)."""
    d, span = t3.shape[2], t3.shape[2]
    if d > 1 and t3.stride(2) != 1:
        return False
    for stride, size in sorted((s, n) for n, s in zip(t3.shape[:2], t3.stride()[:2], strict=True) if n > 1):
        if stride < span:
            return False
        span = stride * size
    return True


def _heads_shape(t: torch.Tensor) -> tuple[int, int, int]:
    """``(G, H, D)`` for ``t`` in stride order: its leading dims merged where they are one run of memory.
    More than two runs cannot be one 3-D view: ``(M, 1, D)``, which the caller's reshape copies."""
    runs: list[list[int]] = []  # [size, stride] of each run, outermost first
    for size, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True):
        if size == 1:
            continue
        if runs and runs[-1][1] == size * stride:
            runs[-1] = [runs[-1][0] * size, stride]
        else:
            runs.append([size, stride])
    d = t.shape[-1]
    if len(runs) == 2:
        return runs[0][0], runs[1][0], d
    return math.prod(t.shape[:-1]), 1, d


def _heads_view(t: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    t3 = t.reshape(shape)  # a view where the strides allow one
    return t3 if _rows_apart(t3) else t3.contiguous()


def _heads(t: torch.Tensor) -> torch.Tensor:
    """The ``(G, H, D)`` view the backend's qk kernels take of ``t`` (already in stride order)."""
    return _heads_view(t, _heads_shape(t))


def _qk_forward(q, k, q_weight, k_weight, eps, offset, casting_mode, backend):
    """``(q_out, k_out, q_rstd, k_rstd)``, outputs dense in the inputs' stride order, rstd flat."""
    module = _backend(q, backend)
    orders = (_stride_order(q), _stride_order(k))
    qo, ko = _in_order(q, orders[0]), _in_order(k, orders[1])
    fused = getattr(module, "qk_forward", None)
    if fused is not None and q.numel() > 0 and k.numel() > 0:
        q3, k3 = _heads(qo), _heads(ko)
        yq, yk, rq, rk = fused(q3, k3, _dense_weight(q_weight), _dense_weight(k_weight), eps, offset, casting_mode)
        outs = ((yq.view(qo.shape), rq), (yk.view(ko.shape), rk))
    else:  # no qk kernel, or an empty tensor: the plain norm on each
        outs = [_forward(t, w, eps, offset, casting_mode, backend) for t, w in ((qo, q_weight), (ko, k_weight))]
    (yq, rq), (yk, rk) = outs
    return _from_order(yq, orders[0]), _from_order(yk, orders[1]), rq.reshape(-1), rk.reshape(-1)


def _qk_backward(q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset, casting_mode, backend):
    """``(dq, dk, dq_weight, dk_weight)`` from the flat rstd of :func:`_qk_forward`."""
    module = _backend(q, backend)
    orders = (_stride_order(q), _stride_order(k))
    qo, ko = _in_order(q, orders[0]), _in_order(k, orders[1])
    dqo, dko = _in_order(dq_out, orders[0]), _in_order(dk_out, orders[1])
    fused = getattr(module, "qk_backward", None)
    if fused is not None and q.numel() > 0 and k.numel() > 0:
        sq, sk = _heads_shape(qo), _heads_shape(ko)
        q3, dq3, k3, dk3 = _heads_view(qo, sq), _heads_view(dqo, sq), _heads_view(ko, sk), _heads_view(dko, sk)
        wq, wk = _dense_weight(q_weight), _dense_weight(k_weight)
        rq, rk = q_rstd.view(sq[:2]), k_rstd.view(sk[:2])
        dq, dk, dwq, dwk = fused(q3, k3, dq3, dk3, wq, wk, rq, rk, offset, casting_mode)
        dq, dk = dq.view(qo.shape), dk.view(ko.shape)
    else:
        dq, dwq = _backward(qo, dqo, q_weight, q_rstd.view(qo.shape[:-1]), offset, casting_mode, backend)
        dk, dwk = _backward(ko, dko, k_weight, k_rstd.view(ko.shape[:-1]), offset, casting_mode, backend)
    return _from_order(dq, orders[0]), _from_order(dk, orders[1]), dwq, dwk


def _rstd_of(t: torch.Tensor, flat_rstd: torch.Tensor) -> torch.Tensor:
    """The flat rstd of :func:`_qk_forward` shaped ``t.shape[:-1]`` (for the torch-math backward)."""
    order = _stride_order(t)
    return _from_order(flat_rstd.view(_in_order(t, order).shape[:-1]), order)


class QKRMSNormFunction(torch.autograd.Function):
    """``(q_out, k_out)`` of :func:`qk_rms_norm` (eager path; double backward as in :class:`RMSNormFunction`)."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps, offset, casting_mode, backend):
        yq, yk, rq, rk = _qk_forward(q, k, q_weight, k_weight, eps, offset, casting_mode, backend)
        ctx.save_for_backward(q, k, q_weight, k_weight, rq, rk)
        ctx.config = (offset, casting_mode, backend)
        ctx.eps = eps
        return yq, yk

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, q_weight, k_weight, rq, rk = ctx.saved_tensors
        offset = ctx.config[0]
        if torch.is_grad_enabled():
            dq, dwq = reference.rms_norm_backward_differentiable(q, dq_out, q_weight, _rstd_of(q, rq), ctx.eps, offset)
            dk, dwk = reference.rms_norm_backward_differentiable(k, dk_out, k_weight, _rstd_of(k, rk), ctx.eps, offset)
        else:
            dq, dk, dwq, dwk = _qk_backward(q, k, dq_out, dk_out, q_weight, k_weight, rq, rk, *ctx.config)
        return dq, dk, dwq, dwk, None, None, None, None


@torch.library.custom_op("tilegym_rms::qk_rms_norm_fwd", mutates_args=())
def _qk_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],
    eps: float,
    offset: float,
    casting_mode: str,
    backend: Optional[str],
    wiring: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    name = resolve_backend(q.device, backend)  # as in rms_norm_fwd
    return _qk_forward(q, k, q_weight, k_weight, eps, offset, casting_mode, name)


@_qk_fwd_op.register_fake
def _(q, k, q_weight, k_weight, eps, offset, casting_mode, backend, wiring):
    rstd_dtype = reference.compute_dtype(q.dtype)
    rq, rk = (t.new_empty((math.prod(t.shape[:-1]),), dtype=rstd_dtype) for t in (q, k))
    return _empty_in_order(q), _empty_in_order(k), rq, rk


@torch.library.custom_op("tilegym_rms::qk_rms_norm_bwd", mutates_args=())
def _qk_bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],
    q_rstd: torch.Tensor,
    k_rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
    backend: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    name = resolve_backend(q.device, backend)
    dq, dk, dwq, dwk = _qk_backward(
        q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset, casting_mode, name
    )
    # A custom op's outputs may not share storage (torch checks it on every call): the cuTile backend reduces
    # both weights' dw into one (2, D) buffer and returns its rows, so one of them is copied (D elements).
    if dwq is not None and dwk is not None and dwq.untyped_storage().data_ptr() == dwk.untyped_storage().data_ptr():
        dwk = dwk.clone()
    # A custom op cannot return None: a missing weight's dw is an empty tensor.
    return dq, dk, (dwq if dwq is not None else q.new_empty((0,))), (dwk if dwk is not None else k.new_empty((0,)))


@_qk_bwd_op.register_fake
def _(q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset, casting_mode, backend):
    dwq, dwk = (w.new_empty(w.shape) if w is not None else t.new_empty((0,)) for t, w in ((q, q_weight), (k, k_weight)))
    return _empty_in_order(q), _empty_in_order(k), dwq, dwk


def _qk_op_setup_context(ctx, inputs, output):
    q, k, q_weight, k_weight, _eps, offset, casting_mode, backend, _wiring = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, output[2], output[3])
    ctx.config = (offset, casting_mode, backend)


def _qk_op_backward(ctx, dq_out, dk_out, _drq, _drk):
    q, k, q_weight, k_weight, rq, rk = ctx.saved_tensors
    dq, dk, dwq, dwk = _qk_bwd_op(q, k, dq_out, dk_out, q_weight, k_weight, rq, rk, *ctx.config)
    dwq, dwk = (dwq if q_weight is not None else None), (dwk if k_weight is not None else None)
    return dq, dk, dwq, dwk, None, None, None, None, None


_qk_fwd_op.register_autograd(_qk_op_backward, setup_context=_qk_op_setup_context)


def qk_rms_norm(
    q, k, q_weight=None, k_weight=None, eps=1e-6, *, offset=0.0, casting_mode=DEFAULT_CASTING_MODE, backend=None
):
    """QK-norm: RMSNorm of queries and keys per head, ``(q_out, k_out)`` with the values of
    ``rms_norm(q, q_weight, ...)`` and ``rms_norm(k, k_weight, ...)``. Differentiable in all four tensors
    (double backward as :func:`rms_norm`).

    ``q`` and ``k`` are ``(..., heads, head_dim)`` with one head dim ``D``, dtype and device; head counts
    and leading dims may differ (GQA). Any layout: contiguous ``(B, S, H, D)``, its ``(B, H, S, D)``
    transpose, a slice of a fused qkv projection output are read in place; tensors without a 3-D
    ``(G, H, D)`` view of dense rows are copied once. The outputs are dense with the inputs' dim order
    (as ``q * 2`` would be): a transposed ``q`` gives a transposed ``q_out``, a qkv slice a compact one.
    Weights are ``(D,)`` or None; other arguments as :func:`rms_norm`.

    On the ``cutile`` backend both tensors take one launch forward and one backward (plus the dw
    reduction, one launch for both weights); other backends normalize each tensor with their plain norm.
    DTensor inputs take :func:`rms_norm` on each tensor. Batch invariant as :func:`rms_norm`: a token's heads
    give the same bits (outputs and gradients) whatever the batch and sequence sizes.
    """
    eps, offset = _checks.check_inputs(q, q_weight, eps, offset, casting_mode, ("q", "q_weight"))
    _checks.check_qk_pair(q, k)
    _checks.check_inputs(k, k_weight, eps, offset, casting_mode, ("k", "k_weight"))
    if type(q) is not torch.Tensor and _dtensor.is_dtensor(q):  # the norm's sharding rules cover each tensor
        kw = dict(offset=offset, casting_mode=casting_mode, backend=backend)
        return rms_norm(q, q_weight, eps, **kw), rms_norm(k, k_weight, eps, **kw)
    name = resolve_backend(q.device, backend)
    if torch.compiler.is_compiling():
        return _qk_fwd_op(q, k, q_weight, k_weight, eps, offset, casting_mode, backend, WIRING)[:2]
    tensors = (q, k, q_weight, k_weight)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return QKRMSNormFunction.apply(q, k, q_weight, k_weight, eps, offset, casting_mode, name)
    return _qk_forward(q, k, q_weight, k_weight, eps, offset, casting_mode, name)[:2]
