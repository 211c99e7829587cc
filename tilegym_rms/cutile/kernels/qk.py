"""QK-norm: q and k normalized in one launch, forward and backward.

Each tensor arrives as a 4-D view ``(A, G, H, D)`` with a dense last dim and any strides in its first three
dims: the runs of memory its layout has (one run for a dense tensor, ``(1, 1, M, D)``; tokens and heads for a
slice of a fused qkv output; batch, tokens and heads for a gradient handed back from a ``(B, H, S, D)``
consumer). The tensors of one side (q, its output, its gradients) share one shape, each with its own strides.
A tile is ``(1, TILE_G, TILE_H, TILE_N)``, TILE_G x TILE_H rows: a run of heads of a run of tokens, which
reads pieces of TILE_H rows where H is the contiguous dim and of TILE_G rows where G is. Tile ``t`` is
``(a, g, h)`` with h fastest, so consecutive tiles read neighbouring heads of the same tokens. The blocks of
one persistent grid stride over the tiles of q, then carry on, in the same global order, over those of k;
q and k have tiles of their own (their head counts differ). ``rstd`` is an ``(A, G, H)`` array.
"""

from __future__ import annotations

import cuda.tile as ct

from ...experimental import experimental_kernel
from .backward import _dw_rows, _dx, _row_dot
from .common import (
    _F32,
    _ZERO,
    CAST_GEMMA,
    _effective_weight,
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


def _load_head_rows(x, a, g, h, TILE_G, TILE_H, TILE_N):
    """One tile of an ``(A, G, H, D)`` view as a ``(TILE_G * TILE_H, TILE_N)`` fp32 tile, rows in (g, h) order."""
    xf = _load_f32(x, (a, g, h, 0), (1, TILE_G, TILE_H, TILE_N), 10)
    return ct.reshape(xf, (TILE_G * TILE_H, TILE_N))


def _store_head_rows(y, a, g, h, tile, TILE_G, TILE_H, TILE_N):
    ct.store(y, (a, g, h, 0), ct.reshape(tile, (1, TILE_G, TILE_H, TILE_N)), allow_tma=False, latency=3)


def _qk_fwd_tile(x, wt, y, rstd, t, eps, TILE_G, TILE_H, TILE_N, CAST, EXACT_D):
    a, g, h = _qk_tile_index(x, t, TILE_G, TILE_H)
    xf = _load_head_rows(x, a, g, h, TILE_G, TILE_H, TILE_N)
    r = _rstd_of_rows(_sum_sq(xf), x.shape[3], eps, CAST, x.dtype, EXACT_D, TILE_N)
    _store_head_rows(y, a, g, h, _normalize(xf, r, wt, CAST, y.dtype), TILE_G, TILE_H, TILE_N)
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
    CAST: ct.Constant[int],
    HAS_WQ: ct.Constant[bool],
    HAS_WK: ct.Constant[bool],
    EXACT_D: ct.Constant[bool],
    WALK: ct.Constant[bool],
):
    """Both weights are loaded once per block; then the block normalizes its q tiles and its k tiles
    (``TILE_N >= D``; ``EXACT_D``: ``TILE_N == D``), storing rstd of every row. ``WALK``: the persistent walk;
    otherwise one tile per block, without the loops (a grid of q's tiles, then k's: no ring of load stages, as
    the plain forward's ``"tiles"``)."""
    wtq = _effective_weight(wq, 0, offset, TILE_N, HAS_WQ, CAST, q.dtype)
    wtk = _effective_weight(wk, 0, offset, TILE_N, HAS_WK, CAST, k.dtype)
    num_q_tiles = _qk_num_tiles(q, TILE_GQ, TILE_HQ)
    if WALK:
        for t in range(ct.bid(0), num_q_tiles, ct.num_blocks(0)):
            _qk_fwd_tile(q, wtq, yq, rstd_q, t, eps, TILE_GQ, TILE_HQ, TILE_N, CAST, EXACT_D)
        for t in range(_first_k_tile(num_q_tiles), _qk_num_tiles(k, TILE_GK, TILE_HK), ct.num_blocks(0)):
            _qk_fwd_tile(k, wtk, yk, rstd_k, t, eps, TILE_GK, TILE_HK, TILE_N, CAST, EXACT_D)
    elif ct.bid(0) < num_q_tiles:
        _qk_fwd_tile(q, wtq, yq, rstd_q, ct.bid(0), eps, TILE_GQ, TILE_HQ, TILE_N, CAST, EXACT_D)
    else:
        _qk_fwd_tile(k, wtk, yk, rstd_k, ct.bid(0) - num_q_tiles, eps, TILE_GK, TILE_HK, TILE_N, CAST, EXACT_D)


