"""QK-norm's launches (qk_rms_norm): one persistent launch over the row tiles of q, then of k."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..._tiling import cdiv, next_pow2, prev_pow2
from .heuristics import Heuristics, Hints, current, m_bucket, make_hints

# A qk tensor reaches the kernels as an ``(A, G, H, D)`` view (ops/qk.py): runs of memory of one tensor pair,
# e.g. tokens (G) and heads (H) of a fused qkv slice. A tile is (1, TILE_G, TILE_H, TILE_N): TILE_G x TILE_H rows.
QKTiles = tuple[tuple[int, int], tuple[int, int]]  # ((TILE_G, TILE_H) of q, of k)


@dataclass(frozen=True)
class QKConfig:
    fwd_head: tuple[int, int]  # (TILE_N, TAIL_N) of a head, forward (qk_head_tiles)
    bwd_head: tuple[int, int]
    fwd_tile_m: int  # rows per tile (TILE_G x TILE_H), forward
    bwd_tile_m: int
    fwd_grid: int
    bwd_grid: int  # also the rows of the (grid, 2, D) dw partial buffer
    fwd_hints: Hints = ()
    bwd_hints: Hints = ()
    fwd_tiles: QKTiles = ((1, 1), (1, 1))  # the rows of a tile split along G and H, forward
    bwd_tiles: QKTiles = ((1, 1), (1, 1))
    fwd_walk: bool = True  # False: one forward tile per block (fwd_blocks_per_sm 0), the grid every tile


def qk_head_tiles(d: int, min_tail_n: int) -> tuple[int, int]:
    """``(TILE_N, TAIL_N)`` of a head of ``d`` columns: ``(next_pow2(d), 0)``, or where ``d`` is a power of two
    plus a smaller one of at least ``min_tail_n`` columns (0: never), those two (80: 64 + 16)."""
    tile_n = prev_pow2(d)
    tail_n = d - tile_n
    if min_tail_n and tail_n >= min_tail_n and tail_n == next_pow2(tail_n):
        return tile_n, tail_n
    return next_pow2(d), 0


def qk_tile_split(rows: int, g: int, h: int, params: Heuristics | None = None) -> tuple[int, int]:
    """``(TILE_G, TILE_H)`` with ``TILE_G * TILE_H == rows`` for a ``(G, H)`` grid of rows: the splits whose
    padded grid is within 1/16 of the least padding (no half-empty tile for 40 heads: 8 x 5, not 64), then the
    one whose TILE_H is nearest ``qk_tile_h``, larger on a tie. Where G is 1 (all rows one run: the dense
    layouts) the tile is ``rows`` rows of that run, the plain row tile."""
    p = params or current()
    if g == 1:
        return 1, rows
    splits = []
    th = 1
    while th <= rows:
        tg = rows // th
        splits.append((cdiv(g, tg) * tg * cdiv(h, th) * th, tg, th))
        th *= 2
    least = min(padded for padded, _, _ in splits)
    near = [(tg, th) for padded, tg, th in splits if 16 * padded <= 17 * least]
    pref = p.qk_tile_h.bit_length()
    return min(near, key=lambda s: (abs(s[1].bit_length() - pref), -s[1]))


def _qk_tile_m(rows: int, tile_n: int, target_elems: int, num_sms: int, p: Heuristics) -> int:
    """Rows per tile: ``target_elems`` worth, but small enough that few rows still give a tile to every SM
    (a power of two of M's bucket, so one compiled variant per bucket below the target)."""
    by_size = prev_pow2(max(target_elems // tile_n, 1))
    by_rows = prev_pow2(max(rows // max(num_sms, 1), 1))
    return max(p.qk_min_tile_m, min(p.qk_max_tile_m, by_size, by_rows))


@dataclass(frozen=True)
class QKCandidate:
    """The tunable choices of the qk kernels (see :class:`ForwardCandidate`): rows per tile, blocks per SM
    and the occupancy hint (0: the compiler's choice), forward and backward. The tile is always one head
    wide (TILE_N = next_pow2(D)). ``fwd_blocks_per_sm`` 0: one forward tile per block, without the walk."""

    fwd_tile_m: int
    bwd_tile_m: int
    fwd_blocks_per_sm: int
    bwd_blocks_per_sm: int
    fwd_occupancy: int
    bwd_occupancy: int


def qk_candidate(rows: int, d: int, dtype: torch.dtype, num_sms: int, params: Heuristics | None = None) -> QKCandidate:
    """The analytic heuristics' qk choice for ``rows`` rows of q and k together (their power-of-two
    bucket) of head dim ``d``."""
    p = params or current()
    del dtype  # tiles are counted in elements: the 16-bit and fp32 settings have not been told apart yet
    tile_n, bucket = next_pow2(d), m_bucket(rows)
    return QKCandidate(
        _qk_tile_m(bucket, tile_n, p.qk_fwd_tile_elems, num_sms, p),
        _qk_tile_m(bucket, tile_n, p.qk_bwd_tile_elems, num_sms, p),
        p.qk_fwd_blocks_per_sm,
        p.qk_bwd_blocks_per_sm,
        p.qk_fwd_occupancy,
        p.qk_bwd_occupancy,
    )


def qk_config(
    q_shape: tuple[int, int, int],
    k_shape: tuple[int, int, int],
    d: int,
    dtype: torch.dtype,
    num_sms: int,
    entry: QKCandidate | None = None,
) -> QKConfig:
    """Tiles, grids and hints of the qk kernels for q and k viewed ``(A, G, H, D)``, ``q_shape`` and ``k_shape``
    their ``(A, G, H)``: the tuning table's ``entry`` for the bucket (:meth:`.tuning.Table.lookup` of "qk" at the
    rows of q and k together, head dim ``d``), else the analytic heuristics (tile rows from the rows' power-of-two
    bucket), each tile's rows split along G and H per tensor (:func:`qk_tile_split`). The grid follows the real
    tile counts."""
    p = current()
    if next_pow2(d) > p.qk_max_tile_n:
        raise ValueError(f"qk_rms_norm's cuTile kernels take head dims of at most {p.qk_max_tile_n}, got {d}")
    c = entry or qk_candidate(math.prod(q_shape) + math.prod(k_shape), d, dtype, num_sms)

    def tiles(tile_m):
        return tuple(qk_tile_split(tile_m, shape[1], shape[2]) for shape in (q_shape, k_shape))

    def grid(split, blocks_per_sm):  # never more blocks than tiles; blocks_per_sm 0: one block per tile
        count = sum(
            a * cdiv(g, tg) * cdiv(h, th) for (a, g, h), (tg, th) in zip((q_shape, k_shape), split, strict=True)
        )
        return max(1, count if blocks_per_sm == 0 else min(num_sms * blocks_per_sm, count))

    fwd_tiles, bwd_tiles = tiles(c.fwd_tile_m), tiles(c.bwd_tile_m)
    fwd_walk = c.fwd_blocks_per_sm > 0
    return QKConfig(
        qk_head_tiles(d, p.qk_fwd_min_tail_n),
        qk_head_tiles(d, p.qk_bwd_min_tail_n),
        c.fwd_tile_m,
        c.bwd_tile_m,
        grid(fwd_tiles, c.fwd_blocks_per_sm),
        grid(bwd_tiles, c.bwd_blocks_per_sm),
        make_hints(occupancy=c.fwd_occupancy, num_worker_warps=0 if fwd_walk else p.qk_fwd_tiles_worker_warps),
        make_hints(occupancy=c.bwd_occupancy),
        fwd_tiles,
        bwd_tiles,
        fwd_walk,
    )
