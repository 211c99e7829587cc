"""QK-norm: q and k normalized in one launch, forward and backward.

Each tensor arrives as a 4-D view ``(A, G, H, D)`` with a dense last dim and any strides in its first three
dims: the runs of memory its layout has (one run for a dense tensor, ``(1, 1, M, D)``; tokens and heads for a
slice of a fused qkv output; batch, tokens and heads for a gradient handed back from a ``(B, H, S, D)``
consumer). The tensors of one side (q, its output, its gradients) share one shape, each with its own strides.
A tile is ``(1, TILE_G, TILE_H, TILE_N)``, TILE_G x TILE_H rows: a run of heads of a run of tokens, which
reads pieces of TILE_H rows where H is the contiguous dim and of TILE_G rows where G is. Tile ``t`` is
``(a, g, h)`` with h fastest, so consecutive tiles read neighbouring heads of the same tokens. The blocks of
one persistent grid stride over the tiles of q, then carry on, in the same global order, over those of k;
q and k have tiles of their own (their head counts differ). ``rstd`` is an ``(A, G, H)`` array. A head is one
tile of ``TILE_N >= D`` columns, or with ``TAIL_N > 0`` a tile of ``TILE_N`` columns and a tail tile of the next
``TAIL_N`` (D = 80 as 64 + 16: no arithmetic on the padding to 128), as the plain kernels hold their rows.
"""

from __future__ import annotations

import cuda.tile as ct

from ...experimental import experimental_kernel
from .backward import _dw_rows, _dx, _row_dot
from .common import (
    _F32,
    _ZERO,
    CAST_GEMMA,
    _effective_weights,
    _load_f32,
    _normalize,
    _rstd_of_rows,
    _sum_sq,
)


def _qk_num_tiles(x, TILE_G, TILE_H):
    return x.shape[0] * ct.cdiv(x.shape[1], TILE_G) * ct.cdiv(x.shape[2], TILE_H)


def _qk_tile_index(x, t, TILE_G, TILE_H):
    """``(a, g, h)`` of tile ``t`` of an ``(A, G, H, D)`` view, h fastest."""
    tiles_h = ct.cdiv(x.shape[2], TILE_H)
    tiles_gh = ct.cdiv(x.shape[1], TILE_G) * tiles_h
    rest = t % tiles_gh
    return t // tiles_gh, rest // tiles_h, rest % tiles_h


def _first_k_tile(num_q_tiles):
    """The first k tile of this block: tile ``t`` of k is global tile ``num_q_tiles + t`` of the grid stride."""
    nb = ct.num_blocks(0)
    return (ct.bid(0) + nb - num_q_tiles % nb) % nb


def _load_head_rows(x, a, g, h, col, TILE_G, TILE_H, TILE_N):
    """Column tile ``col`` of one row tile of an ``(A, G, H, D)`` view as a ``(TILE_G * TILE_H, TILE_N)`` fp32 tile,
    rows in (g, h) order."""
    xf = _load_f32(x, (a, g, h, col), (1, TILE_G, TILE_H, TILE_N), 10)
    return ct.reshape(xf, (TILE_G * TILE_H, TILE_N))


def _store_head_rows(y, a, g, h, col, tile, TILE_G, TILE_H, TILE_N):
    ct.store(y, (a, g, h, col), ct.reshape(tile, (1, TILE_G, TILE_H, TILE_N)), allow_tma=False, latency=3)


def _qk_fwd_tile(x, wt, wt_tail, y, rstd, t, eps, TILE_G, TILE_H, TILE_N, TAIL_N, CAST, EXACT_D):
    a, g, h = _qk_tile_index(x, t, TILE_G, TILE_H)
    xf = _load_head_rows(x, a, g, h, 0, TILE_G, TILE_H, TILE_N)
    sum_sq = _sum_sq(xf)
    if TAIL_N:
        tail = TILE_N // TAIL_N  # the tail tile's column index
        xf_tail = _load_head_rows(x, a, g, h, tail, TILE_G, TILE_H, TAIL_N)
        sum_sq = sum_sq + _sum_sq(xf_tail)
    r = _rstd_of_rows(sum_sq, x.shape[3], eps, CAST, x.dtype, EXACT_D, TILE_N)
    _store_head_rows(y, a, g, h, 0, _normalize(xf, r, wt, CAST, y.dtype), TILE_G, TILE_H, TILE_N)
    if TAIL_N:
        _store_head_rows(y, a, g, h, tail, _normalize(xf_tail, r, wt_tail, CAST, y.dtype), TILE_G, TILE_H, TAIL_N)
    ct.store(rstd, (a, g, h), ct.reshape(r, (1, TILE_G, TILE_H)), allow_tma=False)


