"""Launch heuristics for the cuTile kernels: which kernel, which tile shape, which grid, which
compiler hints.

Kept apart from the kernels so that tuning never touches kernel code. A choice is a *candidate*
(:class:`ForwardCandidate`, :class:`BackwardCandidate`: kernel or strategy, tiles, blocks per SM, hints),
turned into a launch configuration for one ``(M, N)`` by :func:`build_forward` / :func:`build_backward`.
The candidate comes from the device's tuning table (:mod:`.tuning`) where it has an entry, else from the
analytic heuristics, pure functions of ``(M, N, dtype, num_sms)`` whose parameters are the fields of
:class:`Heuristics` (fitted on H100/H200 with ``bench/tools/tune_cutile.py``; ``PERFORMANCE.md`` has the
measurements). Tiles and hints come from M's power-of-two bucket (the host passes the bucket and caches the
result per device, M, N, dtype and kernel), so a new M compiles nothing new. Tile shapes are powers of two."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch

from .._tiling import cdiv, next_pow2, prev_pow2

FORWARD_KERNELS = ("gather", "persistent")


@dataclass(frozen=True)
class Heuristics:
    """The analytic heuristics' parameters (the fallback where no tuning table has an entry, see
    :mod:`.tuning`). Defaults are the constants fitted on H100/H200; ``bench/tools/tune_cutile.py --set`` and
    ``bench/tools/sanitize.py`` run with other values through :func:`override`."""

    # Widest row kept in registers as one tile; wider rows take the column-chunked kernels. A whole row per
    # block streams faster than chunks that read it twice (PERFORMANCE.md, "Wide rows"). The persistent
    # forward takes tiles up to fwd_max_persistent_tile_n (wider rows always take the gather kernel, see
    # gather_min_n).
    fwd_max_single_tile_n: int = 32768
    fwd_max_persistent_tile_n: int = 16384
    bwd_max_single_tile_n: int = 16384
    # Column chunk of the chunked kernels and rows per chunked backward tile: enough bytes in flight per
    # block, while few rows in flight keep a row's second read in L2 (PERFORMANCE.md, "Wide rows").
    fwd_chunk_n: int = 16384
    bwd_chunk_n: int = 4096
    bwd_chunk_tile_m: int = 4
    # Elements per tile that the forward / backward aim for (enough bytes in flight per block; wide
    # backward tiles take two rows per step, narrow ones lose with bigger tiles: PERFORMANCE.md, "Forward"
    # and "Backward").
    fwd_tile_elems: int = 16384
    # The persistent forward holds rows as a tile plus a tail tile (see split_row) once the padded tile
    # would be this wide: narrower rows lost with the split (PERFORMANCE.md, "Forward").
    fwd_split_min_tile_n: int = 16384
    bwd_narrow_tile_elems: int = 8192
    bwd_wide_tile_elems: int = 16384
    max_tile_m: int = 16
    # Persistent grids: blocks launched per SM (at most one per row tile) and two compiler hints, for
    # narrow rows (at most narrow_max_row padded columns) and wide ones: ``occupancy``, the blocks per SM
    # the compiler sizes its registers for, and ``num_worker_warps``, the warps of one block (0: the
    # compiler's choice). Left to itself the compiler built narrow tiles for too few blocks, while wide
    # tiles lose when forced to share an SM (PERFORMANCE.md, "Forward" and "Backward").
    narrow_max_row: int = 6144  # widest row (padded: tile plus tail tile) of the narrow class
    fwd_narrow_blocks_per_sm: int = 2
    fwd_narrow_occupancy: int = 2
    fwd_narrow_worker_warps: int = 0
    fwd_wide_blocks_per_sm: int = 2
    fwd_wide_occupancy: int = 0
    fwd_wide_worker_warps: int = 0
    # Rows of at most 1024 columns: more blocks per SM, still built for occupancy 2 (the extra blocks
    # queue and hide the short rows' latency; PERFORMANCE.md, "Forward").
    fwd_tiny_tile_n: int = 1024
    fwd_tiny_blocks_per_sm: int = 8
    # Short 16-bit rows (at most fwd_short_max_row padded columns: head dims, QK-norm through the plain
    # norm) are latency-bound per tile: the forward gains most from an occupancy hint that lets more blocks
    # stay resident (fwd_short_occupancy, by the widest padded row it applies to), and from fwd_short_many_m
    # rows on from about one row tile per block (PERFORMANCE.md, "Narrow rows"). Measured on bf16 and fp16
    # only.
    fwd_short_max_row: int = 256
    fwd_short_occupancy: tuple[tuple[int, int], ...] = ((64, 8), (256, 4))
    fwd_short_many_m: int = 1 << 20
    fwd_short_many_blocks_per_sm: int = 128
    # Backward rows of at most bwd_short_max_row padded columns take bwd_short_tile_m rows per tile (more
    # than max_tile_m: x and dy of one such tile are only a few KB; every dtype: PERFORMANCE.md, "Narrow
    # rows").
    bwd_short_max_row: int = 128
    bwd_short_tile_m: int = 32
    # Persistent backward tiles of more than one row and at most this many columns (tile plus tail) keep dw
    # as one fp32 accumulator per tile row (kernels.DW_PER_ROW), summed once at the end rather than summed
    # over the tile's rows at every step; 0: never. From bwd_dw_per_row_many_m rows on, rows narrower than
    # bwd_dw_per_row_many_m_min_row sum each tile at once again, which measured faster there (PERFORMANCE.md,
    # "dw partials and the reduction").
    bwd_dw_per_row_max_row: int = 512
    bwd_dw_per_row_many_m: int = 1 << 21
    bwd_dw_per_row_many_m_min_row: int = 128
    bwd_narrow_blocks_per_sm: int = 2
    bwd_narrow_occupancy: int = 2
    bwd_narrow_worker_warps: int = 0
    # Wide backward tiles (up to 16384 columns of x and dy in registers) spill without 8 warps
    # (PERFORMANCE.md, "Wide rows").
    bwd_wide_blocks_per_sm: int = 1
    bwd_wide_occupancy: int = 1
    bwd_wide_worker_warps: int = 8
    # The forward uses the gather kernel (one row per block) while M is at most this many rows per SM:
    # a block per row spreads few rows widest, and the inference forward then skips the rstd allocation
    # (PERFORMANCE.md, "Forward").
    gather_max_rows_per_sm: int = 4
    # From gather_preferred_min_m rows on, rows of gather_preferred_min_n to gather_preferred_max_n columns
    # take the gather kernel (PERFORMANCE.md, "Forward"); narrower rows and single waves stay persistent,
    # wider ones below gather_min_n (e.g. 12288) keep the split persistent tile.
    gather_preferred_min_n: int = 2048
    gather_preferred_max_n: int = 8192
    # ...except 16-bit rows that fill less than this share of their padded tile (bf16 5120): with the
    # gather kernel their speed varied between processes (PERFORMANCE.md, "Forward").
    gather_preferred_min_fill_16bit: float = 0.75
    gather_preferred_min_m: int = 16384
    # From this row width on the gather kernel is used at every M (PERFORMANCE.md, "Forward"); padded widths
    # below it stay persistent, where the split tile wins.
    gather_min_n: int = 16384
    # Compiler hints of the gather kernel, ``(occupancy, num_worker_warps)`` (0: the compiler's choice),
    # by the widest single tile they apply to. Its blocks are short-lived, so several per SM keep rows in
    # flight, as many as the registers of a whole row allow (PERFORMANCE.md, "Forward" and "Wide rows").
    gather_single_tile_hints: tuple[tuple[int, int, int], ...] = (
        (2048, 8, 0),
        (4096, 8, 8),
        (8192, 4, 0),
        (16384, 2, 0),
        (32768, 1, 8),
    )
    gather_chunked_hints: tuple[int, int] = (1, 8)  # fwd_chunk_n-wide chunks, see there

    # Few rows (at most this many per SM) of at most bwd_direct_max_tile_n padded columns: the backward is one
    # launch, rms_norm_bwd_direct, whose extra blocks sum dw strips over all rows, instead of the persistent
    # kernel, a partial buffer and the reduction; wider rows lost, the strips' M-row walk being the long
    # pole (PERFORMANCE.md, "Backward", "Strategies"). Strips: at least one per SM where N allows, and about
    # bwd_direct_strip_elems elements of x and of dy per step.
    bwd_direct_max_rows_per_sm: int = 4
    bwd_direct_max_tile_n: int = 4096
    bwd_direct_min_strip_n: int = 16
    bwd_direct_max_strip_n: int = 64
    bwd_direct_strip_elems: int = 4096

    # Final dw reduction: each block owns a strip of columns and sums all partial rows. The strip is
    # narrow enough that there are at least as many blocks as SMs: with 256-column strips a 2048-wide dw
    # had 8 blocks walking 264 partial rows one after another. 32 fp32 columns are one 128-byte line per
    # row, already a full memory transaction; wider strips would only cut the number of blocks. Each step
    # loads about reduce_tile_elems fp32 values.
    reduce_min_tile_n: int = 16
    reduce_max_tile_n: int = 32
    reduce_tile_elems: int = 4096

    # QK-norm (qk_rms_norm): head dims are short (64-256), so the whole head is one tile (TILE_N =
    # next_pow2(D)) and a tile holds many rows. Widest head dim the one-tile qk kernels serve.
    qk_max_tile_n: int = 1024
    # Elements per tile, forward and backward: the plain norm's narrow-row sizes, whose best tiles carried
    # 16384 (forward) and 8192 (backward: x and dy live) elements (PERFORMANCE.md, "Forward" and "Backward").
    qk_fwd_tile_elems: int = 16384
    qk_bwd_tile_elems: int = 8192
    # Fewest rows per tile: below it a tile's loads are too short to hide latency; above qk_max_tile_m the
    # row reductions of one tile get long for no more bytes in flight (256 rows of 64 bf16 = 32 KB).
    qk_min_tile_m: int = 16
    qk_max_tile_m: int = 256
    # Heads per tile where a tile spans tokens and heads (G > 1, see qk_tile_split): the tile then reads
    # TILE_G runs of TILE_H * D elements of a tensor whose heads are contiguous (a projection output, a qkv
    # slice) and TILE_H runs of TILE_G * D of one whose tokens are (a gradient from a (B, H, S, D) consumer):
    # 16 keeps both runs 1 KB or more at D 64 in 16 bits with the backward's 64-row tiles (PERFORMANCE.md,
    # "QK-norm").
    qk_tile_h: int = 16
    # Blocks per SM and occupancy: the plain norm's settings for rows of at most 1024 columns (forward) and for
    # narrow backward rows (PERFORMANCE.md, "Forward" and "Backward").
    qk_fwd_blocks_per_sm: int = 8
    qk_fwd_occupancy: int = 2
    qk_bwd_blocks_per_sm: int = 2
    qk_bwd_occupancy: int = 2

    # Gated RMSNorm (gated_rms_norm): a tile is rows of whole groups, each padded to next_pow2(group size); a
    # group is at most gated_max_tile_s padded columns (wider ones run the reference's torch math). Measured on
    # an H100 at 2048-8192 columns (PERFORMANCE.md, "Gated RMSNorm"): both kernels want eight worker warps at
    # occupancy 2; the forward tiles of 16384 elements up to gated_fwd_small_max_row padded columns and 8192
    # beyond, 8 blocks per SM; the backward (x, z and dy live) tiles of 8192 elements, 2 blocks per SM, but one
    # row per tile from gated_bwd_one_row_min padded columns on for a single group (two such rows spill) or an
    # fp32 gate (a row of several groups with a 16-bit gate lost at one row per tile), and from
    # gated_bwd_wide_min_row on the plain wide backward's settings. A backward tile of several groups with a
    # 16-bit gate takes gated_bwd_grouped_worker_warps (0: the compiler's choice) instead.
    gated_fwd_tile_elems: int = 16384
    gated_fwd_small_max_row: int = 2048
    gated_fwd_wide_tile_elems: int = 8192
    gated_fwd_blocks_per_sm: int = 8
    gated_bwd_tile_elems: int = 8192
    gated_bwd_one_row_min: int = 4096
    gated_bwd_blocks_per_sm: int = 2
    gated_bwd_wide_min_row: int = 8192
    gated_occupancy: int = 2
    gated_worker_warps: int = 8
    gated_bwd_grouped_worker_warps: int = 0
    # Groups per tile: as many as fill this many padded columns (a wider group is a tile row of its own).
    gated_max_group_row: int = 8192
    gated_max_tile_s: int = 16384
    # Most rows per tile: narrow groups (a 128-wide head of Qwen3-Next) fill a tile with rows, as the qk kernels'.
    gated_max_tile_m: int = 128

    # FP8 output (rms_norm_fp8) on rows of fp8_min_row padded columns or more, measured on an H100 at 4096 and
    # 8192 columns (PERFORMANCE.md, "FP8 output"): tiles of fp8_tile_elems elements at occupancy 2, eight worker
    # warps from fp8_worker_warps_min_row padded columns (the compiler's choice below), fp8_blocks_per_sm blocks
    # per SM; with fp8_add_gather the fused add takes one row per block at every M, as the decode sizes do;
    # narrower rows take the persistent forward's settings.
    fp8_min_row: int = 2048
    fp8_tile_elems: int = 16384
    fp8_blocks_per_sm: int = 2
    fp8_occupancy: int = 2
    fp8_worker_warps: int = 8
    fp8_worker_warps_min_row: int = 8192
    fp8_add_gather: bool = True


HEURISTICS = Heuristics()


# Compiler hints of one kernel launch, as sorted ``(name, value)`` pairs (hashable: a cache key).
Hints = tuple[tuple[str, int], ...]


def _hints(**values: int) -> Hints:
    """The hints that are set (0 means: leave it to the compiler)."""
    return tuple(sorted((k, v) for k, v in values.items() if v))


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
    tail_n: int = 0  # persistent: width of the tail tile after the first tile_n columns (0: none)


@dataclass(frozen=True)
class BackwardConfig:
    # "direct" (few rows, or the batch-invariant mode: rms_norm_bwd_direct writes dx and dw; rows wider
    # than tile_n in column chunks), "persistent" (rows fit one tile, or a
    # tile and a tail tile: rms_norm_bwd_persistent writes dx and dw partial rows, then the reduction) or
    # "chunked" (rms_norm_bwd_row_dot and rms_norm_bwd_column_chunk over column chunks, then the reduction)
    strategy: str
    tile_m: int
    tile_n: int
    grid: int  # row workers: rows of the dw partial buffer (direct: dx blocks, one per row tile)
    num_chunks: int  # column chunks (1 when persistent); the chunked grid is (grid, num_chunks); direct: dw strips
    hints: Hints = ()  # compiler hints (occupancy, num_worker_warps)
    tail_n: int = 0  # persistent: width of the tail tile after the first tile_n columns (0: none)
    strip_n: int = 0  # direct: columns of one dw strip
    strip_m: int = 0  # direct: rows a dw strip block sums per step
    dw_per_row: bool = False  # persistent: dw kept per tile row (kernels.DW_PER_ROW)


@dataclass(frozen=True)
class ForwardCandidate:
    """The tunable choices of a forward launch, independent of M and of the SM count (the grid follows
    from them): what a tuning table stores per bucket and what the analytic heuristics pick."""

    kernel: str  # "gather" or "persistent"
    tile_m: int  # gather: 1
    tile_n: int  # gather: the single tile, or the column chunk when narrower than the row
    tail_n: int  # persistent: the tail tile (0: none); gather: 0
    blocks_per_sm: int  # persistent grid; gather: 0 (one block per row)
    occupancy: int  # compiler hints, 0: the compiler's choice
    num_worker_warps: int


@dataclass(frozen=True)
class BackwardCandidate:
    """The tunable choices of a backward launch (see :class:`ForwardCandidate`)."""

    strategy: str  # "direct", "persistent" or "chunked"
    tile_m: int
    tile_n: int  # chunked: the column chunk
    tail_n: int  # persistent: the tail tile (0: none)
    blocks_per_sm: int  # persistent and chunked grids; direct: 0 (one block per row tile)
    occupancy: int
    num_worker_warps: int


BACKWARD_STRATEGIES = ("direct", "persistent", "chunked")


@contextlib.contextmanager
def override(**changes):
    """Runs the analytic heuristics with some parameters changed (``bench/tools/tune_cutile.py --set``,
    ``bench/tools/sanitize.py``); the caller clears the host caches (``tilegym_rms.cutile.clear_caches``)."""
    global HEURISTICS
    saved = HEURISTICS
    HEURISTICS = replace(saved, **changes)
    try:
        yield HEURISTICS
    finally:
        HEURISTICS = saved


def _persistent_class(row: int, prefix: str, p: Heuristics) -> tuple[int, int, int]:
    """Blocks per SM, occupancy and worker warps of the ``fwd``/``bwd`` persistent grids."""
    width = "narrow" if row <= p.narrow_max_row else "wide"
    key = f"{prefix}_{width}"
    return tuple(getattr(p, f"{key}_{name}") for name in ("blocks_per_sm", "occupancy", "worker_warps"))


def _tile_m(row: int, target_elems: int, p: Heuristics) -> int:
    # Independent of M on purpose: every M then shares one compiled variant per (N, dtype).
    return max(1, min(p.max_tile_m, prev_pow2(max(target_elems // row, 1))))


def _strip_width(n: int, num_sms: int, narrowest: int, widest: int) -> int:
    """Power-of-two width of the column strips that split ``n`` columns among blocks (the dw reduction,
    the dw strips of the direct backward): at least one strip per SM where N allows, within the bounds."""
    return max(narrowest, min(widest, prev_pow2(n // max(num_sms, 1))))


def split_row(n: int) -> tuple[int, int]:
    """``(TILE_N, TAIL_N)``: a row as one power-of-two tile, or as a tile plus a narrower power-of-two tail
    when that is narrower than the single padded tile (5120 = 4096 + 1024, 6144 = 4096 + 2048, 12288 =
    8192 + 4096; 7168 stays 8192): fewer padded columns to load and reduce (PERFORMANCE.md, "Backward")."""
    head = prev_pow2(n)
    tail = next_pow2(n - head) if n > head else 0
    return (head, tail) if head + tail < next_pow2(n) else (next_pow2(n), 0)


def forward_candidate(
    m: int, n: int, dtype: torch.dtype, num_sms: int, kernel: str | None = None, params: Heuristics | None = None
) -> ForwardCandidate:
    """The analytic heuristics' forward choice. ``kernel`` forces one ("gather" / "persistent")."""
    p = params or HEURISTICS
    padded = next_pow2(n)
    fits = padded <= p.fwd_max_single_tile_n
    if kernel is None:
        few_rows = m <= p.gather_max_rows_per_sm * num_sms
        fills_tile = dtype.itemsize != 2 or n >= p.gather_preferred_min_fill_16bit * padded
        preferred = p.gather_preferred_min_n <= n <= p.gather_preferred_max_n and m >= p.gather_preferred_min_m
        gather_wins = (preferred and fills_tile) or n >= p.gather_min_n
        kernel = "gather" if few_rows or gather_wins else "persistent"
    if kernel not in FORWARD_KERNELS:
        raise ValueError(f"kernel must be one of {FORWARD_KERNELS} or None, got {kernel!r}")
    if kernel == "gather":
        tile_n = padded if fits else p.fwd_chunk_n
        occupancy, warps = _gather_hints(tile_n, fits, p)
        return ForwardCandidate("gather", 1, tile_n, 0, 0, occupancy, warps)
    if padded > p.fwd_max_persistent_tile_n:
        raise ValueError(
            f"kernel='persistent' needs rows of at most {p.fwd_max_persistent_tile_n} elements (N={n}); "
            "use kernel='gather'"
        )
    tile_n, tail_n = split_row(n) if padded >= p.fwd_split_min_tile_n else (padded, 0)
    row = tile_n + tail_n
    blocks, occupancy, warps = _persistent_class(row, "fwd", p)
    if row <= p.fwd_tiny_tile_n:
        blocks = p.fwd_tiny_blocks_per_sm
    if row <= p.fwd_short_max_row and dtype.itemsize == 2:
        occupancy = next(o for widest, o in p.fwd_short_occupancy if row <= widest)
        if m >= p.fwd_short_many_m:
            blocks = p.fwd_short_many_blocks_per_sm
    return ForwardCandidate("persistent", _tile_m(row, p.fwd_tile_elems, p), tile_n, tail_n, blocks, occupancy, warps)