def _qk_bwd_tile(dy, x, wt, rstd, dx, dw_acc, t, inv_d, TILE_G, TILE_H, TILE_N, HAS_W):
    """dx of one tile; returns ``dw_acc`` plus the tile's dw share (unchanged without a weight)."""
    a, g, h = _qk_tile_index(x, t, TILE_G, TILE_H)
    rows = TILE_G * TILE_H
    r = ct.reshape(ct.load(rstd, (a, g, h), (1, TILE_G, TILE_H), padding_mode=_ZERO), (rows, 1))
    xhat = _load_head_rows(x, a, g, h, TILE_G, TILE_H, TILE_N) * r
    dyf = _load_head_rows(dy, a, g, h, TILE_G, TILE_H, TILE_N)
    gw = dyf * wt
    c = _row_dot(xhat, gw) * inv_d
    # No residual gradient to add: dx stands in for dres, which HAS_DRES=False never reads.
    dx_tile = _dx(gw, xhat, c, r, dx, (0, 0), (rows, TILE_N), False, dx.dtype)
    _store_head_rows(dx, a, g, h, dx_tile, TILE_G, TILE_H, TILE_N)
    if HAS_W:
        return dw_acc + _dw_rows(dyf, xhat)
    return dw_acc


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
    HAS_WQ: ct.Constant[bool],
    HAS_WK: ct.Constant[bool],
):
    """dq and dk over the same tile walk as the forward; each block keeps its dw shares of both weights
    in fp32 registers and writes them to ``dw_partial[bid, 0]`` (q) and ``dw_partial[bid, 1]`` (k), a
    ``(grid, 2, D)`` buffer that ``rms_norm_dw_reduce`` sums in a fixed order (deterministic)."""
    wtq = _effective_weight(wq, 0, offset, TILE_N, HAS_WQ, CAST_GEMMA, q.dtype)
    wtk = _effective_weight(wk, 0, offset, TILE_N, HAS_WK, CAST_GEMMA, k.dtype)
    acc_q = ct.zeros((1, TILE_N), dtype=_F32)
    acc_k = ct.zeros((1, TILE_N), dtype=_F32)
    inv_d = 1.0 / q.shape[3]  # once per block (rms_norm_bwd_persistent): a tile's rows would each divide
    num_q_tiles = _qk_num_tiles(q, TILE_GQ, TILE_HQ)
    for t in range(ct.bid(0), num_q_tiles, ct.num_blocks(0)):
        acc_q = _qk_bwd_tile(dyq, q, wtq, rstd_q, dq, acc_q, t, inv_d, TILE_GQ, TILE_HQ, TILE_N, HAS_WQ)
    for t in range(_first_k_tile(num_q_tiles), _qk_num_tiles(k, TILE_GK, TILE_HK), ct.num_blocks(0)):
        acc_k = _qk_bwd_tile(dyk, k, wtk, rstd_k, dk, acc_k, t, inv_d, TILE_GK, TILE_HK, TILE_N, HAS_WK)
    if HAS_WQ:
        ct.store(dw_partial, (ct.bid(0), 0, 0), ct.reshape(acc_q, (1, 1, TILE_N)), allow_tma=False)
    if HAS_WK:
        ct.store(dw_partial, (ct.bid(0), 1, 0), ct.reshape(acc_k, (1, 1, TILE_N)), allow_tma=False)