@experimental_kernel
@ct.kernel
def qk_rms_norm_fwd(
    q,
    k,
    wq,
    wk,
    yq,
    yk,
    rstd_q,
    rstd_k,
    eps,
    offset,
    TILE_GQ: ct.Constant[int],
    TILE_HQ: ct.Constant[int],
    TILE_GK: ct.Constant[int],
    TILE_HK: ct.Constant[int],
    TILE_N: ct.Constant[int],
    TAIL_N: ct.Constant[int],
    CAST: ct.Constant[int],
    HAS_WQ: ct.Constant[bool],
    HAS_WK: ct.Constant[bool],
    EXACT_D: ct.Constant[bool],
    WALK: ct.Constant[bool],
):
    """Both weights are loaded once per block; then the block normalizes its q tiles and its k tiles
    (``TILE_N >= D``, or ``TILE_N + TAIL_N == D``; ``EXACT_D``: ``TILE_N == D``), storing rstd of every row.
    ``WALK``: the persistent walk; otherwise one tile per block, without the loops (a grid of q's tiles, then k's:
    no ring of load stages, as the plain forward's ``"tiles"``)."""
    wtq, wtq_tail = _effective_weights(wq, offset, TILE_N, TAIL_N, HAS_WQ, CAST, q.dtype)
    wtk, wtk_tail = _effective_weights(wk, offset, TILE_N, TAIL_N, HAS_WK, CAST, k.dtype)
    cq = (TILE_GQ, TILE_HQ, TILE_N, TAIL_N, CAST, EXACT_D)
    ck = (TILE_GK, TILE_HK, TILE_N, TAIL_N, CAST, EXACT_D)
    num_q_tiles = _qk_num_tiles(q, TILE_GQ, TILE_HQ)
    if WALK:
        for t in range(ct.bid(0), num_q_tiles, ct.num_blocks(0)):
            _qk_fwd_tile(q, wtq, wtq_tail, yq, rstd_q, t, eps, *cq)
        for t in range(_first_k_tile(num_q_tiles), _qk_num_tiles(k, TILE_GK, TILE_HK), ct.num_blocks(0)):
            _qk_fwd_tile(k, wtk, wtk_tail, yk, rstd_k, t, eps, *ck)
    elif ct.bid(0) < num_q_tiles:
        _qk_fwd_tile(q, wtq, wtq_tail, yq, rstd_q, ct.bid(0), eps, *cq)
    else:
        _qk_fwd_tile(k, wtk, wtk_tail, yk, rstd_k, ct.bid(0) - num_q_tiles, eps, *ck)


def _qk_bwd_tile(dy, x, wt, wt_tail, rstd, dx, acc, acc_tail, t, inv_d, TILE_G, TILE_H, TILE_N, TAIL_N, HAS_W):
    """dx of one tile; returns ``acc`` and ``acc_tail`` (the head's and the tail's dw) plus the tile's dw share
    (unchanged without a weight)."""
    a, g, h = _qk_tile_index(x, t, TILE_G, TILE_H)
    rows = TILE_G * TILE_H
    r = ct.reshape(ct.load(rstd, (a, g, h), (1, TILE_G, TILE_H), padding_mode=_ZERO), (rows, 1))
    xhat = _load_head_rows(x, a, g, h, 0, TILE_G, TILE_H, TILE_N) * r
    dyf = _load_head_rows(dy, a, g, h, 0, TILE_G, TILE_H, TILE_N)
    gw = dyf * wt
    dot = _row_dot(xhat, gw)
    if TAIL_N:
        tail = TILE_N // TAIL_N  # the tail tile's column index
        xhat_tail = _load_head_rows(x, a, g, h, tail, TILE_G, TILE_H, TAIL_N) * r
        dyf_tail = _load_head_rows(dy, a, g, h, tail, TILE_G, TILE_H, TAIL_N)
        gw_tail = dyf_tail * wt_tail
        dot = dot + _row_dot(xhat_tail, gw_tail)
    c = dot * inv_d
    # No residual gradient to add: dx stands in for dres, which HAS_DRES=False never reads.
    dx_tile = _dx(gw, xhat, c, r, dx, (0, 0), (rows, TILE_N), False, dx.dtype)
    _store_head_rows(dx, a, g, h, 0, dx_tile, TILE_G, TILE_H, TILE_N)
    if TAIL_N:
        dx_tail = _dx(gw_tail, xhat_tail, c, r, dx, (0, 0), (rows, TAIL_N), False, dx.dtype)
        _store_head_rows(dx, a, g, h, tail, dx_tail, TILE_G, TILE_H, TAIL_N)
    if HAS_W:
        acc = acc + _dw_rows(dyf, xhat)
        if TAIL_N:
            acc_tail = acc_tail + _dw_rows(dyf_tail, xhat_tail)
    return acc, acc_tail


