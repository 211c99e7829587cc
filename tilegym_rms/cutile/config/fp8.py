"""FP8 output's launches (rms_norm_fp8): one launch of rms_norm_fp8_fwd, row tiles of whole rows (a tile, or a tile
and a tail) in a grid-stride walk."""

from __future__ import annotations

from dataclasses import dataclass

from ..._tiling import cdiv, next_pow2
from .heuristics import Heuristics, Hints, current, m_bucket, make_hints
from .rows import gather_hints, persistent_class, split_row, tile_rows

# Widest row the fused FP8 kernel holds in registers (the plain norm's widest persistent tile, whose register
# budget the one-pass kernel shares); wider rows run the norm, then torch's quantization (ops/fp8.py).
FP8_MAX_TILE_N = 16384


@dataclass(frozen=True)
class FP8Config:
    tile_m: int
    tile_n: int  # a row is one tile (>= N and >= the group size), or with tail_n a tile and a tail
    tail_n: int  # 0, or tile_n + tail_n >= N > tile_n: the next tail_n columns of a row (config.split_row)
    grid: int  # blocks; each walks row tiles bid, bid + grid, ... (exactly one where grid = row tiles)
    hints: Hints = ()
    words: bool = False  # y_q stored as int64 words of 8 values (where a row is whole words)


def fp8_config(
    m: int,
    n: int,
    group_size: int | None,
    num_sms: int,
    invariant: bool = False,
    params: Heuristics | None = None,
    add: bool = False,
) -> FP8Config:
    """Tiles of the FP8 kernel for an ``(m, n)`` input (``add``: the fused add): one row per block for few rows
    (``gather_max_rows_per_sm``, the decode sizes) and for the fused add from ``fp8_min_row`` padded columns
    (``fp8_add_gather``), with the gather kernel's hints; else row tiles walked by a persistent grid (one tile per
    block left the loads' latency unhidden), with the ``fp8_*`` settings from ``fp8_min_row`` padded columns on
    and the persistent forward's below (PERFORMANCE.md, "FP8 output"). In the batch-invariant mode one row per
    block at every M: a row's place in a tile of several could change how the compiler reduces it
    (PERFORMANCE.md, "Batch invariance"). The settings choose by the padded row (``next_pow2(N)``) either way; with
    ``fp8_tail`` a tile of one row splits into a tile and a tail where that holds fewer columns and no group
    straddles them (tiles of several rows keep the padded tile: with a tail they lost, PERFORMANCE.md, "FP8
    output"); in the per-group mode, from ``fp8_group_tail_one_row_min`` padded columns (0: never), such rows take a
    tile each; ``words``: ``fp8_group_word_stores`` or ``fp8_row_word_stores`` by the mode."""
    p = params or current()
    tile_n = max(next_pow2(n), group_size or 1)
    if tile_n > FP8_MAX_TILE_N:
        raise ValueError(f"the FP8 kernel takes rows of at most {FP8_MAX_TILE_N} elements, got N={n}")
    words = p.fp8_group_word_stores if group_size else p.fp8_row_word_stores

    def row_split(tile_m: int) -> tuple[int, int]:  # (TILE_N, TAIL_N)
        head, tail = split_row(n) if p.fp8_tail and tile_m == 1 else (tile_n, 0)
        return (head, tail) if tail >= (group_size or 1) else (tile_n, 0)  # a tail no group straddles

    gather_add = add and p.fp8_add_gather and tile_n >= p.fp8_min_row
    if invariant or gather_add or m_bucket(m) <= p.gather_max_rows_per_sm * num_sms:
        occupancy, warps = gather_hints(tile_n, True, p)
        return FP8Config(1, *row_split(1), m, make_hints(occupancy=occupancy, num_worker_warps=warps), words)
    if tile_n >= p.fp8_min_row:
        warps = p.fp8_worker_warps if tile_n >= p.fp8_worker_warps_min_row else 0
        blocks_per_sm, occupancy = p.fp8_blocks_per_sm, p.fp8_occupancy
        tile_m = tile_rows(tile_n, p.fp8_tile_elems, p)
        one_row_min = p.fp8_group_tail_one_row_min if group_size else 0
        if one_row_min and tile_n >= one_row_min and row_split(1)[1]:
            tile_m = 1  # a row a tile, held as a tile and a tail
    else:
        blocks_per_sm, occupancy, warps = persistent_class(tile_n, "fwd", p)
        tile_m = tile_rows(tile_n, p.fwd_tile_elems, p)
    grid = min(cdiv(m, tile_m), blocks_per_sm * num_sms)
    return FP8Config(tile_m, *row_split(tile_m), grid, make_hints(occupancy=occupancy, num_worker_warps=warps), words)
