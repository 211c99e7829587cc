"""The QK-norm host (:class:`tilegym_rms.dispatch.QKNormBackend`): q and k in one launch forward, one backward
and the dw reduction, on 4-D ``(A, G, H, D)`` views with a dense last dim; in the batch-invariant mode the plain
norm's launches on each."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ...batch_invariance import is_batch_invariant
from ...reference import CASTING_CODES
from .. import config
from . import common
from .backward import backward, reduce, reduce_launch
from .common import Launch, Target, make_launch, plain, target, weight_arg
from .forward import forward


def config_for(tgt: Target, q_shape, k_shape, d: int, dtype: torch.dtype) -> config.QKConfig:
    """Tiles, grids and hints for q and k viewed ``(A, G, H, D)`` (``q_shape``, ``k_shape``: their ``(A, G,
    H)``): the table's qk entry for their rows together, else the heuristics."""
    rows = math.prod(q_shape) + math.prod(k_shape)
    entry = tgt.table.lookup("qk", rows, d, dtype) if tgt.table is not None else None
    return config.qk_config(q_shape, k_shape, d, dtype, tgt.sms, entry)


def _tile_constants(tiles: config.QKTiles) -> tuple[int, int, int, int]:
    """``(TILE_GQ, TILE_HQ, TILE_GK, TILE_HK)``."""
    return (*tiles[0], *tiles[1])


def forward_launch(tgt: Target, q_shape, k_shape, d, dtype, casting_mode, has_wq, has_wk) -> Launch:
    cfg = config_for(tgt, q_shape, k_shape, d, dtype)
    exact_d = cfg.fwd_head[0] == d  # the mean's divisor known at compile time (a power of two)
    constants = (*_tile_constants(cfg.fwd_tiles), *cfg.fwd_head, CASTING_CODES[casting_mode], has_wq,
                 has_wk, exact_d, cfg.fwd_walk)  # fmt: skip
    return make_launch(common.kernels().qk_rms_norm_fwd, (cfg.fwd_grid,), constants, cfg.fwd_hints)


@dataclass(frozen=True)
class QKBackwardLaunches:
    """The qk backward and, with a weight, the dw reduction of its ``(grid, 2, D)`` partial buffer: over both
    weights' ``2 * D`` columns at once where they share a dtype (``one_reduction``), else over each weight's
    ``D`` (one launch per weight)."""

    main: Launch
    partial_shape: tuple[int, int, int]  # (1, 1, 1): a dummy without weights
    reduce: Launch | None
    one_reduction: bool


def backward_launches(tgt: Target, q_shape, k_shape, d, dtype, has_wq, has_wk, one_reduction) -> QKBackwardLaunches:
    cfg = config_for(tgt, q_shape, k_shape, d, dtype)
    constants = (*_tile_constants(cfg.bwd_tiles), *cfg.bwd_head, has_wq, has_wk)
    main = make_launch(common.kernels().qk_rms_norm_bwd, (cfg.bwd_grid,), constants, cfg.bwd_hints)
    if not (has_wq or has_wk):
        return QKBackwardLaunches(main, (1, 1, 1), None, False)
    sums = reduce_launch(tgt, 2 * d if one_reduction else d)
    return QKBackwardLaunches(main, (cfg.bwd_grid, 2, d), sums, one_reduction)


def start_forward(fl: Launch, q, k, q_weight, k_weight, eps, offset, dev: int, launch) -> tuple:
    """``(q_out, k_out, q_rstd, k_rstd)``: allocates the outputs of the qk forward and launches it (see
    :mod:`.common`)."""
    yq, yk = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rq, rk = (t.new_empty(t.shape[:3], dtype=torch.float32) for t in (q, k))
    args = (plain(q), plain(k), weight_arg(q_weight, q), weight_arg(k_weight, k), yq, yk, rq, rk, float(eps),
            float(offset), *fl.constants)  # fmt: skip
    launch(fl.kernel, fl.grid, args, dev, fl.hints, fl.built)
    return yq, yk, rq, rk