def _store_dw(dw_partial, slot, acc, acc_tail, TILE_N, TAIL_N):
    """A block's dw of one weight into ``dw_partial[bid, slot]``: the head's columns, then the tail's."""
    ct.store(dw_partial, (ct.bid(0), slot, 0), ct.reshape(acc, (1, 1, TILE_N)), allow_tma=False)
    if TAIL_N:
        tail = TILE_N // TAIL_N
        ct.store(dw_partial, (ct.bid(0), slot, tail), ct.reshape(acc_tail, (1, 1, TAIL_N)), allow_tma=False)


@experimental_kernel
@ct.kernel
def qk_rms_norm_bwd(
    dyq,
    dyk,
    q,
    k,
    wq,
    wk,
    rstd_q,
    rstd_k,
    dq,
    dk,
    dw_partial,
    offset,
    TILE_GQ: ct.Constant[int],
    TILE_HQ: ct.Constant[int],
    TILE_GK: ct.Constant[int],
    TILE_HK: ct.Constant[int],
    TILE_N: ct.Constant[int],
    TAIL_N: ct.Constant[int],
    HAS_WQ: ct.Constant[bool],
    HAS_WK: ct.Constant[bool],
):
    """dq and dk over the same tile walk as the forward; each block keeps its dw shares of both weights
    in fp32 registers and writes them to ``dw_partial[bid, 0]`` (q) and ``dw_partial[bid, 1]`` (k), a
    ``(grid, 2, D)`` buffer that ``rms_norm_dw_reduce`` sums in a fixed order (deterministic)."""
    wtq, wtq_tail = _effective_weights(wq, offset, TILE_N, TAIL_N, HAS_WQ, CAST_GEMMA, q.dtype)
    wtk, wtk_tail = _effective_weights(wk, offset, TILE_N, TAIL_N, HAS_WK, CAST_GEMMA, k.dtype)
    acc_q = ct.zeros((1, TILE_N), dtype=_F32)
    acc_k = ct.zeros((1, TILE_N), dtype=_F32)
    acc_q_tail, acc_k_tail = acc_q, acc_k  # without a tail: carried along, never stored
    if TAIL_N:
        acc_q_tail = ct.zeros((1, TAIL_N), dtype=_F32)
        acc_k_tail = ct.zeros((1, TAIL_N), dtype=_F32)
    inv_d = 1.0 / q.shape[3]  # once per block (rms_norm_bwd_persistent): a tile's rows would each divide
    cq = (TILE_GQ, TILE_HQ, TILE_N, TAIL_N, HAS_WQ)
    ck = (TILE_GK, TILE_HK, TILE_N, TAIL_N, HAS_WK)
    num_q_tiles = _qk_num_tiles(q, TILE_GQ, TILE_HQ)
    for t in range(ct.bid(0), num_q_tiles, ct.num_blocks(0)):
        acc_q, acc_q_tail = _qk_bwd_tile(dyq, q, wtq, wtq_tail, rstd_q, dq, acc_q, acc_q_tail, t, inv_d, *cq)
    for t in range(_first_k_tile(num_q_tiles), _qk_num_tiles(k, TILE_GK, TILE_HK), ct.num_blocks(0)):
        acc_k, acc_k_tail = _qk_bwd_tile(dyk, k, wtk, wtk_tail, rstd_k, dk, acc_k, acc_k_tail, t, inv_d, *ck)
    if HAS_WQ:
        _store_dw(dw_partial, 0, acc_q, acc_q_tail, TILE_N, TAIL_N)
    if HAS_WK:
        _store_dw(dw_partial, 1, acc_k, acc_k_tail, TILE_N, TAIL_N)
