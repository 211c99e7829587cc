"""Gated RMSNorm's launches (gated_rms_norm): tiles of rows by whole groups, grid axis 1 over chunks of groups."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..._tiling import cdiv, next_pow2, prev_pow2
from .heuristics import Heuristics, Hints, current, m_bucket, make_hints
from .rows import split_row


@dataclass(frozen=True)
class GatedLaunch:
    """One gated kernel's tiles, grid and hints."""

    tile_m: int
    tile_g: int  # groups per tile (a power of two; the last chunk may be padded)
    grid: tuple[int, int]  # (persistent over row tiles, chunks of tile_g groups)
    hints: Hints = ()
    walk: bool = True  # False: one row tile per block, without the loop (grid[0] is every row tile)
    tail_s: int = 0  # the forward only: a group as its first tile_s // 2 columns and a tail of the next tail_s


@dataclass(frozen=True)
class GatedConfig:
    tile_s: int  # next_pow2(group size)
    fwd: GatedLaunch
    bwd: GatedLaunch  # its grid[0] is also the rows of the (grid, N) dw partial buffer

    def group_tiles(self, launch: GatedLaunch) -> tuple[int, int]:
        """``(TILE_S, TAIL_S)`` of ``launch``: the padded group, or with a tail the group's first ``tile_s // 2``
        columns (``prev_pow2(S)``) and the tail's width."""
        return (self.tile_s // 2, launch.tail_s) if launch.tail_s else (self.tile_s, 0)


def gated_config(
    m: int,
    n: int,
    group_size: int,
    dtype: torch.dtype,
    num_sms: int,
    invariant: bool = False,
    gate_dtype: torch.dtype | None = None,
    norm_before_gate: bool = True,
    params: Heuristics | None = None,
) -> GatedConfig | None:
    """Tiles, grids and hints of the gated kernels for ``m`` rows of ``n`` columns of ``dtype`` in groups of
    ``group_size``, gated by a ``gate_dtype`` tensor (None: ``dtype``) before or after the norm
    (``norm_before_gate``: it picks the backward's settings of narrow rows), tiles from M's bucket, grids from M; or
    None for a group wider than ``gated_max_tile_s`` (the host then runs the torch math). In the batch-invariant
    mode a tile is one row and the forward gives each row tile a block of its own, whatever M. ``params``: the
    settings (default :func:`.heuristics.current`)."""
    p = params or current()
    gate_bytes = (gate_dtype or dtype).itemsize
    tile_s = next_pow2(group_size)
    if tile_s > p.gated_max_tile_s:
        return None
    groups = n // group_size
    tile_g = min(next_pow2(groups), max(1, p.gated_max_group_row // tile_s))
    chunks, row = cdiv(groups, tile_g), tile_g * tile_s  # row: a tile row's padded columns

    def launch(tile_elems, blocks_per_sm, hints, one_tile_per_block=False, walk=True):
        by_rows = prev_pow2(max(m_bucket(m) * chunks // max(num_sms, 1), 1))  # a tile for every SM first
        by_size = prev_pow2(max(tile_elems // row, 1))
        tile_m = 1 if invariant else max(1, min(p.gated_max_tile_m, by_size, by_rows))
        # Blocks over both axes: about blocks_per_sm per SM, at most one per row tile.
        grid = cdiv(m, tile_m)
        if walk and not one_tile_per_block:
            grid = min(max(num_sms * blocks_per_sm // chunks, 1), grid)
        return GatedLaunch(tile_m, tile_g, (max(1, grid), chunks), hints, walk)

    hints = make_hints(occupancy=p.gated_occupancy, num_worker_warps=p.gated_worker_warps)
    fwd_elems = p.gated_fwd_tile_elems if row <= p.gated_fwd_small_max_row else p.gated_fwd_wide_tile_elems
    one_row = row >= p.gated_bwd_one_row_min and (tile_g == 1 or gate_bytes == 4)
    bwd_elems = row if one_row else p.gated_bwd_tile_elems
    bwd_blocks, bwd_hints = p.gated_bwd_blocks_per_sm, hints
    # The batch-invariant mode keeps eight warps: with the compiler's choice a row reached in a later iteration of
    # the row loop came out an ulp apart (PERFORMANCE.md, "Batch invariance").
    grouped_16bit = tile_g > 1 and gate_bytes == 2 and not invariant
    if grouped_16bit:  # never one row: that takes a single group or fp32
        warps = p.gated_bwd_grouped_worker_warps
        if (
            norm_before_gate
            and row == p.gated_bwd_grouped_before_row
            and tile_s >= p.gated_bwd_grouped_before_min_group
        ):
            warps = p.gated_bwd_grouped_before_worker_warps
        bwd_hints = make_hints(occupancy=p.gated_occupancy, num_worker_warps=warps)
    narrow_groups = grouped_16bit and tile_s < p.gated_bwd_grouped_wide_min_group
    if row >= p.gated_bwd_wide_min_row and not narrow_groups:  # the plain wide backward's settings
        bwd_hints = make_hints(occupancy=p.bwd_wide_occupancy, num_worker_warps=p.bwd_wide_worker_warps)
        bwd_blocks = p.bwd_wide_blocks_per_sm
    fwd_hints, fwd_walk = hints, True
    if row <= p.gated_narrow_max_row and not invariant:  # a head per tile row: gated_narrow_*
        side = "before" if norm_before_gate else "after"
        bwd_elems, bwd_blocks, bwd_warps = (
            getattr(p, f"gated_narrow_bwd_{side}_{k}") for k in ("tile_elems", "blocks_per_sm", "worker_warps")
        )
        bwd_hints = make_hints(occupancy=p.gated_narrow_occupancy, num_worker_warps=bwd_warps)
        if not p.gated_narrow_fwd_walk:
            fwd_elems, fwd_walk = p.gated_narrow_fwd_tile_elems, False
            fwd_hints = make_hints(occupancy=p.gated_narrow_occupancy, num_worker_warps=p.gated_worker_warps)
    fwd = launch(fwd_elems, p.gated_fwd_blocks_per_sm, fwd_hints, invariant, fwd_walk)
    tail = split_row(group_size)[1]
    if p.gated_fwd_tail_min_group and group_size >= p.gated_fwd_tail_min_group and tail:
        fwd = replace(fwd, tail_s=tail)
    return GatedConfig(tile_s, fwd, launch(bwd_elems, bwd_blocks, bwd_hints))