def _gather_hints(tile_n: int, single_tile: bool, p: Heuristics) -> tuple[int, int]:
    """Occupancy and warps of the gather kernel (gather_single_tile_hints, gather_chunked_hints)."""
    if single_tile:  # fwd_max_single_tile_n is the table's last width, so a row always finds its entry
        return next((o, w) for widest, o, w in p.gather_single_tile_hints if tile_n <= widest)
    return p.gather_chunked_hints


def build_forward(cand: ForwardCandidate, m: int, n: int, num_sms: int) -> ForwardConfig:
    """The launch configuration of a candidate for an ``(m, n)`` input (the grid follows M)."""
    hints = _hints(occupancy=cand.occupancy, num_worker_warps=cand.num_worker_warps)
    if cand.kernel == "gather":
        # One tile when it holds the row and is no wider than a row kept in registers (sanitize.py lowers
        # that bound to run the chunked loop on narrow rows).
        single = n <= cand.tile_n <= HEURISTICS.fwd_max_single_tile_n
        return ForwardConfig("gather", 1, cand.tile_n, single, m, hints)
    grid = min(num_sms * cand.blocks_per_sm, cdiv(m, cand.tile_m))
    return ForwardConfig("persistent", cand.tile_m, cand.tile_n, True, grid, hints, cand.tail_n)


