"""The analytic heuristics' parameters (:class:`Heuristics`), the ones in force (:func:`current`,
:func:`override`) and the small vocabulary every launch configuration shares (:data:`Hints`, :func:`m_bucket`)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..._tiling import next_pow2


@dataclass(frozen=True)
class Heuristics:
    """The analytic heuristics' parameters (the fallback where no tuning table has an entry, see
    :mod:`tilegym_rms.cutile.tuning`). Defaults are the constants fitted on H100/H200;
    ``bench/tools/tune_cutile.py --set`` and ``bench/tools/sanitize.py`` run with other values through
    :func:`override`."""

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
    # Rows of at least this many columns take the forward that splits a row over a block per fwd_chunk_n-wide
    # chunk and reads it once ("split"), where a row's chunks do not outnumber the SMs and M's bucket is at most
    # fwd_split_max_m (0: any M); fwd_split_min_n 0: never (it trails the chunked gather from 128 rows and wins
    # only on fewer rows than SMs, PERFORMANCE.md "Wide rows").
    fwd_split_min_n: int = 0
    fwd_split_max_m: int = 0
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
    # The "tiles" forward (one row tile per block, no walk): tiles of fwd_tiles_tile_elems elements; rows of at most
    # fwd_short_max_row padded columns at fwd_tiles_short_occupancy with fwd_tiles_short_worker_warps, wider rows
    # (one or two per tile) with the gather kernel's hints for their width. The analytic choice for 16-bit rows of
    # a power-of-two width from fwd_tiles_min_row to fwd_short_max_row from fwd_tiles_min_m rows: measured on the
    # H100 within about 1% of the best candidate at 64, 128 and 256 columns and 2^18-2^22 rows, 1.00-1.04x the best
    # persistent build; padded rows (96 columns) lost to it; narrower rows were not swept (PERFORMANCE.md, "Narrow
    # rows").
    fwd_tiles_tile_elems: int = 4096
    fwd_tiles_max_tile_m: int = 64  # the tallest winner of the sweeps (64 x 64): rows of a few columns stop there
    fwd_tiles_short_occupancy: int = 8
    fwd_tiles_short_worker_warps: int = 8
    fwd_tiles_min_m: int = 1 << 18
    fwd_tiles_min_row: int = 64
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
    # Occupancy hint of the reduction (0: the compiler's). Without one the launched sm_90 build takes 255
    # registers and a 67-149 KB ring of load stages, so one block fits per SM and 160-256 strips (N =
    # 5120-8192) run in two waves; at 4 it holds 64 registers and 51 KB, four per SM, one wave up to
    # N = 16896, and on an H100 the reduction takes 3.3-4.1 us where it took 4.2-6.7 (PERFORMANCE.md, "dw
    # partials and the reduction"); other targets take the same hint unmeasured.
    reduce_occupancy: int = 4

    # QK-norm (qk_rms_norm): head dims are short (64-256), so the whole head is one tile (TILE_N =
    # next_pow2(D)) and a tile holds many rows. Widest head dim the one-tile qk kernels serve.
    qk_max_tile_n: int = 1024
    # A head dim that is not a power of two, D = TILE_N + TAIL_N with both powers of two and TAIL_N at least
    # this (80 = 64 + 16, 96 = 64 + 32), is held as a head tile and a tail tile, as the plain kernels' rows,
    # instead of one tile padded to next_pow2(D); 0 pads every head. The backward gains (its padded tile
    # spilled: +5-25% on an H200 at 2^19 rows of 80 and 96, bf16), the forward loses 2-9% (PERFORMANCE.md,
    # "QK-norm", head dims that are not a power of two).
    qk_fwd_min_tail_n: int = 0
    qk_bwd_min_tail_n: int = 16
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
    # A forward of one tile per block (a table entry's fwd_blocks_per_sm 0) runs qk_fwd_tiles_worker_warps warps,
    # as the plain forward's one-tile-per-block builds that won (PERFORMANCE.md, "Narrow rows").
    qk_fwd_tiles_worker_warps: int = 8

    # Gated RMSNorm (gated_rms_norm): a tile is rows of whole groups, each padded to next_pow2(group size); a
    # group is at most gated_max_tile_s padded columns (wider ones run the reference's torch math). Measured on
    # an H100 at 2048-8192 columns (PERFORMANCE.md, "Gated RMSNorm"): both kernels want eight worker warps at
    # occupancy 2; the forward tiles of 16384 elements up to gated_fwd_small_max_row padded columns and 8192
    # beyond, 8 blocks per SM; the backward (x, z and dy live) tiles of 8192 elements, 2 blocks per SM, but one
    # row per tile from gated_bwd_one_row_min padded columns on for a single group (two such rows spill) or an
    # fp32 gate (a row of several groups with a 16-bit gate lost at one row per tile), and from
    # gated_bwd_wide_min_row on the plain wide backward's settings, except rows of several groups with a 16-bit
    # gate whose padded groups are narrower than gated_bwd_grouped_wide_min_group (0: none), which keep the
    # settings below (on an H200, 1.18-1.74x at groups of 512-1024 columns; groups of 2048 lost 0.46x or tied,
    # an fp32 gate lost). A backward tile of several groups with a
    # 16-bit gate takes gated_bwd_grouped_worker_warps (0: the compiler's choice) instead; with the norm before
    # the gate, tile rows of gated_bwd_grouped_before_row padded columns in groups of at least
    # gated_bwd_grouped_before_min_group take gated_bwd_grouped_before_worker_warps (measured at 2048 columns in
    # groups of 64-512, and at 4096 in groups of 256 where they lost).
    gated_fwd_tile_elems: int = 16384
    gated_fwd_small_max_row: int = 2048
    gated_fwd_wide_tile_elems: int = 8192
    gated_fwd_blocks_per_sm: int = 8
    gated_bwd_tile_elems: int = 8192
    gated_bwd_one_row_min: int = 4096
    gated_bwd_blocks_per_sm: int = 2
    gated_bwd_wide_min_row: int = 8192
    gated_bwd_grouped_wide_min_group: int = 0
    # From gated_fwd_tail_min_group columns (0: never) the forward holds a group that is not a power of two as a
    # tile and a narrower tail (config.split_row: 768 = 512 + 256) rather than one padded tile, as the QK and FP8
    # kernels hold theirs (PERFORMANCE.md, "Gated RMSNorm", groups of 768).
    gated_fwd_tail_min_group: int = 0
    # The backward of tile rows of at most gated_narrow_max_row padded columns (a 128-wide head, Qwen3-Next's
    # gated norm), measured on an H100 at 2^18 rows of 128 columns with a bf16 gate (PERFORMANCE.md, "Gated
    # RMSNorm"), by where the gate applies: gated_narrow_bwd_before_* (128-row tiles, eight warps) and
    # gated_narrow_bwd_after_* (16-row tiles, the compiler's warps), both at occupancy gated_narrow_occupancy.
    # The forward of such rows runs one row tile of gated_narrow_fwd_tile_elems per block without the walk (the
    # plain forward's "tiles"; gated_narrow_fwd_walk True walks them with the general settings instead), eight
    # warps at occupancy gated_narrow_occupancy: the best build swept at 2^18 and 2^20 rows of 128 bf16 columns with
    # a bf16 gate in either order, and ahead of the walk with an fp32 gate too; other heads and x dtypes take it
    # unmeasured.
    gated_narrow_max_row: int = 256
    gated_narrow_occupancy: int = 4
    gated_narrow_fwd_walk: bool = False
    gated_narrow_fwd_tile_elems: int = 4096
    gated_narrow_bwd_before_tile_elems: int = 16384
    gated_narrow_bwd_before_blocks_per_sm: int = 8
    gated_narrow_bwd_before_worker_warps: int = 8
    gated_narrow_bwd_after_tile_elems: int = 2048
    gated_narrow_bwd_after_blocks_per_sm: int = 4
    gated_narrow_bwd_after_worker_warps: int = 0
    gated_occupancy: int = 2
    gated_worker_warps: int = 8
    gated_bwd_grouped_worker_warps: int = 0
    gated_bwd_grouped_before_row: int = 2048
    gated_bwd_grouped_before_min_group: int = 128
    gated_bwd_grouped_before_worker_warps: int = 8
    # Groups per tile: as many as fill this many padded columns (a wider group is a tile row of its own).
    gated_max_group_row: int = 8192
    gated_max_tile_s: int = 16384
    # Most rows per tile: narrow groups (a 128-wide head of Qwen3-Next) fill a tile with rows, as the qk kernels'.
    gated_max_tile_m: int = 128

    # FP8 output (rms_norm_fp8) on rows of fp8_min_row padded columns or more, measured on an H100 at 4096 and
    # 8192 columns (PERFORMANCE.md, "FP8 output"): tiles of fp8_tile_elems elements at occupancy 2, eight worker
    # warps from fp8_worker_warps_min_row padded columns (the compiler's choice below), fp8_blocks_per_sm blocks
    # per SM; with fp8_add_gather the fused add takes one row per block at every M, as the decode sizes do;
    # narrower rows take the persistent forward's settings. y_q is stored as int64 words of 8 values in the
    # per-group mode with fp8_group_word_stores and in the static and per-row modes with fp8_row_word_stores
    # (where a row is whole words): timed on an H200, words won 9-10% per group and were level or lost up to 2%
    # in the other modes. With fp8_tail a tile of one row whose width is not a power of two is held as a tile and
    # a narrower tail (config.split_row: 5120 = 4096 + 1024) rather than one padded tile: 1.05-2.0x on an H200
    # where the tile is one row, 0.73-1.06x where it is several (those keep the padded tile). In the per-group
    # mode, from fp8_group_tail_one_row_min padded columns (0: never), a row that splits so takes a tile of its own
    # in the walk, with the tail, instead of sharing a padded tile: on an H200 1.10-1.34x at 4608-6144 columns
    # and 20000-32768 rows, where the per-row and static modes lost up to 16% at 20000 rows.
    fp8_min_row: int = 2048
    fp8_tile_elems: int = 16384
    fp8_blocks_per_sm: int = 2
    fp8_occupancy: int = 2
    fp8_worker_warps: int = 8
    fp8_worker_warps_min_row: int = 8192
    fp8_add_gather: bool = True
    fp8_group_word_stores: bool = True
    fp8_row_word_stores: bool = False
    fp8_tail: bool = True
    fp8_group_tail_one_row_min: int = 0


_current = Heuristics()
_overridden: frozenset[str] = frozenset()  # the names an enclosing override() set


def current() -> Heuristics:
    """The parameters in force: the defaults, or those of an enclosing :func:`override`."""
    return _current


@contextlib.contextmanager
def override(**changes):
    """Runs the analytic heuristics with some parameters changed (``bench/tools/tune_cutile.py --set``,
    ``bench/tools/sanitize.py``); the caller clears the host caches (``tilegym_rms.cutile.clear_caches``). What it
    sets also wins over a device's table (:func:`for_device`): a sweep times the settings it names."""
    global _current, _overridden
    saved = _current, _overridden
    _current = replace(saved[0], **changes)
    _overridden = saved[1] | frozenset(changes)
    try:
        yield _current
    finally:
        _current, _overridden = saved


def for_device(changes: Mapping[str, object]) -> Heuristics:
    """The parameters in force on a device whose tuning table sets ``changes`` (its ``heuristics``, measured on
    that card): those over :func:`current`, except the names an enclosing :func:`override` set."""
    mine = {name: value for name, value in changes.items() if name not in _overridden}
    return replace(_current, **mine) if mine else _current


# Compiler hints of one kernel launch, as sorted ``(name, value)`` pairs (hashable: a cache key).
Hints = tuple[tuple[str, int], ...]


def make_hints(**values: int) -> Hints:
    """The hints that are set (0 means: leave it to the compiler)."""
    return tuple(sorted((k, v) for k, v in values.items() if v))


def m_bucket(m: int) -> int:
    """M rounded up to a power of two: configurations are cached per bucket, not per M."""
    return next_pow2(max(m, 1))
