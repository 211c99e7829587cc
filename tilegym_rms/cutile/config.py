"""Launch heuristics for the cuTile kernels: which kernel, which tile shape, which grid.

Kept apart from the kernels so that tuning never touches kernel code. Every choice is a pure
function of ``(M, N, dtype, num_sms)``; the host caches the result per (device, N, dtype, mode,
M bucket). Tile shapes are powers of two; ``TILE_N`` never depends on M, so a new M compiles
nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._tiling import cdiv, next_pow2, prev_pow2

FORWARD_MODES = ("gather", "persistent")

# Widest row kept in registers as one tile; wider rows take the column-chunked kernels. Measured on
# H100 (bench/NOTES.md): the forward still streams at 95% of copy bandwidth with one 16384-wide bf16
# row per tile, while the backward (two tiles live: x and dy) already drops at 16384.
FWD_MAX_SINGLE_TILE_N = 16384
BWD_MAX_SINGLE_TILE_N = 8192
# Column chunk of the chunked kernels, and rows per tile in the chunked backward (4 x 4096 keeps
# enough bytes in flight per block; 1 x 4096 reached only 28% of copy bandwidth in bf16).
FWD_CHUNK_N = 8192
BWD_CHUNK_N = 4096
BWD_CHUNK_TILE_M = 4
# Elements per tile that the forward / backward aim for (enough bytes in flight per block).
FWD_TILE_ELEMS = 16384
BWD_TILE_ELEMS = 8192
MAX_TILE_M = 16
# Persistent grids: blocks launched per SM (at most one per row tile) and the compiler's ``occupancy``
# hint, the blocks per SM it sizes its registers for (0: its own choice), for narrow tiles
# (TILE_N <= NARROW_TILE_N) and wide ones. From the bf16 sweep on H100 (bench/NOTES.md, experiment 6):
# left to itself the compiler built narrow tiles for too few blocks (forward 4096 x 1024 at 14-69% of
# copy bandwidth, backward 4096 x 2048 at 41%; with occupancy 2: 84% and 77%), while wide tiles (a
# whole 8192-wide row of x and dy live in the backward) lose 10-30% when forced to 2 blocks per SM.
NARROW_TILE_N = 4096
FWD_NARROW_BLOCKS_PER_SM = 2
FWD_NARROW_OCCUPANCY = 2
FWD_WIDE_BLOCKS_PER_SM = 2
FWD_WIDE_OCCUPANCY = 0
BWD_NARROW_BLOCKS_PER_SM = 2
BWD_NARROW_OCCUPANCY = 2
BWD_WIDE_BLOCKS_PER_SM = 1
BWD_WIDE_OCCUPANCY = 1
# The forward uses the gather kernel (one row per block) while M is at most this many waves of SMs:
# with so few rows, a block per row spreads them widest.
GATHER_MAX_ROWS_PER_SM = 2
# Final dw reduction: each block owns a strip of columns and sums all partial rows. The strip is
# narrow enough that there are at least as many blocks as SMs: with 256-column strips a 2048-wide dw
# had 8 blocks walking 264 partial rows one after another. 32 fp32 columns are one 128-byte line per
# row, already a full memory transaction; wider strips would only cut the number of blocks. Each step
# loads about REDUCE_TILE_ELEMS fp32 values.
REDUCE_MIN_TILE_N = 16
REDUCE_MAX_TILE_N = 32
REDUCE_TILE_ELEMS = 4096


def m_bucket(m: int) -> int:
    """M rounded up to a power of two: configurations are cached per bucket, not per M."""
    return next_pow2(max(m, 1))


@dataclass(frozen=True)
class ForwardConfig:
    mode: str  # "gather" or "persistent"
    tile_m: int
    tile_n: int
    single_tile: bool  # gather only: the row fits one tile
    grid: int
    occupancy: int | None = None  # compiler hint: blocks per SM the kernel is built for


@dataclass(frozen=True)
class BackwardConfig:
    mode: str  # "fused" (rows fit one tile) or "chunked" (two kernels over column chunks)
    tile_m: int
    tile_n: int
    grid: int  # row workers: rows of the dw partial buffer
    num_chunks: int  # column chunks (1 when fused); the chunked grid is (grid, num_chunks)
    occupancy: int | None = None  # compiler hint: blocks per SM the kernels are built for


def _blocks_and_occupancy(tile_n: int, prefix: str) -> tuple[int, int | None]:
    """Blocks per SM and occupancy hint (None: the compiler's choice) of the ``FWD``/``BWD`` grids."""
    width = "NARROW" if tile_n <= NARROW_TILE_N else "WIDE"
    table = globals()  # read at call time, so that bench/tune_cutile.py can sweep the constants
    return table[f"{prefix}_{width}_BLOCKS_PER_SM"], table[f"{prefix}_{width}_OCCUPANCY"] or None


def _tile_m(tile_n: int, target_elems: int) -> int:
    # Independent of M on purpose: every M then shares one compiled variant per (N, dtype).
    return max(1, min(MAX_TILE_M, target_elems // tile_n))


def forward_config(m: int, n: int, dtype: torch.dtype, num_sms: int, mode: str | None = None) -> ForwardConfig:
    """Chooses the forward kernel and its tiles. ``mode`` forces a kernel ("gather" / "persistent")."""
    del dtype  # one table for all dtypes for now; the key keeps room for per-dtype tuning
    fits = next_pow2(n) <= FWD_MAX_SINGLE_TILE_N
    if mode is None:
        mode = "persistent" if fits and m > GATHER_MAX_ROWS_PER_SM * num_sms else "gather"
    if mode not in FORWARD_MODES:
        raise ValueError(f"mode must be one of {FORWARD_MODES} or None, got {mode!r}")
    if mode == "persistent" and not fits:
        raise ValueError(
            f"mode='persistent' needs rows of at most {FWD_MAX_SINGLE_TILE_N} elements (N={n}); use mode='gather'"
        )
    if mode == "gather":
        tile_n = next_pow2(n) if fits else FWD_CHUNK_N
        return ForwardConfig("gather", 1, tile_n, fits, m)
    tile_n = next_pow2(n)
    tile_m = _tile_m(tile_n, FWD_TILE_ELEMS)
    blocks, occupancy = _blocks_and_occupancy(tile_n, "FWD")
    return ForwardConfig("persistent", tile_m, tile_n, True, min(num_sms * blocks, cdiv(m, tile_m)), occupancy)


def backward_config(m: int, n: int, dtype: torch.dtype, num_sms: int) -> BackwardConfig:
    """Chooses the backward kernels, tiles and the number of dw partial rows (``grid``)."""
    del dtype
    if next_pow2(n) <= BWD_MAX_SINGLE_TILE_N:
        tile_n = next_pow2(n)
        tile_m = _tile_m(tile_n, BWD_TILE_ELEMS)
        blocks, occupancy = _blocks_and_occupancy(tile_n, "BWD")
        return BackwardConfig("fused", tile_m, tile_n, min(num_sms * blocks, cdiv(m, tile_m)), 1, occupancy)
    num_chunks = cdiv(n, BWD_CHUNK_N)
    blocks, occupancy = _blocks_and_occupancy(BWD_CHUNK_N, "BWD")
    # Enough row workers that (workers x chunks) fills the GPU, never more than there are row tiles.
    grid = max(1, min(cdiv(num_sms * blocks, num_chunks), cdiv(m, BWD_CHUNK_TILE_M)))
    return BackwardConfig("chunked", BWD_CHUNK_TILE_M, BWD_CHUNK_N, grid, num_chunks, occupancy)


@dataclass(frozen=True)
class ReduceConfig:
    tile_g: int  # partial rows per step
    tile_n: int  # columns per block
    grid: int


def reduce_config(n: int, num_sms: int) -> ReduceConfig:
    """Tiles of the final dw reduction for a hidden size ``n``."""
    tile_n = max(REDUCE_MIN_TILE_N, min(REDUCE_MAX_TILE_N, prev_pow2(n // max(num_sms, 1))))
    return ReduceConfig(REDUCE_TILE_ELEMS // tile_n, tile_n, cdiv(n, tile_n))