def forward_config(
    m: int,
    n: int,
    dtype: torch.dtype,
    num_sms: int,
    kernel: str | None = None,
    table=None,
    op: str = "forward",
    invariant: bool = False,
) -> ForwardConfig:
    """Chooses the forward kernel and its tiles: the tuning ``table``'s winner for the bucket of ``(m, n,
    dtype)`` (a :class:`.tuning.Table`), else the analytic heuristics. ``op`` "fused_forward" (the fused
    residual add) takes its own entry first, then the plain forward's. ``kernel`` forces one ("gather" /
    "persistent"); a table winner of the other kernel then gives way to the next in that order.

    ``invariant`` (the batch-invariant mode): the gather kernel as chosen for one row, whatever ``m``. It
    computes each row in a block of its own with no row loop, so a row's code and tiles never follow M; the
    persistent kernel's rows move to later iterations of its grid-stride loop as M grows, which the compiler
    builds differently (PERFORMANCE.md, "Batch invariance")."""
    if invariant:
        if kernel not in (None, "gather"):
            raise ValueError(
                f"kernel={kernel!r} loops over rows and is not batch invariant; in the batch-invariant mode "
                "kernel must be None or 'gather'"
            )
        kernel, cand_m = "gather", 1
    else:
        cand_m = m
    winners = table.winners(op, cand_m, n, dtype) if table is not None else ()
    cand = next((c for c in winners if kernel in (None, c.kernel)), None)
    if cand is None:
        cand = forward_candidate(cand_m, n, dtype, num_sms, kernel)
    return build_forward(cand, m, n, num_sms)


