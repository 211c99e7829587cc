"""Launch heuristics for the cuTile kernels: which kernel, which tile shape, which grid, which
compiler hints.

Kept apart from the kernels so that tuning never touches kernel code. Every choice is a pure
function of ``(M, N, dtype, num_sms)``; tiles and hints come from M's power-of-two bucket (the host
passes the bucket and caches the result per device, M, N, dtype and kernel), so a new M compiles
nothing new. Tile shapes are powers of two. The constants come from sweeps on H100/H200
(``bench/tune_cutile.py``); ``bench/NOTES.md`` has each experiment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._tiling import cdiv, next_pow2, prev_pow2

FORWARD_KERNELS = ("gather", "persistent")

# Widest row kept in registers as one tile; wider rows take the column-chunked kernels. A whole row per
# block streams faster than chunks that read it twice (experiments 10, 17). The persistent forward takes
# tiles up to FWD_MAX_PERSISTENT_TILE_N (wider rows always take the gather kernel, see GATHER_MIN_N).
FWD_MAX_SINGLE_TILE_N = 32768
FWD_MAX_PERSISTENT_TILE_N = 16384
BWD_MAX_SINGLE_TILE_N = 16384
# Column chunk of the chunked kernels and rows per chunked backward tile: enough bytes in flight per
# block, while few rows in flight keep a row's second read in L2 (experiment 17).
FWD_CHUNK_N = 16384
BWD_CHUNK_N = 4096
BWD_CHUNK_TILE_M = 4
# Elements per tile that the forward / backward aim for (enough bytes in flight per block; wide
# backward tiles take two rows per step, narrow ones lose with bigger tiles: experiments 7, 11).
FWD_TILE_ELEMS = 16384
# The persistent forward holds rows as a tile plus a tail tile (see split_row) once the padded tile
# would be this wide: narrower rows lost with the split (experiment 18).
FWD_SPLIT_MIN_TILE_N = 16384
BWD_NARROW_TILE_ELEMS = 8192
BWD_WIDE_TILE_ELEMS = 16384
MAX_TILE_M = 16
# Persistent grids: blocks launched per SM (at most one per row tile) and two compiler hints, for
# narrow rows (at most NARROW_MAX_ROW padded columns) and wide ones: ``occupancy``, the blocks per SM
# the compiler sizes its registers for, and ``num_worker_warps``, the warps of one block (0: the
# compiler's choice). Left to itself the compiler built narrow tiles for too few blocks, while wide
# tiles lose when forced to share an SM (experiment 6).
NARROW_MAX_ROW = 6144  # widest row (padded: tile plus tail tile) of the narrow class
FWD_NARROW_BLOCKS_PER_SM = 2
FWD_NARROW_OCCUPANCY = 2
FWD_NARROW_WORKER_WARPS = 0
FWD_WIDE_BLOCKS_PER_SM = 2
FWD_WIDE_OCCUPANCY = 0
FWD_WIDE_WORKER_WARPS = 0
# Rows of at most 1024 columns: more blocks per SM, still built for occupancy 2 (the extra blocks
# queue and hide the short rows' latency; experiments 15, 18).
FWD_TINY_TILE_N = 1024
FWD_TINY_BLOCKS_PER_SM = 8
BWD_NARROW_BLOCKS_PER_SM = 2
BWD_NARROW_OCCUPANCY = 2
BWD_NARROW_WORKER_WARPS = 0
# Wide backward tiles (up to 16384 columns of x and dy in registers) spill without 8 warps
# (experiment 10).
BWD_WIDE_BLOCKS_PER_SM = 1
BWD_WIDE_OCCUPANCY = 1
BWD_WIDE_WORKER_WARPS = 8
# The forward uses the gather kernel (one row per block) while M is at most this many rows per SM:
# a block per row spreads few rows widest, and the inference forward then skips the rstd allocation
# (experiment 18).
GATHER_MAX_ROWS_PER_SM = 4
# From GATHER_PREFERRED_MIN_M rows on, rows of GATHER_PREFERRED_MIN_N to GATHER_PREFERRED_MAX_N columns
# take the gather kernel (experiments 13, 18); narrower rows and single waves stay persistent, wider
# ones below GATHER_MIN_N (e.g. 12288) keep the split persistent tile.
GATHER_PREFERRED_MIN_N = 2048
GATHER_PREFERRED_MAX_N = 8192
# ...except 16-bit rows that fill less than this share of their padded tile (bf16 5120): with the
# gather kernel their speed varied between processes (experiment 18).
GATHER_PREFERRED_MIN_FILL_16BIT = 0.75
GATHER_PREFERRED_MIN_M = 16384
# From this row width on the gather kernel is used at every M (experiment 18); padded widths below it
# stay persistent, where the split tile wins.
GATHER_MIN_N = 16384
# Compiler hints of the gather kernel, ``(occupancy, num_worker_warps)`` (0: the compiler's choice),
# by the widest single tile they apply to. Its blocks are short-lived, so several per SM keep rows in
# flight, as many as the registers of a whole row allow (experiments 13, 17, 18).
GATHER_SINGLE_TILE_HINTS = ((2048, 8, 0), (4096, 8, 8), (8192, 4, 0), (16384, 2, 0), (32768, 1, 8))
GATHER_CHUNKED_HINTS = (1, 8)  # FWD_CHUNK_N-wide chunks, see there

# Compiler hints of one kernel launch, as sorted ``(name, value)`` pairs (hashable: a cache key).
Hints = tuple[tuple[str, int], ...]


def _hints(**values: int) -> Hints:
    """The hints that are set (0 means: leave it to the compiler)."""
    return tuple(sorted((k, v) for k, v in values.items() if v))


# Few rows (at most this many per SM) of at most BWD_DIRECT_MAX_TILE_N padded columns: the backward is one
# launch, rms_norm_bwd_direct, whose extra blocks sum dw strips over all rows, instead of the persistent
# kernel, a partial buffer and the reduction; wider rows lost, the strips' M-row walk being the long
# pole (experiment 21). Strips: at least one per SM where N allows, and about BWD_DIRECT_STRIP_ELEMS
# elements of x and of dy per step.
BWD_DIRECT_MAX_ROWS_PER_SM = 4
BWD_DIRECT_MAX_TILE_N = 4096
BWD_DIRECT_MIN_STRIP_N = 16
BWD_DIRECT_MAX_STRIP_N = 64
BWD_DIRECT_STRIP_ELEMS = 4096

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
    kernel: str  # "gather" or "persistent"
    tile_m: int
    tile_n: int
    single_tile: bool  # gather only: the row fits one tile
    grid: int
    hints: Hints = ()  # compiler hints (occupancy, num_worker_warps)
    tail_n: int = 0  # persistent: width of the tail tile after the first TILE_N columns (0: none)


@dataclass(frozen=True)
class BackwardConfig:
    # "direct" (few rows: rms_norm_bwd_direct writes dx and dw), "persistent" (rows fit one tile, or a
    # tile and a tail tile: rms_norm_bwd_persistent writes dx and dw partial rows, then the reduction) or
    # "chunked" (rms_norm_bwd_row_dot and rms_norm_bwd_column_chunk over column chunks, then the reduction)
    plan: str
    tile_m: int
    tile_n: int
    grid: int  # row workers: rows of the dw partial buffer (direct: dx blocks, one per row tile)
    num_chunks: int  # column chunks (1 when persistent); the chunked grid is (grid, num_chunks); direct: dw strips
    hints: Hints = ()  # compiler hints (occupancy, num_worker_warps)
    tail_n: int = 0  # persistent: width of the tail tile after the first TILE_N columns (0: none)
    strip_n: int = 0  # direct: columns of one dw strip
    strip_m: int = 0  # direct: rows a dw strip block sums per step


def _blocks_and_hints(row: int, prefix: str) -> tuple[int, Hints]:
    """Blocks per SM and compiler hints of the ``FWD``/``BWD`` persistent grids."""
    width = "NARROW" if row <= NARROW_MAX_ROW else "WIDE"
    table = globals()  # read at call time, so that bench/tune_cutile.py can sweep the constants
    key = f"{prefix}_{width}"
    hints = _hints(occupancy=table[f"{key}_OCCUPANCY"], num_worker_warps=table[f"{key}_WORKER_WARPS"])
    return table[f"{key}_BLOCKS_PER_SM"], hints


def _tile_m(row: int, target_elems: int) -> int:
    # Independent of M on purpose: every M then shares one compiled variant per (N, dtype).
    return max(1, min(MAX_TILE_M, prev_pow2(max(target_elems // row, 1))))


def _strip_width(n: int, num_sms: int, narrowest: int, widest: int) -> int:
    """Power-of-two width of the column strips that split ``n`` columns among blocks (the dw reduction,
    the dw strips of the direct backward): at least one strip per SM where N allows, within the bounds."""
    return max(narrowest, min(widest, prev_pow2(n // max(num_sms, 1))))


def split_row(n: int) -> tuple[int, int]:
    """``(TILE_N, TAIL_N)``: a row as one power-of-two tile, or as a tile plus a narrower power-of-two tail
    when that is narrower than the single padded tile (5120 = 4096 + 1024, 6144 = 4096 + 2048, 12288 =
    8192 + 4096; 7168 stays 8192): fewer padded columns to load and reduce (experiment 12)."""
    head = prev_pow2(n)
    tail = next_pow2(n - head) if n > head else 0
    return (head, tail) if head + tail < next_pow2(n) else (next_pow2(n), 0)


def forward_config(m: int, n: int, dtype: torch.dtype, num_sms: int, kernel: str | None = None) -> ForwardConfig:
    """Chooses the forward kernel and its tiles. ``kernel`` forces one ("gather" / "persistent")."""
    padded = next_pow2(n)
    fits = padded <= FWD_MAX_SINGLE_TILE_N
    if kernel is None:
        few_rows = m <= GATHER_MAX_ROWS_PER_SM * num_sms
        fills_tile = dtype.itemsize != 2 or n >= GATHER_PREFERRED_MIN_FILL_16BIT * padded
        preferred = GATHER_PREFERRED_MIN_N <= n <= GATHER_PREFERRED_MAX_N and m >= GATHER_PREFERRED_MIN_M
        gather_wins = (preferred and fills_tile) or n >= GATHER_MIN_N
        kernel = "gather" if few_rows or gather_wins else "persistent"
    if kernel not in FORWARD_KERNELS:
        raise ValueError(f"kernel must be one of {FORWARD_KERNELS} or None, got {kernel!r}")
    if kernel == "gather":
        tile_n = padded if fits else FWD_CHUNK_N
        return ForwardConfig("gather", 1, tile_n, fits, m, _gather_hints(tile_n, fits))
    if padded > FWD_MAX_PERSISTENT_TILE_N:
        raise ValueError(
            f"kernel='persistent' needs rows of at most {FWD_MAX_PERSISTENT_TILE_N} elements (N={n}); "
            "use kernel='gather'"
        )
    tile_n, tail_n = split_row(n) if padded >= FWD_SPLIT_MIN_TILE_N else (padded, 0)
    row = tile_n + tail_n
    tile_m = _tile_m(row, FWD_TILE_ELEMS)
    blocks, hints = _blocks_and_hints(row, "FWD")
    if row <= FWD_TINY_TILE_N:
        blocks = FWD_TINY_BLOCKS_PER_SM
    grid = min(num_sms * blocks, cdiv(m, tile_m))
    return ForwardConfig("persistent", tile_m, tile_n, True, grid, hints, tail_n)


def _gather_hints(tile_n: int, single_tile: bool) -> Hints:
    """Occupancy and warps of the gather kernel (GATHER_SINGLE_TILE_HINTS, GATHER_CHUNKED_HINTS)."""
    if single_tile:  # FWD_MAX_SINGLE_TILE_N is the table's last width, so a row always finds its entry
        occupancy, warps = next((o, w) for widest, o, w in GATHER_SINGLE_TILE_HINTS if tile_n <= widest)
    else:
        occupancy, warps = GATHER_CHUNKED_HINTS
    return _hints(occupancy=occupancy, num_worker_warps=warps)


def backward_config(m: int, n: int, dtype: torch.dtype, num_sms: int) -> BackwardConfig:
    """Chooses the backward kernels, tiles and the number of dw partial rows (``grid``)."""
    del dtype
    if next_pow2(n) <= BWD_DIRECT_MAX_TILE_N and m <= BWD_DIRECT_MAX_ROWS_PER_SM * num_sms:
        tile_n = next_pow2(n)
        tile_m = _tile_m(tile_n, BWD_NARROW_TILE_ELEMS)
        _, hints = _blocks_and_hints(tile_n, "BWD")
        strip_n = _strip_width(n, num_sms, BWD_DIRECT_MIN_STRIP_N, BWD_DIRECT_MAX_STRIP_N)
        strip_m = prev_pow2(BWD_DIRECT_STRIP_ELEMS // strip_n)
        return BackwardConfig("direct", tile_m, tile_n, cdiv(m, tile_m), cdiv(n, strip_n), hints, 0, strip_n, strip_m)
    if next_pow2(n) <= BWD_MAX_SINGLE_TILE_N:
        tile_n, tail_n = split_row(n)
        row = tile_n + tail_n
        tile_m = _tile_m(row, BWD_NARROW_TILE_ELEMS if row <= NARROW_MAX_ROW else BWD_WIDE_TILE_ELEMS)
        blocks, hints = _blocks_and_hints(row, "BWD")
        grid = min(num_sms * blocks, cdiv(m, tile_m))
        return BackwardConfig("persistent", tile_m, tile_n, grid, 1, hints, tail_n)
    num_chunks = cdiv(n, BWD_CHUNK_N)
    blocks, hints = _blocks_and_hints(BWD_CHUNK_N, "BWD")
    # Enough row workers that (workers x chunks) fills the GPU, never more than there are row tiles.
    grid = max(1, min(cdiv(num_sms * blocks, num_chunks), cdiv(m, BWD_CHUNK_TILE_M)))
    return BackwardConfig("chunked", BWD_CHUNK_TILE_M, BWD_CHUNK_N, grid, num_chunks, hints)


@dataclass(frozen=True)
class ReduceConfig:
    tile_g: int  # partial rows per step
    tile_n: int  # columns per block
    grid: int


def reduce_config(n: int, num_sms: int) -> ReduceConfig:
    """Tiles of the final dw reduction for a hidden size ``n``."""
    tile_n = _strip_width(n, num_sms, REDUCE_MIN_TILE_N, REDUCE_MAX_TILE_N)
    return ReduceConfig(REDUCE_TILE_ELEMS // tile_n, tile_n, cdiv(n, tile_n))


# ----------------------------------------------------------------------------------------------
# QK-norm (qk_rms_norm): one persistent launch over the row tiles of q, then of k
# ----------------------------------------------------------------------------------------------

# Head dims are short (64-256): the whole head is one tile (TILE_N = next_pow2(D)), and a tile holds many
# rows. Widest head dim served by the one-tile kernels; wider rows would need column chunks.
QK_MAX_TILE_N = 1024
# Elements per tile, forward and backward: the narrow-row sizes of the plain norm (experiments 7, 11),
# whose best tiles carried 16384 (forward) and 8192 (backward, x and dy live) elements. Not yet swept for
# the qk kernels.
QK_FWD_TILE_ELEMS = 16384
QK_BWD_TILE_ELEMS = 8192
# Fewest rows per tile: below it a tile's loads are too short to hide latency; above QK_MAX_TILE_M the
# row reductions of one tile get long for no more bytes in flight (256 rows of 64 bf16 = 32 KB).
QK_MIN_TILE_M = 16
QK_MAX_TILE_M = 256
# Blocks per SM and compiler hints: the plain norm's settings for rows of at most 1024 columns (forward:
# FWD_TINY_*, experiment 15) and for narrow backward rows (BWD_NARROW_*, experiments 6, 15).
QK_FWD_BLOCKS_PER_SM = FWD_TINY_BLOCKS_PER_SM
QK_FWD_OCCUPANCY = FWD_NARROW_OCCUPANCY
QK_BWD_BLOCKS_PER_SM = BWD_NARROW_BLOCKS_PER_SM
QK_BWD_OCCUPANCY = BWD_NARROW_OCCUPANCY


@dataclass(frozen=True)
class QKConfig:
    tile_n: int  # TILE_N >= D, one tile per row
    fwd_tile_m: int
    bwd_tile_m: int
    fwd_grid: int
    bwd_grid: int  # also the rows of the (grid, 2, D) dw partial buffer
    fwd_hints: Hints = ()
    bwd_hints: Hints = ()


def _qk_tile_m(rows: int, tile_n: int, target_elems: int, num_sms: int) -> int:
    """Rows per tile: ``target_elems`` worth, but small enough that few rows still give a tile to every SM
    (a power of two of M's bucket, so one compiled variant per bucket below the target)."""
    by_size = prev_pow2(max(target_elems // tile_n, 1))
    by_rows = prev_pow2(max(rows // max(num_sms, 1), 1))
    return max(QK_MIN_TILE_M, min(QK_MAX_TILE_M, by_size, by_rows))


def qk_config(m_q: int, m_k: int, d: int, dtype: torch.dtype, num_sms: int) -> QKConfig:
    """Tiles, grids and hints of the qk kernels for ``m_q`` rows of q and ``m_k`` rows of k (tiles from
    the rows' power-of-two bucket; the grid follows the real row counts)."""
    del dtype  # tiles are counted in elements: the 16-bit and fp32 settings have not been told apart yet
    tile_n = next_pow2(d)
    if tile_n > QK_MAX_TILE_N:
        raise ValueError(f"qk_rms_norm's cuTile kernels take head dims of at most {QK_MAX_TILE_N}, got {d}")
    bucket = m_bucket(m_q + m_k)
    fwd_m = _qk_tile_m(bucket, tile_n, QK_FWD_TILE_ELEMS, num_sms)
    bwd_m = _qk_tile_m(bucket, tile_n, QK_BWD_TILE_ELEMS, num_sms)

    def grid(tile_m, blocks_per_sm):  # never more blocks than row tiles
        return max(1, min(num_sms * blocks_per_sm, cdiv(m_q, tile_m) + cdiv(m_k, tile_m)))

    return QKConfig(
        tile_n,
        fwd_m,
        bwd_m,
        grid(fwd_m, QK_FWD_BLOCKS_PER_SM),
        grid(bwd_m, QK_BWD_BLOCKS_PER_SM),
        _hints(occupancy=QK_FWD_OCCUPANCY),
        _hints(occupancy=QK_BWD_OCCUPANCY),
    )
