"""The forward kernels: one row per block (gather), row tiles walked by a static-persistent grid or one per block,
and rows split over several blocks (split)."""

from __future__ import annotations

import cuda.tile as ct

from ...experimental import experimental_kernel
from .common import (
    _F32,
    ADD_PRE,
    _effective_weight,
    _effective_weights,
    _load_input,
    _normalize_as,
    _rstd_from_sum_sq,
    _rstd_of_rows,
    _sum_sq,
)


@ct.kernel
def rms_norm_fwd_gather(
    x,
    w,
    y,
    rstd,
    residual,
    res_out,
    eps,
    offset,
    TILE_N: ct.Constant[int],
    CAST: ct.Constant[int],
    HAS_W: ct.Constant[bool],
    SINGLE_TILE: ct.Constant[bool],
    STORE_RSTD: ct.Constant[bool],
    ADD: ct.Constant[int],
):
    """One row per block. ``SINGLE_TILE``: the row fits one tile and stays in registers; otherwise
    pass 1 sums squares over column chunks and pass 2 re-reads each chunk to normalize it (and, in
    fused "pre" mode, stores the sum there: pass 2 is the last to read the residual, see ``ADD``)."""
    row = ct.bid(0)
    n = x.shape[1]
    sdt = residual.dtype  # the dtype of the values normalized: the sum's (residual is x without the add)
    if SINGLE_TILE:
        xf = _load_input(x, residual, res_out, (row, 0), (1, TILE_N), ADD, ADD == ADD_PRE)
        r = _rstd_from_sum_sq(_sum_sq(xf), n, eps, CAST, sdt)
        wt = _effective_weight(w, 0, offset, TILE_N, HAS_W, CAST, sdt)
        ct.store(y, (row, 0), _normalize_as(xf, r, wt, CAST, sdt, y.dtype), allow_tma=False)
    else:
        num_chunks = ct.cdiv(n, TILE_N)
        acc = ct.zeros((1, TILE_N), dtype=_F32)
        for j in range(num_chunks):
            xf = _load_input(x, residual, res_out, (row, j), (1, TILE_N), ADD, False)
            acc = acc + xf * xf
        r = _rstd_from_sum_sq(ct.sum(acc, axis=1, keepdims=True), n, eps, CAST, sdt)
        for j in range(num_chunks):
            xf = _load_input(x, residual, res_out, (row, j), (1, TILE_N), ADD, ADD == ADD_PRE)
            wt = _effective_weight(w, j, offset, TILE_N, HAS_W, CAST, sdt)
            ct.store(y, (row, j), _normalize_as(xf, r, wt, CAST, sdt, y.dtype), allow_tma=False)
    if STORE_RSTD:
        ct.store(rstd, (row,), ct.reshape(r, (1,)))


def _forward_tile(t, x, wt, wt_tail, y, rstd, residual, res_out, eps, TILE_M, TILE_N, TAIL_N, CAST, ADD, EXACT_N):
    """Row tile ``t`` of the persistent kernel: its ``TILE_M`` rows as a tile (and a tail tile), normalized and
    stored with their rstd."""
    n = x.shape[1]
    sdt = residual.dtype  # as in rms_norm_fwd_gather
    store_sum = ADD == ADD_PRE
    xf = _load_input(x, residual, res_out, (t, 0), (TILE_M, TILE_N), ADD, store_sum)
    sum_sq = _sum_sq(xf)
    if TAIL_N:
        tail = TILE_N // TAIL_N  # the tail tile's column index
        xf_tail = _load_input(x, residual, res_out, (t, tail), (TILE_M, TAIL_N), ADD, store_sum)
        sum_sq = sum_sq + _sum_sq(xf_tail)
    r = _rstd_of_rows(sum_sq, n, eps, CAST, sdt, EXACT_N, TILE_N)
    ct.store(y, (t, 0), _normalize_as(xf, r, wt, CAST, sdt, y.dtype), allow_tma=False, latency=3)
    if TAIL_N:
        ct.store(y, (t, tail), _normalize_as(xf_tail, r, wt_tail, CAST, sdt, y.dtype), allow_tma=False, latency=3)
    ct.store(rstd, (t,), ct.reshape(r, (TILE_M,)), allow_tma=False)