def backward_candidate(
    m: int, n: int, dtype: torch.dtype, num_sms: int, params: Heuristics | None = None
) -> BackwardCandidate:
    """The analytic heuristics' backward choice."""
    del dtype
    p = params or HEURISTICS
    if next_pow2(n) <= p.bwd_direct_max_tile_n and m <= p.bwd_direct_max_rows_per_sm * num_sms:
        return _direct_candidate(next_pow2(n), p)
    if next_pow2(n) <= p.bwd_max_single_tile_n:
        tile_n, tail_n = split_row(n)
        row = tile_n + tail_n
        tile_m = _tile_m(row, p.bwd_narrow_tile_elems if row <= p.narrow_max_row else p.bwd_wide_tile_elems, p)
        if row <= p.bwd_short_max_row:
            tile_m = p.bwd_short_tile_m
        return BackwardCandidate("persistent", tile_m, tile_n, tail_n, *_persistent_class(row, "bwd", p))
    return BackwardCandidate(
        "chunked", p.bwd_chunk_tile_m, p.bwd_chunk_n, 0, *_persistent_class(p.bwd_chunk_n, "bwd", p)
    )


def _direct_candidate(tile_n: int, p: Heuristics) -> BackwardCandidate:
    """The direct strategy with ``tile_n`` columns per tile (the whole padded row, or a column chunk) and the
    persistent backward's hints for that width."""
    _, occupancy, warps = _persistent_class(tile_n, "bwd", p)
    return BackwardCandidate("direct", _tile_m(tile_n, p.bwd_narrow_tile_elems, p), tile_n, 0, 0, occupancy, warps)


