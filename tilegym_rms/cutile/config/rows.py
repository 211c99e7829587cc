"""The plain norm's launches: the forward (gather or persistent kernel), the backward (direct, persistent or
chunked strategy) and the final dw reduction. A choice is a candidate (:class:`ForwardCandidate`,
:class:`BackwardCandidate`), from the tuning table or the analytic heuristics, turned into a launch
configuration for one ``(M, N)`` by :func:`build_forward` / :func:`build_backward`."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..._tiling import cdiv, next_pow2, prev_pow2
from .heuristics import Heuristics, Hints, current, m_bucket, make_hints

# The forward's kernels: one row per block ("gather"), row tiles walked by a static-persistent grid ("persistent"),
# and the same tiles one per block without the walk ("tiles": no load ring, so as many small blocks resident as the
# hints allow, each with its own loads in flight; PERFORMANCE.md, "Narrow rows"). "tiles" launches the persistent
# kernel with WALK off. "split" spreads a row wider than one chunk over a block per chunk, which read x once and
# trade their sums of squares through memory (rms_norm_fwd_split; chosen only by name or by a table of one's own,
# never by a shipped one: it wins only on fewer rows than SMs, and its blocks wait on each other, PERFORMANCE.md
# "Wide rows").
FORWARD_KERNELS = ("gather", "persistent", "tiles", "split")


@dataclass(frozen=True)
class ForwardConfig:
    kernel: str  # "gather", "persistent", "tiles" or "split" (FORWARD_KERNELS)
    tile_m: int
    tile_n: int
    single_tile: bool  # gather only: the row fits one tile; split: False (a row is tile_n-wide chunks)
    grid: int
    hints: Hints = ()  # compiler hints (occupancy, num_worker_warps)
    tail_n: int = 0  # persistent and tiles: width of the tail tile after the first tile_n columns (0: none)


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

    kernel: str  # FORWARD_KERNELS: one row per block, row tiles walked by a persistent grid, one tile per block
    tile_m: int  # gather: 1
    tile_n: int  # gather: the single tile, or the column chunk when narrower than the row
    tail_n: int  # persistent and tiles: the tail tile (0: none); gather: 0
    blocks_per_sm: int  # persistent grid; gather and tiles: 0 (one block per row or row tile)
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


def persistent_class(row: int, prefix: str, p: Heuristics) -> tuple[int, int, int]:
    """Blocks per SM, occupancy and worker warps of the ``fwd``/``bwd`` persistent grids."""
    width = "narrow" if row <= p.narrow_max_row else "wide"
    key = f"{prefix}_{width}"
    return tuple(getattr(p, f"{key}_{name}") for name in ("blocks_per_sm", "occupancy", "worker_warps"))


def tile_rows(row: int, target_elems: int, p: Heuristics, most: int | None = None) -> int:
    """Rows of ``row`` padded columns in a tile of about ``target_elems`` elements, a power of two of at most
    ``most`` rows (None: ``max_tile_m``)."""
    # Independent of M on purpose: every M then shares one compiled variant per (N, dtype).
    return max(1, min(p.max_tile_m if most is None else most, prev_pow2(max(target_elems // row, 1))))


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
    """The analytic heuristics' forward choice. ``kernel`` forces one of :data:`FORWARD_KERNELS` ("tiles": the
    persistent choice's row split, with the ``fwd_tiles_*`` tiles and hints)."""
    p = params or current()
    padded = next_pow2(n)
    fits = padded <= p.fwd_max_single_tile_n
    if kernel is None:
        few_rows = m <= p.gather_max_rows_per_sm * num_sms
        fills_tile = dtype.itemsize != 2 or n >= p.gather_preferred_min_fill_16bit * padded
        preferred = p.gather_preferred_min_n <= n <= p.gather_preferred_max_n and m >= p.gather_preferred_min_m
        gather_wins = (preferred and fills_tile) or n >= p.gather_min_n
        kernel = "gather" if few_rows or gather_wins else "persistent"
        short = p.fwd_tiles_min_row <= padded <= p.fwd_short_max_row and dtype.itemsize == 2
        if kernel == "persistent" and short and n == padded and m >= p.fwd_tiles_min_m:
            kernel = "tiles"
        few_enough = not p.fwd_split_max_m or m <= p.fwd_split_max_m
        split = p.fwd_split_min_n and n >= max(p.fwd_split_min_n, p.fwd_chunk_n + 1) and few_enough
        if split and cdiv(n, p.fwd_chunk_n) <= num_sms:
            kernel = "split"
    if kernel not in FORWARD_KERNELS:
        raise ValueError(f"kernel must be one of {FORWARD_KERNELS} or None, got {kernel!r}")
    if kernel == "gather":
        tile_n = padded if fits else p.fwd_chunk_n
        occupancy, warps = gather_hints(tile_n, fits, p)
        return ForwardCandidate("gather", 1, tile_n, 0, 0, occupancy, warps)
    if kernel == "split":
        if n <= p.fwd_chunk_n:
            raise ValueError(f"kernel='split' splits rows wider than {p.fwd_chunk_n} columns (N={n})")
        # Each block holds one chunk, as a gather row: the gather's occupancy, but the compiler's warps (a build
        # with worker warps never finished, PERFORMANCE.md "A row over several blocks").
        occupancy, _ = gather_hints(p.fwd_chunk_n, True, p)
        return ForwardCandidate("split", 1, p.fwd_chunk_n, 0, 0, occupancy, 0)
    if padded > p.fwd_max_persistent_tile_n:
        raise ValueError(
            f"kernel={kernel!r} needs rows of at most {p.fwd_max_persistent_tile_n} elements (N={n}); "
            "use kernel='gather'"
        )
    tile_n, tail_n = split_row(n) if padded >= p.fwd_split_min_tile_n else (padded, 0)
    row = tile_n + tail_n
    if kernel == "tiles":
        return _tiles_candidate(tile_n, tail_n, p)
    blocks, occupancy, warps = persistent_class(row, "fwd", p)
    if row <= p.fwd_tiny_tile_n:
        blocks = p.fwd_tiny_blocks_per_sm
    if row <= p.fwd_short_max_row and dtype.itemsize == 2:
        occupancy = next(o for widest, o in p.fwd_short_occupancy if row <= widest)
        if m >= p.fwd_short_many_m:
            blocks = p.fwd_short_many_blocks_per_sm
    return ForwardCandidate(kernel, tile_rows(row, p.fwd_tile_elems, p), tile_n, tail_n, blocks, occupancy, warps)