@ct.kernel
def rms_norm_fwd_persistent(
    x,
    w,
    y,
    rstd,
    residual,
    res_out,
    eps,
    offset,
    TILE_M: ct.Constant[int],
    TILE_N: ct.Constant[int],
    TAIL_N: ct.Constant[int],
    CAST: ct.Constant[int],
    HAS_W: ct.Constant[bool],
    ADD: ct.Constant[int],
    EXACT_N: ct.Constant[bool],
    WALK: ct.Constant[bool],
):
    """``TILE_M x TILE_N`` row tiles (``TILE_N >= N``), or rows held as a tile plus a narrower tail tile
    (``TAIL_N > 0``: columns ``[TILE_N, TILE_N + TAIL_N)``, as in the backward), the weight loaded once per
    block. ``WALK``: static persistent, the block grid-strides over the row tiles (the compiler keeps the next
    tiles' loads in flight in a ring of shared-memory stages); otherwise the block runs tile ``bid(0)`` alone
    (a grid of one block per tile: no loop, no ring, so many small blocks each keep their own loads in flight;
    the config's ``"tiles"`` kernel, PERFORMANCE.md "Narrow rows"). ``EXACT_N``: N is ``TILE_N``
    (``_rstd_of_rows``)."""
    sdt = residual.dtype
    wt, wt_tail = _effective_weights(w, offset, TILE_N, TAIL_N, HAS_W, CAST, sdt)
    consts = (TILE_M, TILE_N, TAIL_N, CAST, ADD, EXACT_N)
    if WALK:
        for t in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
            _forward_tile(t, x, wt, wt_tail, y, rstd, residual, res_out, eps, *consts)
    else:
        _forward_tile(ct.bid(0), x, wt, wt_tail, y, rstd, residual, res_out, eps, *consts)


@experimental_kernel
@ct.kernel
def rms_norm_fwd_split(
    x,
    w,
    y,
    rstd,
    residual,
    res_out,
    partial,
    ticket,
    eps,
    offset,
    TILE_N: ct.Constant[int],
    CHUNKS: ct.Constant[int],
    CHUNKS_P2: ct.Constant[int],
    CAST: ct.Constant[int],
    HAS_W: ct.Constant[bool],
    ADD: ct.Constant[int],
):
    """A row of ``CHUNKS`` column chunks of ``TILE_N`` over as many blocks, so that x is read once however wide
    the row (the chunked gather reads it twice). A block takes the next (row, chunk) in start order from
    ``ticket`` (one int32, zero at launch), keeps its chunk on chip, publishes its sum of squares in ``partial``
    (``CHUNKS_P2`` fp32 slots per row, -1 at launch: a sum of squares is never negative, so a slot holds its value
    or says it has none yet), waits until the row's other chunks have published theirs, adds them in slot order
    (every block of a row gets the same rstd, whatever the order the blocks ran in), and normalizes its chunk.
    Taking chunks in start order means the blocks a block waits for have started or start next: with at least
    ``CHUNKS`` blocks resident at once (the host checks the SM count) a row always completes."""
    t = ct.atomic_add(ticket, 0, 1, memory_order=ct.MemoryOrder.RELAXED)
    row = t // CHUNKS
    chunk = t % CHUNKS
    n = x.shape[1]
    sdt = residual.dtype  # as in rms_norm_fwd_gather
    xf = _load_input(x, residual, res_out, (row, chunk), (1, TILE_N), ADD, ADD == ADD_PRE)
    ct.atomic_xchg(partial, row * CHUNKS_P2 + chunk, ct.sum(xf * xf), memory_order=ct.MemoryOrder.RELEASE)
    slots = ct.arange(CHUNKS_P2, dtype=ct.int32)
    mine = slots < CHUNKS
    row_slots = row * CHUNKS_P2 + slots
    sums = ct.atomic_add(partial, row_slots, 0.0, memory_order=ct.MemoryOrder.ACQUIRE)
    while ct.min(ct.where(mine, sums, 0.0)) < 0.0:  # read again until every chunk of the row has published
        sums = ct.atomic_add(partial, row_slots, 0.0, memory_order=ct.MemoryOrder.ACQUIRE)
    sum_sq = ct.reshape(ct.sum(ct.where(mine, sums, 0.0)), (1, 1))
    r = _rstd_from_sum_sq(sum_sq, n, eps, CAST, sdt)
    wt = _effective_weight(w, chunk, offset, TILE_N, HAS_W, CAST, sdt)
    ct.store(y, (row, chunk), _normalize_as(xf, r, wt, CAST, sdt, y.dtype), allow_tma=False)
    ct.store(rstd, (row,), ct.reshape(r, (1,)), allow_tma=False)  # the same value from each of the row's blocks