def invariant_backward_candidate(
    n: int, dtype: torch.dtype, num_sms: int, table=None, params: Heuristics | None = None
) -> BackwardCandidate:
    """The backward of the batch-invariant mode, the same at every M: the direct strategy, whose blocks each
    compute dx of one row tile once (no row loop; its dw strips walk all rows in a fixed order). The choice
    for one row where that is direct (the table's, else the heuristics'); wider rows take the whole padded row
    up to ``bwd_max_single_tile_n`` and ``bwd_chunk_n``-wide column chunks beyond."""
    p = params or HEURISTICS
    one_row = table.lookup("backward", 1, n, dtype) if table is not None else None
    one_row = one_row or backward_candidate(1, n, dtype, num_sms, p)
    if one_row.strategy != "direct":
        wide = next_pow2(n) > p.bwd_max_single_tile_n
        one_row = _direct_candidate(p.bwd_chunk_n if wide else next_pow2(n), p)
    # One row per tile: a row is then always the first of its tile. In a tile of several rows the compiler may
    # reduce a row in another order depending on its place in the tile (PERFORMANCE.md, "Batch invariance").
    return replace(one_row, tile_m=1)


def _dw_per_row(cand: BackwardCandidate, m: int, p: Heuristics) -> bool:
    """Whether the persistent backward keeps dw per tile row (see bwd_dw_per_row_max_row). M counts by its
    bucket, as the tuning table does, so every M of a bucket launches the variant measured for it."""
    row = cand.tile_n + cand.tail_n
    if m_bucket(m) >= p.bwd_dw_per_row_many_m and row < p.bwd_dw_per_row_many_m_min_row:
        return False
    return cand.tile_m > 1 and row <= p.bwd_dw_per_row_max_row