def _tiles_candidate(tile_n: int, tail_n: int, p: Heuristics) -> ForwardCandidate:
    """The analytic "tiles" forward for rows held as ``tile_n`` (plus ``tail_n``) columns: ``fwd_tiles_*``."""
    row = tile_n + tail_n
    tile_m = tile_rows(row, p.fwd_tiles_tile_elems, p, p.fwd_tiles_max_tile_m)
    if row <= p.fwd_short_max_row:
        occupancy, warps = p.fwd_tiles_short_occupancy, p.fwd_tiles_short_worker_warps
    else:  # a row or two per block: as the gather kernel's row
        occupancy, warps = gather_hints(next_pow2(row), True, p)
    return ForwardCandidate("tiles", tile_m, tile_n, tail_n, 0, occupancy, warps)


def gather_hints(tile_n: int, single_tile: bool, p: Heuristics) -> tuple[int, int]:
    """Occupancy and warps of the gather kernel (gather_single_tile_hints, gather_chunked_hints)."""
    if single_tile:  # fwd_max_single_tile_n is the table's last width, so a row always finds its entry
        return next((o, w) for widest, o, w in p.gather_single_tile_hints if tile_n <= widest)
    return p.gather_chunked_hints


def build_forward(cand: ForwardCandidate, m: int, n: int, num_sms: int) -> ForwardConfig:
    """The launch configuration of a candidate for an ``(m, n)`` input (the grid follows M)."""
    hints = make_hints(occupancy=cand.occupancy, num_worker_warps=cand.num_worker_warps)
    if cand.kernel == "gather":
        # One tile when it holds the row and is no wider than a row kept in registers (sanitize.py lowers
        # that bound to run the chunked loop on narrow rows).
        single = n <= cand.tile_n <= current().fwd_max_single_tile_n
        return ForwardConfig("gather", 1, cand.tile_n, single, m, hints)
    if cand.kernel == "split":
        chunks = cdiv(n, cand.tile_n)
        if chunks > num_sms:  # a row's blocks wait for each other: all of them must be able to run at once
            raise ValueError(f"kernel='split': {chunks} chunks of {cand.tile_n} columns exceed the {num_sms} SMs")
        return ForwardConfig("split", 1, cand.tile_n, False, m * chunks, hints)
    tiles = cdiv(m, cand.tile_m)
    grid = tiles if cand.kernel == "tiles" else min(num_sms * cand.blocks_per_sm, tiles)
    return ForwardConfig(cand.kernel, cand.tile_m, cand.tile_n, True, grid, hints, cand.tail_n)


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
    residual add) takes its own entry first, else the other 16-bit dtype's fused entry, then the plain forward's
    (``Table.winners``). ``kernel`` forces one of :data:`FORWARD_KERNELS`: the first winner along that chain of
    that kernel, else the analytic choice of that kernel.

    ``invariant`` (the batch-invariant mode): the gather kernel as chosen for one row, whatever ``m``. It
    computes each row in a block of its own with no row loop, so a row's code and tiles never follow M; the
    persistent kernel's rows move to later iterations of its grid-stride loop as M grows, which the compiler
    builds differently, and both row-tile kernels take their tile rows from M's bucket (PERFORMANCE.md, "Batch
    invariance")."""
    if invariant:
        if kernel not in (None, "gather"):
            raise ValueError(
                f"kernel={kernel!r} puts rows in tiles that follow M and is not batch invariant; in the "
                "batch-invariant mode kernel must be None or 'gather'"
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
    p = params or current()
    if next_pow2(n) <= p.bwd_direct_max_tile_n and m <= p.bwd_direct_max_rows_per_sm * num_sms:
        return _direct_candidate(next_pow2(n), p)
    if next_pow2(n) <= p.bwd_max_single_tile_n:
        tile_n, tail_n = split_row(n)
        row = tile_n + tail_n
        tile_m = tile_rows(row, p.bwd_narrow_tile_elems if row <= p.narrow_max_row else p.bwd_wide_tile_elems, p)
        if row <= p.bwd_short_max_row:
            tile_m = p.bwd_short_tile_m
        return BackwardCandidate("persistent", tile_m, tile_n, tail_n, *persistent_class(row, "bwd", p))
    return BackwardCandidate(
        "chunked", p.bwd_chunk_tile_m, p.bwd_chunk_n, 0, *persistent_class(p.bwd_chunk_n, "bwd", p)
    )


def _direct_candidate(tile_n: int, p: Heuristics) -> BackwardCandidate:
    """The direct strategy with ``tile_n`` columns per tile (the whole padded row, or a column chunk) and the
    persistent backward's hints for that width."""
    _, occupancy, warps = persistent_class(tile_n, "bwd", p)
    return BackwardCandidate("direct", tile_rows(tile_n, p.bwd_narrow_tile_elems, p), tile_n, 0, 0, occupancy, warps)


def invariant_backward_candidate(
    n: int, dtype: torch.dtype, num_sms: int, table=None, params: Heuristics | None = None
) -> BackwardCandidate:
    """The backward of the batch-invariant mode, the same at every M: the direct strategy, whose blocks each
    compute dx of one row tile once (no row loop; its dw strips walk all rows in a fixed order). The choice
    for one row where that is direct (the table's, else the heuristics'); wider rows take the whole padded row
    up to ``bwd_max_single_tile_n`` and ``bwd_chunk_n``-wide column chunks beyond."""
    p = params or current()
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
    hints = make_hints(occupancy=cand.occupancy, num_worker_warps=cand.num_worker_warps)
    if cand.strategy == "direct":
        p = current()
        strip_n = _strip_width(n, num_sms, p.bwd_direct_min_strip_n, p.bwd_direct_max_strip_n)
        strip_m = prev_pow2(p.bwd_direct_strip_elems // strip_n)
        grid = cdiv(m, cand.tile_m)
        return BackwardConfig("direct", cand.tile_m, cand.tile_n, grid, cdiv(n, strip_n), hints, 0, strip_n, strip_m)
    if cand.strategy == "persistent":
        grid = min(num_sms * cand.blocks_per_sm, cdiv(m, cand.tile_m))
        per_row = _dw_per_row(cand, m, current())
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
    hints: Hints = ()


def reduce_config(n: int, num_sms: int) -> ReduceConfig:
    """Tiles and hints of the final dw reduction for a hidden size ``n``."""
    p = current()
    tile_n = _strip_width(n, num_sms, p.reduce_min_tile_n, p.reduce_max_tile_n)
    return ReduceConfig(
        p.reduce_tile_elems // tile_n, tile_n, cdiv(n, tile_n), make_hints(occupancy=p.reduce_occupancy)
    )