def start_backward(bl: QKBackwardLaunches, q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset, dev,
                   launch) -> tuple:  # fmt: skip
    """``(dq, dk, dq_weight, dk_weight)``: allocates the outputs of the qk backward and launches it and the dw
    reductions (see :mod:`.common`)."""
    dq, dk = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    # A dummy keeps the signature when there is no weight (nothing is written to it then).
    dw_partial = q.new_empty(bl.partial_shape, dtype=torch.float32)
    args = (plain(dq_out), plain(dk_out), plain(q), plain(k), weight_arg(q_weight, q), weight_arg(k_weight, k),
            q_rstd, k_rstd, dq, dk, dw_partial, float(offset), *bl.main.constants)  # fmt: skip
    launch(bl.main.kernel, bl.main.grid, args, dev, bl.main.hints, bl.main.built)
    if bl.reduce is None:
        return dq, dk, None, None
    d = bl.partial_shape[2]
    if bl.one_reduction:
        dw = q_weight.new_empty((2, d))
        reduce(bl.reduce, dw_partial.view(bl.partial_shape[0], 2 * d), dw.view(2 * d), dev, launch)
        return dq, dk, dw[0], dw[1]
    dws = tuple(None if w is None else w.new_empty((d,)) for w in (q_weight, k_weight))
    for slot, dw in enumerate(dws):
        if dw is not None:
            reduce(bl.reduce, dw_partial[:, slot], dw, dev, launch)
    return dq, dk, *dws


# Keyed by the views' (A, G, H) shapes: the tiles split along G and H follow them.
@functools.lru_cache(maxsize=4096)
def cached_config(dev: int, q_shape, k_shape, d: int, dtype) -> config.QKConfig:
    return config_for(target(dev), q_shape, k_shape, d, dtype)


@functools.lru_cache(maxsize=4096)
def cached_forward(dev: int, q_shape, k_shape, d, dtype, casting_mode, has_wq, has_wk) -> Launch:
    return forward_launch(target(dev), q_shape, k_shape, d, dtype, casting_mode, has_wq, has_wk)


@functools.lru_cache(maxsize=4096)
def cached_backward(dev: int, q_shape, k_shape, d, dtype, has_wq, has_wk, one_reduction) -> QKBackwardLaunches:
    return backward_launches(target(dev), q_shape, k_shape, d, dtype, has_wq, has_wk, one_reduction)


CACHES = (cached_config, cached_forward, cached_backward)


def _shapes(q, k) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return tuple(q.shape[:3]), tuple(k.shape[:3])


def _rows_of(t4: torch.Tensor) -> torch.Tensor:
    """An ``(A, G, H, D)`` view as the rows the plain norm takes (copied where no such view exists)."""
    return t4.reshape(-1, t4.shape[3])


def _invariant_forward(q, k, q_weight, k_weight, eps, offset, casting_mode):
    """QK-norm in the batch-invariant mode: the plain norm's invariant launches on q's rows, then on k's. The qk
    kernels size their row tiles by the row count and loop over them, so they would not serve."""
    outs = []
    for t, w in ((q, q_weight), (k, k_weight)):
        y, rstd = forward(_rows_of(t), w, eps, offset, casting_mode)
        outs += [y.view(t.shape), rstd.view(t.shape[:3])]
    return outs[0], outs[2], outs[1], outs[3]


def _invariant_backward(q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset, casting_mode):
    """The backward of :func:`_invariant_forward`."""
    dq, dwq = backward(_rows_of(q), _rows_of(dq_out), q_weight, q_rstd.reshape(-1), offset, casting_mode)
    dk, dwk = backward(_rows_of(k), _rows_of(dk_out), k_weight, k_rstd.reshape(-1), offset, casting_mode)
    return dq.view(q.shape), dk.view(k.shape), dwq, dwk


def qk_forward(q, k, q_weight, k_weight, eps, offset, casting_mode):
    """``(q_out, k_out, q_rstd, k_rstd)`` for 4-D views; see :class:`tilegym_rms.dispatch.QKNormBackend`."""
    if is_batch_invariant():
        return _invariant_forward(q, k, q_weight, k_weight, eps, offset, casting_mode)
    dev = q.get_device()
    fl = cached_forward(dev, *_shapes(q, k), q.shape[3], q.dtype, casting_mode, q_weight is not None,
                        k_weight is not None)  # fmt: skip
    return start_forward(fl, q, k, q_weight, k_weight, eps, offset, dev, common.launcher())


def qk_backward(q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset, casting_mode):
    """``(dq, dk, dq_weight, dk_weight)``; see :class:`tilegym_rms.dispatch.QKNormBackend`."""
    if is_batch_invariant():
        return _invariant_backward(q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset, casting_mode)
    del casting_mode  # the backward formula is the same for every casting mode
    dev = q.get_device()
    has_wq, has_wk = q_weight is not None, k_weight is not None
    one_reduction = has_wq and has_wk and q_weight.dtype == k_weight.dtype
    bl = cached_backward(dev, *_shapes(q, k), q.shape[3], q.dtype, has_wq, has_wk, one_reduction)
    return start_backward(bl, q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset, dev, common.launcher())