def build_backward(cand: BackwardCandidate, m: int, n: int, num_sms: int) -> BackwardConfig:
    """The launch configuration of a candidate for an ``(m, n)`` input (grids and dw strips follow M, N)."""
    hints = _hints(occupancy=cand.occupancy, num_worker_warps=cand.num_worker_warps)
    if cand.strategy == "direct":
        p = HEURISTICS
        strip_n = _strip_width(n, num_sms, p.bwd_direct_min_strip_n, p.bwd_direct_max_strip_n)
        strip_m = prev_pow2(p.bwd_direct_strip_elems // strip_n)
        grid = cdiv(m, cand.tile_m)
        return BackwardConfig("direct", cand.tile_m, cand.tile_n, grid, cdiv(n, strip_n), hints, 0, strip_n, strip_m)
    if cand.strategy == "persistent":
        grid = min(num_sms * cand.blocks_per_sm, cdiv(m, cand.tile_m))
        per_row = _dw_per_row(cand, m, HEURISTICS)
        return BackwardConfig("persistent", cand.tile_m, cand.tile_n, grid, 1, hints, cand.tail_n, dw_per_row=per_row)
    num_chunks = cdiv(n, cand.tile_n)
    # Enough row workers that (workers x chunks) fills the GPU, never more than there are row tiles.
    grid = max(1, min(cdiv(num_sms * cand.blocks_per_sm, num_chunks), cdiv(m, cand.tile_m)))
    return BackwardConfig("chunked", cand.tile_m, cand.tile_n, grid, num_chunks, hints)


def backward_config(
    m: int, n: int, dtype: torch.dtype, num_sms: int, table=None, invariant: bool = False
) -> BackwardConfig:
    """Chooses the backward kernels, tiles and the number of dw partial rows (``grid``): the tuning
    ``table``'s winner for the bucket, else the analytic heuristics (see :func:`forward_config`);
    ``invariant``: :func:`invariant_backward_candidate`."""
    if invariant:
        cand = invariant_backward_candidate(n, dtype, num_sms, table)
    else:
        cand = table.lookup("backward", m, n, dtype) if table is not None else None
        cand = cand or backward_candidate(m, n, dtype, num_sms)
    return build_backward(cand, m, n, num_sms)


@dataclass(frozen=True)
class ReduceConfig:
    tile_g: int  # partial rows per step
    tile_n: int  # columns per block
    grid: int


def reduce_config(n: int, num_sms: int) -> ReduceConfig:
    """Tiles of the final dw reduction for a hidden size ``n``."""
    p = HEURISTICS
    tile_n = _strip_width(n, num_sms, p.reduce_min_tile_n, p.reduce_max_tile_n)
    return ReduceConfig(p.reduce_tile_elems // tile_n, tile_n, cdiv(n, tile_n))


# ----------------------------------------------------------------------------------------------
# QK-norm (qk_rms_norm): one persistent launch over the row tiles of q, then of k
# ----------------------------------------------------------------------------------------------


# A qk tensor reaches the kernels as an ``(A, G, H, D)`` view (ops/qk.py): runs of memory of one tensor pair,
# e.g. tokens (G) and heads (H) of a fused qkv slice. A tile is (1, TILE_G, TILE_H, TILE_N): TILE_G x TILE_H rows.
QKTiles = tuple[tuple[int, int], tuple[int, int]]  # ((TILE_G, TILE_H) of q, of k)


@dataclass(frozen=True)
class QKConfig:
    tile_n: int  # TILE_N >= D, one tile per row
    fwd_tile_m: int  # rows per tile (TILE_G x TILE_H), forward
    bwd_tile_m: int
    fwd_grid: int
    bwd_grid: int  # also the rows of the (grid, 2, D) dw partial buffer
    fwd_hints: Hints = ()
    bwd_hints: Hints = ()
    fwd_tiles: QKTiles = ((1, 1), (1, 1))  # the rows of a tile split along G and H, forward
    bwd_tiles: QKTiles = ((1, 1), (1, 1))


def qk_tile_split(rows: int, g: int, h: int, params: Heuristics | None = None) -> tuple[int, int]:
    """``(TILE_G, TILE_H)`` with ``TILE_G * TILE_H == rows`` for a ``(G, H)`` grid of rows: the splits whose
    padded grid is within 1/16 of the least padding (no half-empty tile for 40 heads: 8 x 5, not 64), then the
    one whose TILE_H is nearest ``qk_tile_h``, larger on a tie. Where G is 1 (all rows one run: the dense
    layouts) the tile is ``rows`` rows of that run, the plain row tile."""
    p = params or HEURISTICS
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
    wide (TILE_N = next_pow2(D))."""

    fwd_tile_m: int
    bwd_tile_m: int
    fwd_blocks_per_sm: int
    bwd_blocks_per_sm: int
    fwd_occupancy: int
    bwd_occupancy: int


def qk_candidate(rows: int, d: int, dtype: torch.dtype, num_sms: int, params: Heuristics | None = None) -> QKCandidate:
    """The analytic heuristics' qk choice for ``rows`` rows of q and k together (their power-of-two
    bucket) of head dim ``d``."""
    p = params or HEURISTICS
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
    p = HEURISTICS
    tile_n = next_pow2(d)
    if tile_n > p.qk_max_tile_n:
        raise ValueError(f"qk_rms_norm's cuTile kernels take head dims of at most {p.qk_max_tile_n}, got {d}")
    c = entry or qk_candidate(math.prod(q_shape) + math.prod(k_shape), d, dtype, num_sms)

    def tiles(tile_m):
        return tuple(qk_tile_split(tile_m, shape[1], shape[2]) for shape in (q_shape, k_shape))

    def grid(split, blocks_per_sm):  # never more blocks than tiles
        count = sum(
            a * cdiv(g, tg) * cdiv(h, th) for (a, g, h), (tg, th) in zip((q_shape, k_shape), split, strict=True)
        )
        return max(1, min(num_sms * blocks_per_sm, count))

    fwd_tiles, bwd_tiles = tiles(c.fwd_tile_m), tiles(c.bwd_tile_m)
    return QKConfig(
        tile_n,
        c.fwd_tile_m,
        c.bwd_tile_m,
        grid(fwd_tiles, c.fwd_blocks_per_sm),
        grid(bwd_tiles, c.bwd_blocks_per_sm),
        _hints(occupancy=c.fwd_occupancy),
        _hints(occupancy=c.bwd_occupancy),
        fwd_tiles,
        bwd_tiles,
    )


# ----------------------------------------------------------------------------------------------
# Gated RMSNorm (gated_rms_norm): tiles of rows by whole groups, grid axis 1 over chunks of groups
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatedLaunch:
    """One gated kernel's tiles, grid and hints."""

    tile_m: int
    tile_g: int  # groups per tile (a power of two; the last chunk may be padded)
    grid: tuple[int, int]  # (persistent over row tiles, chunks of tile_g groups)
    hints: Hints = ()


@dataclass(frozen=True)
class GatedConfig:
    tile_s: int  # next_pow2(group size)
    fwd: GatedLaunch
    bwd: GatedLaunch  # its grid[0] is also the rows of the (grid, N) dw partial buffer


def gated_config(
    m: int,
    n: int,
    group_size: int,
    dtype: torch.dtype,
    num_sms: int,
    invariant: bool = False,
    gate_dtype: torch.dtype | None = None,
) -> GatedConfig | None:
    """Tiles, grids and hints of the gated kernels for ``m`` rows of ``n`` columns of ``dtype`` in groups of
    ``group_size``, gated by a ``gate_dtype`` tensor (None: ``dtype``), tiles from M's bucket, grids from M; or
    None for a group wider than ``gated_max_tile_s`` (the host then runs the torch math). In the batch-invariant
    mode a tile is one row and the forward gives each row tile a block of its own, whatever M."""
    p = HEURISTICS
    gate_bytes = (gate_dtype or dtype).itemsize
    tile_s = next_pow2(group_size)
    if tile_s > p.gated_max_tile_s:
        return None
    groups = n // group_size
    tile_g = min(next_pow2(groups), max(1, p.gated_max_group_row // tile_s))
    chunks, row = cdiv(groups, tile_g), tile_g * tile_s  # row: a tile row's padded columns

    def launch(tile_elems, blocks_per_sm, hints, one_tile_per_block=False):
        by_rows = prev_pow2(max(m_bucket(m) * chunks // max(num_sms, 1), 1))  # a tile for every SM first
        by_size = prev_pow2(max(tile_elems // row, 1))
        tile_m = 1 if invariant else max(1, min(p.gated_max_tile_m, by_size, by_rows))
        # Blocks over both axes: about blocks_per_sm per SM, at most one per row tile.
        grid = cdiv(m, tile_m)
        if not one_tile_per_block:
            grid = min(max(num_sms * blocks_per_sm // chunks, 1), grid)
        return GatedLaunch(tile_m, tile_g, (max(1, grid), chunks), hints)

    hints = _hints(occupancy=p.gated_occupancy, num_worker_warps=p.gated_worker_warps)
    fwd_elems = p.gated_fwd_tile_elems if row <= p.gated_fwd_small_max_row else p.gated_fwd_wide_tile_elems
    one_row = row >= p.gated_bwd_one_row_min and (tile_g == 1 or gate_bytes == 4)
    bwd_elems = row if one_row else p.gated_bwd_tile_elems
    bwd_blocks, bwd_hints = p.gated_bwd_blocks_per_sm, hints
    # The batch-invariant mode keeps eight warps: with the compiler's choice a row reached in a later iteration of
    # the row loop came out an ulp apart (PERFORMANCE.md, "Batch invariance").
    if tile_g > 1 and gate_bytes == 2 and not invariant:  # never one row: that takes a single group or fp32
        bwd_hints = _hints(occupancy=p.gated_occupancy, num_worker_warps=p.gated_bwd_grouped_worker_warps)
    if row >= p.gated_bwd_wide_min_row:  # the plain wide backward's settings
        bwd_hints = _hints(occupancy=p.bwd_wide_occupancy, num_worker_warps=p.bwd_wide_worker_warps)
        bwd_blocks = p.bwd_wide_blocks_per_sm
    return GatedConfig(
        tile_s,
        launch(fwd_elems, p.gated_fwd_blocks_per_sm, hints, invariant),
        launch(bwd_elems, bwd_blocks, bwd_hints),
    )


# ----------------------------------------------------------------------------------------------
# FP8 output (rms_norm_fp8): one launch of rms_norm_fp8_fwd, row tiles of whole rows in a grid-stride walk
# ----------------------------------------------------------------------------------------------

# Widest row the fused FP8 kernel holds in registers (the plain norm's widest persistent tile, whose register
# budget the one-pass kernel shares); wider rows run the norm, then torch's quantization (ops/fp8.py).
FP8_MAX_TILE_N = 16384


@dataclass(frozen=True)
class FP8Config:
    tile_m: int
    tile_n: int  # >= N and >= the group size: a row is one tile
    grid: int  # blocks; each walks row tiles bid, bid + grid, ... (exactly one where grid = row tiles)
    hints: Hints = ()


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
    (PERFORMANCE.md, "Batch invariance")."""
    p = params or HEURISTICS
    tile_n = max(next_pow2(n), group_size or 1)
    if tile_n > FP8_MAX_TILE_N:
        raise ValueError(f"the FP8 kernel takes rows of at most {FP8_MAX_TILE_N} elements, got N={n}")
    gather_add = add and p.fp8_add_gather and tile_n >= p.fp8_min_row
    if invariant or gather_add or m_bucket(m) <= p.gather_max_rows_per_sm * num_sms:
        occupancy, warps = _gather_hints(tile_n, True, p)
        return FP8Config(1, tile_n, m, _hints(occupancy=occupancy, num_worker_warps=warps))
    if tile_n >= p.fp8_min_row:
        warps = p.fp8_worker_warps if tile_n >= p.fp8_worker_warps_min_row else 0
        blocks_per_sm, occupancy = p.fp8_blocks_per_sm, p.fp8_occupancy
        tile_m = _tile_m(tile_n, p.fp8_tile_elems, p)
    else:
        blocks_per_sm, occupancy, warps = _persistent_class(tile_n, "fwd", p)
        tile_m = _tile_m(tile_n, p.fwd_tile_elems, p)
    grid = min(cdiv(m, tile_m), blocks_per_sm * num_sms)
    return FP8Config(tile_m, tile_n, grid, _hints(occupancy=occupancy, num_worker_warps=warps))
