"""QK-norm: ``qk_rms_norm``, its layout code, eager Function and custom ops."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks, reference
from ..dispatch import resolve_backend
from ..integrations import dtensor as _dtensor
from ..reference import DEFAULT_CASTING_MODE
from .common import WIRING, _backend, _backward, _dense_weight, _forward, under_func_transform
from .norm import rms_norm

# ----------------------------------------------------------------------------------------------
# QK-norm: queries and keys normalized per head, in one launch each way where the backend can
#
# Layout: rows are independent, so each tensor is read in its memory order: its leading dims permuted by
# decreasing stride ("stride order"; a no-op for contiguous tensors, the (B, S, H) order of a (B, H, S, D)
# transpose of a projection output). The backend's qk kernels take 4-D ``(A, G, H, D)`` views of every tensor
# of one side (q, and in the backward its output gradient; k likewise), each with its own strides: the leading
# dims in q's stride order, size-1 dims dropped, adjacent dims merged where every one of those tensors can
# merge them, padded with 1s in front. That reads every layout attention hands over in place: a dense tensor is
# ``(1, 1, M, D)``, a fused qkv slice ``(1, tokens, heads, D)``, a gradient handed back through a ``.transpose
# (1, 2)`` from a ``(B, H, S, D)`` consumer ``(B, S, H, D)`` beside a dense q. The outputs are dense with the
# inputs' stride order, as torch's elementwise ops give them; rstd is flat, one value per row in that order.
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


def _rows_apart(t: torch.Tensor) -> bool:
    """Whether the rows of ``t`` (its last dim) are dense and never overlap (what the kernels assume)."""
    d, span = t.shape[-1], t.shape[-1]
    if d > 1 and t.stride(-1) != 1:
        return False
    for stride, size in sorted((s, n) for n, s in zip(t.shape[:-1], t.stride()[:-1], strict=True) if n > 1):
        if stride < span:
            return False
        span = stride * size
    return True


def _runs(tensors: list[torch.Tensor]) -> list[int]:
    """The sizes of the leading dims of ``tensors`` (one shape) with size-1 dims dropped and adjacent dims merged
    where every tensor's strides allow it: the fewest dims that view all of them."""
    sizes: list[int] = []
    inner: list[int] = []  # each tensor's stride of the last merged dim
    for i, size in enumerate(tensors[0].shape[:-1]):
        if size == 1:
            continue
        strides = [t.stride(i) for t in tensors]
        if sizes and all(outer == size * s for outer, s in zip(inner, strides, strict=True)):
            sizes[-1] *= size
        else:
            sizes.append(size)
        inner = strides
    return sizes


def _qk_views(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
    """The ``(A, G, H, D)`` views the backend's qk kernels take of ``tensors`` (one shape, in stride order), and
    their ``(A, G, H)``. A tensor whose rows are gathered or overlap (a broadcast gradient) is copied first."""
    tensors = [t if _rows_apart(t) else t.contiguous() for t in tensors]
    lead = _runs(tensors)
    # More than three runs (5-D and wider layouts only) have no 4-D view: the most fragmented tensor is copied
    # dense until the rest fit. Each copy reads and writes that tensor once more.
    while len(lead) > 3:
        worst = max(range(len(tensors)), key=lambda i: len(_runs(tensors[i : i + 1])))
        tensors[worst] = tensors[worst].contiguous()
        lead = _runs(tensors)
    shape = (1,) * (3 - len(lead)) + tuple(lead)
    return [t.view(*shape, t.shape[-1]) for t in tensors], shape


def _qk_forward(q, k, q_weight, k_weight, eps, offset, casting_mode, backend):
    """``(q_out, k_out, q_rstd, k_rstd)``, outputs dense in the inputs' stride order, rstd flat."""
    module = _backend(q, backend)
    orders = (_stride_order(q), _stride_order(k))
    qo, ko = _in_order(q, orders[0]), _in_order(k, orders[1])
    fused = getattr(module, "qk_forward", None)
    if fused is not None and q.numel() > 0 and k.numel() > 0:
        (q4,), _ = _qk_views([qo])
        (k4,), _ = _qk_views([ko])
        yq, yk, rq, rk = fused(q4, k4, _dense_weight(q_weight), _dense_weight(k_weight), eps, offset, casting_mode)
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
        (q4, dq4), sq = _qk_views([qo, dqo])
        (k4, dk4), sk = _qk_views([ko, dko])
        wq, wk = _dense_weight(q_weight), _dense_weight(k_weight)
        rq, rk = q_rstd.view(sq), k_rstd.view(sk)
        dq, dk, dwq, dwk = fused(q4, k4, dq4, dk4, wq, wk, rq, rk, offset, casting_mode)
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
    transpose, a slice of a fused qkv projection output, and output gradients in any of these layouts or
    transposed back from a ``(B, H, S, D)`` consumer, are read in place; tensors whose rows are not dense or
    overlap, and layouts of more than three strided leading dims, are copied once. The outputs are dense
    with the inputs' dim order (as ``q * 2`` would be): a transposed ``q`` gives a transposed ``q_out``, a
    qkv slice a compact one. Weights are ``(D,)`` or None; other arguments as :func:`rms_norm`.

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
    if under_func_transform():  # as in rms_norm: torch.func transforms see through the reference's math
        ref = (
            reference.rms_norm_forward(t, w, eps, offset, casting_mode)[0] for t, w in ((q, q_weight), (k, k_weight))
        )
        return tuple(ref)
    tensors = (q, k, q_weight, k_weight)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return QKRMSNormFunction.apply(q, k, q_weight, k_weight, eps, offset, casting_mode, name)
    return _qk_forward(q, k, q_weight, k_weight, eps, offset, casting_mode, name)[:2]
