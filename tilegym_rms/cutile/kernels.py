"""cuTile RMSNorm kernels.

Every kernel works on a 2-D view ``(M, N)`` whose rows may be strided (the last dim is dense).
Out-of-range columns are loaded as zeros, so padding never changes a sum of squares, a row dot
product or a dw column. Compile-time constants:

* ``TILE_M`` / ``TILE_N``: tile shape (powers of two); ``TILE_N >= N`` in the single-tile kernels.
* ``CAST``: casting mode (:data:`CAST_LLAMA`, :data:`CAST_GEMMA`, :data:`CAST_NONE`).
* ``HAS_W``: False for RMSNorm without affine (the weight argument is then a dummy).
* ``STORE_RSTD`` (gather forward): False when no backward will follow (inference); ``rstd`` is then a
  dummy (the output ``y``), which spares the host an allocation per call. The persistent forward
  always stores rstd, fused add included: without the store its fp32 code ran 5-8% slower
  (PERFORMANCE.md, "Forward"), and at the sizes it serves the allocation does not matter.
* ``ADD`` (forward): the fused residual add, :data:`ADD_NONE`, :data:`ADD_PRE` or :data:`ADD_POST`. The
  kernel normalizes ``s = x + residual``, summed in fp32 and rounded to ``residual``'s dtype (exactly
  :func:`tilegym_rms.reference.fused_add_sum`); the casting mode rounds in that dtype and ``y`` gets
  x's. "pre" also stores ``s`` into ``res_out``. Without the add, ``residual`` is ``x`` and ``res_out``
  ``y`` (dummies, never read or written). ``res_out`` may be ``residual`` itself (the in-place
  variant): every element of ``residual`` is read for the last time in the step that writes its
  ``s``, so the write never precedes a read of the same element.
* ``DW_PER_ROW`` (persistent backward): the block's fp32 dw share is kept as one accumulator per tile row,
  summed over the rows once at the end, instead of a ``(1, TILE_N)`` accumulator that each row tile is
  summed into. The per-step sum over the tile's rows is a reduction across the block's threads; for short
  rows with many rows per tile that reduction, not the loads, sets the pace of a step. It costs
  ``TILE_M x TILE_N`` more fp32 registers. Summation order changes with it, still fixed (deterministic).
* ``HAS_DRES`` (backward): adds ``dres``, the gradient of a fused add's ``residual_out`` (mode "pre"),
  to dx in fp32 before its one rounding, so that ``ds`` is written once; else ``dres`` is a dummy.

``eps`` and ``offset`` are run-time scalars so that changing them never recompiles.
"""

from __future__ import annotations

import cuda.tile as ct

from ..experimental import experimental_kernel
from ..reference import CASTING_CODES

CAST_LLAMA, CAST_GEMMA, CAST_NONE = (CASTING_CODES[m] for m in ("llama", "gemma", "none"))
# The forward's ADD switch: no residual add, the fused add storing the sum ("pre"), or not ("post").
ADD_NONE, ADD_PRE, ADD_POST = 0, 1, 2

_ZERO = ct.PaddingMode.ZERO
_F32 = ct.float32


# ----------------------------------------------------------------------------------------------
# Shared tile helpers (inlined into each kernel)
# ----------------------------------------------------------------------------------------------


def _round_to(t, dtype):
    """Round an fp32 tile through ``dtype`` and back: models a computation done in ``dtype``."""
    return ct.astype(ct.astype(t, dtype), _F32)


def _load_f32(array, index, shape, latency):
    return ct.astype(ct.load(array, index, shape, padding_mode=_ZERO, latency=latency), _F32)


def _load_input(x, residual, res_out, index, shape, ADD, STORE_SUM):
    """The row values the forward normalizes, fp32: ``x``, or with ``ADD`` the sum ``x + residual``
    rounded to residual's dtype (what torch's add stores), stored into ``res_out`` when ``STORE_SUM``."""
    xf = _load_f32(x, index, shape, 10)
    if ADD == ADD_NONE:
        return xf
    s = ct.astype(xf + _load_f32(residual, index, shape, 10), residual.dtype)
    if STORE_SUM:
        ct.store(res_out, index, s, allow_tma=False)
    return ct.astype(s, _F32)


def _offset_weight(wt, offset, CAST, dtype):
    """``offset + w`` of a loaded fp32 weight tile, rounded to ``dtype`` in ``none`` mode."""
    wt = wt + offset
    if CAST == CAST_NONE:
        return _round_to(wt, dtype)
    return wt


def _effective_weight(w, chunk, offset, TILE_N, HAS_W, CAST, dtype):
    """``offset + w`` for one column chunk as a ``(1, TILE_N)`` fp32 tile (ones without a weight)."""
    if HAS_W:
        return _offset_weight(ct.reshape(_load_f32(w, (chunk,), (TILE_N,), None), (1, TILE_N)), offset, CAST, dtype)
    return ct.full((1, TILE_N), 1.0, dtype=_F32)


def _sum_sq(xf):
    """Per-row sum of squares of an fp32 tile, as a ``(rows, 1)`` column."""
    return ct.sum(xf * xf, axis=1, keepdims=True)


def _rstd_from_sum_sq(sum_sq, n, eps, CAST, dtype):
    """``1 / sqrt(sum_sq / n + eps)`` in fp32; ``none`` mode rounds rstd to ``dtype`` (the mean square
    stays fp32: in fp16 it would overflow)."""
    r = ct.rsqrt(sum_sq / n + eps)
    if CAST == CAST_NONE:
        return _round_to(r, dtype)
    return r


def _normalize(xf, r, wt, CAST, dtype):
    """``y = x * rstd * w~`` with the casting mode's roundings, returned in ``dtype``."""
    if CAST == CAST_GEMMA:
        return ct.astype(xf * r * wt, dtype)
    return ct.astype(_round_to(xf * r, dtype) * wt, dtype)


def _normalize_as(xf, r, wt, CAST, dtype, out_dtype):
    """:func:`_normalize` rounded in ``dtype`` (a fused add's sum), then cast to ``out_dtype`` (x's):
    the reference's ``rms_norm_forward(s).to(x.dtype)``; a no-op cast without the add."""
    return ct.astype(_normalize(xf, r, wt, CAST, dtype), out_dtype)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


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
):
    """Static persistent: the weight is loaded once per block, which then grid-strides over
    ``TILE_M x TILE_N`` row tiles (``TILE_N >= N``), or over rows held as a tile plus a narrower tail
    tile (``TAIL_N > 0``: columns ``[TILE_N, TILE_N + TAIL_N)``, as in the backward)."""
    n = x.shape[1]
    sdt = residual.dtype  # as in rms_norm_fwd_gather
    store_sum = ADD == ADD_PRE
    wt = _effective_weight(w, 0, offset, TILE_N, HAS_W, CAST, sdt)
    if TAIL_N:
        tail = TILE_N // TAIL_N  # the tail tile's column index
        wt_tail = _effective_weight(w, tail, offset, TAIL_N, HAS_W, CAST, sdt)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
        xf = _load_input(x, residual, res_out, (t, 0), (TILE_M, TILE_N), ADD, store_sum)
        sum_sq = _sum_sq(xf)
        if TAIL_N:
            xf_tail = _load_input(x, residual, res_out, (t, tail), (TILE_M, TAIL_N), ADD, store_sum)
            sum_sq = sum_sq + _sum_sq(xf_tail)
        r = _rstd_from_sum_sq(sum_sq, n, eps, CAST, sdt)
        ct.store(y, (t, 0), _normalize_as(xf, r, wt, CAST, sdt, y.dtype), allow_tma=False, latency=3)
        if TAIL_N:
            y_tail = _normalize_as(xf_tail, r, wt_tail, CAST, sdt, y.dtype)
            ct.store(y, (t, tail), y_tail, allow_tma=False, latency=3)
        ct.store(rstd, (t,), ct.reshape(r, (TILE_M,)), allow_tma=False)


# ----------------------------------------------------------------------------------------------
# Backward: dx = rstd * (g - x^ * mean(x^ * g)),  g = w~ * dy,  x^ = x * rstd;  dw = sum_rows dy * x^
# ----------------------------------------------------------------------------------------------


def _load_row_values(values, t, TILE_M):
    """One value per row (rstd, row dot) of row tile ``t``, as a ``(TILE_M, 1)`` column."""
    return ct.reshape(ct.load(values, (t,), (TILE_M,), padding_mode=_ZERO), (TILE_M, 1))


def _xhat_and_dy(x, dy, r, t, chunk, TILE_M, TILE_N):
    """``x^ = x * rstd`` and ``dy`` of one ``TILE_M x TILE_N`` tile (column chunk ``chunk``), fp32."""
    xhat = _load_f32(x, (t, chunk), (TILE_M, TILE_N), 10) * r
    return xhat, _load_f32(dy, (t, chunk), (TILE_M, TILE_N), 10)


def _row_dot(xhat, g):
    return ct.sum(xhat * g, axis=1, keepdims=True)


def _dw_rows(dyf, xhat):
    return ct.sum(dyf * xhat, axis=0, keepdims=True)


def _dw_zeros(TILE_M, TILE_N, DW_PER_ROW):
    """A block's dw accumulator: ``(TILE_M, TILE_N)`` with ``DW_PER_ROW``, else ``(1, TILE_N)``."""
    if DW_PER_ROW:
        return ct.zeros((TILE_M, TILE_N), dtype=_F32)
    return ct.zeros((1, TILE_N), dtype=_F32)


def _dw_add(acc, dyf, xhat, DW_PER_ROW):
    """``acc`` plus one row tile's dw share (see ``DW_PER_ROW``)."""
    if DW_PER_ROW:
        return acc + dyf * xhat
    return acc + _dw_rows(dyf, xhat)


def _dw_total(acc, DW_PER_ROW):
    """The block's dw share as a ``(1, TILE_N)`` row."""
    if DW_PER_ROW:
        return ct.sum(acc, axis=0, keepdims=True)
    return acc


def _dx(g, xhat, c, r, dres, index, shape, HAS_DRES, dtype):
    """``dx = rstd * (g - x^ * c)`` with ``c`` the row's ``mean(x^ * g)``, in ``dtype``; with ``HAS_DRES``
    plus tile ``index`` of ``dres`` (a fused add's ``ds``), added before the one rounding."""
    dx = (g - xhat * c) * r
    if HAS_DRES:
        dx = dx + _load_f32(dres, index, shape, 10)
    return ct.astype(dx, dtype)


@experimental_kernel
@ct.kernel
def rms_norm_bwd_persistent(
    dy,
    x,
    w,
    rstd,
    dx,
    dw_partial,
    dres,
    offset,
    TILE_M: ct.Constant[int],
    TILE_N: ct.Constant[int],
    TAIL_N: ct.Constant[int],
    HAS_W: ct.Constant[bool],
    HAS_DRES: ct.Constant[bool],
    DW_PER_ROW: ct.Constant[bool],
):
    """Rows fit one tile (``TILE_N >= N``), or one tile plus a narrower tail tile (``TAIL_N > 0``: columns
    ``[TILE_N, TILE_N + TAIL_N)``), so that e.g. N = 5120 is held as 4096 + 1024 rather than padded to 8192
    (the padding costs registers, and with them the blocks per SM). Each block grid-strides over row tiles,
    writes dx, and keeps its share of dw in fp32 registers; at the end it writes row ``bid`` of
    ``dw_partial``."""
    n = x.shape[1]
    wt = _effective_weight(w, 0, offset, TILE_N, HAS_W, CAST_GEMMA, x.dtype)
    dw_acc = _dw_zeros(TILE_M, TILE_N, DW_PER_ROW)
    if TAIL_N:
        tail = TILE_N // TAIL_N  # the tail tile's column index
        wt_tail = _effective_weight(w, tail, offset, TAIL_N, HAS_W, CAST_GEMMA, x.dtype)
        dw_acc_tail = _dw_zeros(TILE_M, TAIL_N, DW_PER_ROW)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
        r = _load_row_values(rstd, t, TILE_M)
        xhat, dyf = _xhat_and_dy(x, dy, r, t, 0, TILE_M, TILE_N)
        g = dyf * wt
        dot = _row_dot(xhat, g)
        if TAIL_N:
            xhat_tail, dyf_tail = _xhat_and_dy(x, dy, r, t, tail, TILE_M, TAIL_N)
            g_tail = dyf_tail * wt_tail
            dot = dot + _row_dot(xhat_tail, g_tail)
        c = dot / n
        dx_head = _dx(g, xhat, c, r, dres, (t, 0), (TILE_M, TILE_N), HAS_DRES, dx.dtype)
        ct.store(dx, (t, 0), dx_head, allow_tma=False, latency=3)
        if TAIL_N:
            dx_tail = _dx(g_tail, xhat_tail, c, r, dres, (t, tail), (TILE_M, TAIL_N), HAS_DRES, dx.dtype)
            ct.store(dx, (t, tail), dx_tail, allow_tma=False, latency=3)
        if HAS_W:
            dw_acc = _dw_add(dw_acc, dyf, xhat, DW_PER_ROW)
            if TAIL_N:
                dw_acc_tail = _dw_add(dw_acc_tail, dyf_tail, xhat_tail, DW_PER_ROW)
    if HAS_W:
        ct.store(dw_partial, (ct.bid(0), 0), _dw_total(dw_acc, DW_PER_ROW), allow_tma=False)
        if TAIL_N:
            ct.store(dw_partial, (ct.bid(0), tail), _dw_total(dw_acc_tail, DW_PER_ROW), allow_tma=False)


@experimental_kernel
@ct.kernel
def rms_norm_bwd_direct(
    dy,
    x,
    w,
    rstd,
    dx,
    dw,
    dres,
    offset,
    TILE_M: ct.Constant[int],
    TILE_N: ct.Constant[int],
    STRIP_N: ct.Constant[int],
    STRIP_M: ct.Constant[int],
    SINGLE_TILE: ct.Constant[bool],
    HAS_W: ct.Constant[bool],
    HAS_DRES: ct.Constant[bool],
):
    """Few rows, one launch, no partial buffer: the first ``cdiv(M, TILE_M)`` blocks each write dx for one
    ``TILE_M x TILE_N`` row tile (``SINGLE_TILE``: ``TILE_N >= N``; otherwise over column chunks, the row dot
    in a first pass, dx in a second); each further block owns a ``STRIP_N``-wide column strip of dw and sums
    ``dy * x^`` over all M rows, ``STRIP_M`` rows per step, in a fixed order. The strips read x and dy a
    second time, which at small M costs less than a second launch. No block loops over row tiles, so a row's
    dx is computed by the same code at every M (the batch-invariant mode's backward)."""
    n = x.shape[1]
    row_tiles = ct.cdiv(x.shape[0], TILE_M)
    b = ct.bid(0)
    if b < row_tiles:
        r = _load_row_values(rstd, b, TILE_M)
        if SINGLE_TILE:
            wt = _effective_weight(w, 0, offset, TILE_N, HAS_W, CAST_GEMMA, x.dtype)
            xhat, dyf = _xhat_and_dy(x, dy, r, b, 0, TILE_M, TILE_N)
            g = dyf * wt
            c = _row_dot(xhat, g) / n
            dx_tile = _dx(g, xhat, c, r, dres, (b, 0), (TILE_M, TILE_N), HAS_DRES, dx.dtype)
            ct.store(dx, (b, 0), dx_tile, allow_tma=False)
        else:
            num_chunks = ct.cdiv(n, TILE_N)
            acc = ct.zeros((TILE_M, TILE_N), dtype=_F32)
            for j in range(num_chunks):
                xhat, dyf = _xhat_and_dy(x, dy, r, b, j, TILE_M, TILE_N)
                acc = acc + xhat * (dyf * _effective_weight(w, j, offset, TILE_N, HAS_W, CAST_GEMMA, x.dtype))
            c = ct.sum(acc, axis=1, keepdims=True) / n
            for j in range(num_chunks):
                xhat, dyf = _xhat_and_dy(x, dy, r, b, j, TILE_M, TILE_N)
                g = dyf * _effective_weight(w, j, offset, TILE_N, HAS_W, CAST_GEMMA, x.dtype)
                dx_chunk = _dx(g, xhat, c, r, dres, (b, j), (TILE_M, TILE_N), HAS_DRES, dx.dtype)
                ct.store(dx, (b, j), dx_chunk, allow_tma=False)
    elif HAS_W:
        strip = b - row_tiles
        acc = ct.zeros((STRIP_M, STRIP_N), dtype=_F32)
        for t in range(ct.cdiv(x.shape[0], STRIP_M)):
            xhat, dyf = _xhat_and_dy(x, dy, _load_row_values(rstd, t, STRIP_M), t, strip, STRIP_M, STRIP_N)
            acc = acc + dyf * xhat
        ct.store(dw, (strip,), ct.astype(ct.sum(acc, axis=0), dw.dtype))


@experimental_kernel
@ct.kernel
def rms_norm_bwd_row_dot(
    dy, x, w, rstd, row_dot, offset, TILE_M: ct.Constant[int], TILE_N: ct.Constant[int], HAS_W: ct.Constant[bool]
):
    """Wide rows, step 1 of 2: ``row_dot[m] = mean(x^ * w~ * dy)`` over column chunks."""
    n = x.shape[1]
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
        r = _load_row_values(rstd, t, TILE_M)
        acc = ct.zeros((TILE_M, TILE_N), dtype=_F32)
        for j in range(ct.cdiv(n, TILE_N)):
            wt = _effective_weight(w, j, offset, TILE_N, HAS_W, CAST_GEMMA, x.dtype)
            acc = acc + _load_f32(x, (t, j), (TILE_M, TILE_N), 10) * _load_f32(dy, (t, j), (TILE_M, TILE_N), 10) * wt
        ct.store(row_dot, (t,), ct.reshape(ct.sum(acc, axis=1, keepdims=True) * r / n, (TILE_M,)))


@experimental_kernel
@ct.kernel
def rms_norm_bwd_column_chunk(
    dy,
    x,
    w,
    rstd,
    row_dot,
    dx,
    dw_partial,
    dres,
    offset,
    TILE_M: ct.Constant[int],
    TILE_N: ct.Constant[int],
    HAS_W: ct.Constant[bool],
    HAS_DRES: ct.Constant[bool],
):
    """Wide rows, step 2 of 2: block ``(b, j)`` owns column chunk ``j`` and grid-strides over row
    tiles along axis 0; it writes dx for its chunk and its dw share into ``dw_partial[b, chunk j]``."""
    j = ct.bid(1)
    wt = _effective_weight(w, j, offset, TILE_N, HAS_W, CAST_GEMMA, x.dtype)
    dw_acc = ct.zeros((1, TILE_N), dtype=_F32)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
        r = _load_row_values(rstd, t, TILE_M)
        xhat, dyf = _xhat_and_dy(x, dy, r, t, j, TILE_M, TILE_N)
        c = _load_row_values(row_dot, t, TILE_M)
        dx_chunk = _dx(dyf * wt, xhat, c, r, dres, (t, j), (TILE_M, TILE_N), HAS_DRES, dx.dtype)
        ct.store(dx, (t, j), dx_chunk, allow_tma=False, latency=3)
        if HAS_W:
            dw_acc = dw_acc + _dw_rows(dyf, xhat)
    if HAS_W:
        ct.store(dw_partial, (ct.bid(0), j), dw_acc, allow_tma=False)


@experimental_kernel
@ct.kernel
def rms_norm_dw_reduce(dw_partial, dw, TILE_G: ct.Constant[int], TILE_N: ct.Constant[int]):
    """Final reduction: ``dw[cols] = sum over the partial rows``, in a fixed order (deterministic),
    cast to the weight dtype. Block ``j`` owns column chunk ``j``."""
    j = ct.bid(0)
    acc = ct.zeros((TILE_G, TILE_N), dtype=_F32)
    for g in range(ct.cdiv(dw_partial.shape[0], TILE_G)):
        acc = acc + ct.load(dw_partial, (g, j), (TILE_G, TILE_N), padding_mode=_ZERO)
    ct.store(dw, (j,), ct.astype(ct.sum(acc, axis=0), dw.dtype))


# ----------------------------------------------------------------------------------------------
# QK-norm (qk_rms_norm): q and k normalized in one launch, forward and backward
#
# Each tensor arrives as a 4-D view ``(A, G, H, D)`` with a dense last dim and any strides in its first three
# dims: the runs of memory its layout has (one run for a dense tensor, ``(1, 1, M, D)``; tokens and heads for a
# slice of a fused qkv output; batch, tokens and heads for a gradient handed back from a ``(B, H, S, D)``
# consumer). The tensors of one side (q, its output, its gradients) share one shape, each with its own strides.
# A tile is ``(1, TILE_G, TILE_H, TILE_N)``, TILE_G x TILE_H rows: a run of heads of a run of tokens, which
# reads pieces of TILE_H rows where H is the contiguous dim and of TILE_G rows where G is. Tile ``t`` is
# ``(a, g, h)`` with h fastest, so consecutive tiles read neighbouring heads of the same tokens. The blocks of
# one persistent grid stride over the tiles of q, then carry on, in the same global order, over those of k;
# q and k have tiles of their own (their head counts differ). ``rstd`` is an ``(A, G, H)`` array.
# ----------------------------------------------------------------------------------------------


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


def _qk_fwd_tile(x, wt, y, rstd, t, eps, TILE_G, TILE_H, TILE_N, CAST):
    a, g, h = _qk_tile_index(x, t, TILE_G, TILE_H)
    xf = _load_head_rows(x, a, g, h, TILE_G, TILE_H, TILE_N)
    r = _rstd_from_sum_sq(_sum_sq(xf), x.shape[3], eps, CAST, x.dtype)
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
):
    """Both weights are loaded once per block; then the block normalizes its q tiles and its k tiles
    (``TILE_N >= D``), storing rstd of every row."""
    wtq = _effective_weight(wq, 0, offset, TILE_N, HAS_WQ, CAST, q.dtype)
    wtk = _effective_weight(wk, 0, offset, TILE_N, HAS_WK, CAST, k.dtype)
    num_q_tiles = _qk_num_tiles(q, TILE_GQ, TILE_HQ)
    for t in range(ct.bid(0), num_q_tiles, ct.num_blocks(0)):
        _qk_fwd_tile(q, wtq, yq, rstd_q, t, eps, TILE_GQ, TILE_HQ, TILE_N, CAST)
    for t in range(_first_k_tile(num_q_tiles), _qk_num_tiles(k, TILE_GK, TILE_HK), ct.num_blocks(0)):
        _qk_fwd_tile(k, wtk, yk, rstd_k, t, eps, TILE_GK, TILE_HK, TILE_N, CAST)


def _qk_bwd_tile(dy, x, wt, rstd, dx, dw_acc, t, TILE_G, TILE_H, TILE_N, HAS_W):
    """dx of one tile; returns ``dw_acc`` plus the tile's dw share (unchanged without a weight)."""
    a, g, h = _qk_tile_index(x, t, TILE_G, TILE_H)
    rows = TILE_G * TILE_H
    r = ct.reshape(ct.load(rstd, (a, g, h), (1, TILE_G, TILE_H), padding_mode=_ZERO), (rows, 1))
    xhat = _load_head_rows(x, a, g, h, TILE_G, TILE_H, TILE_N) * r
    dyf = _load_head_rows(dy, a, g, h, TILE_G, TILE_H, TILE_N)
    gw = dyf * wt
    c = _row_dot(xhat, gw) / x.shape[3]
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
    num_q_tiles = _qk_num_tiles(q, TILE_GQ, TILE_HQ)
    for t in range(ct.bid(0), num_q_tiles, ct.num_blocks(0)):
        acc_q = _qk_bwd_tile(dyq, q, wtq, rstd_q, dq, acc_q, t, TILE_GQ, TILE_HQ, TILE_N, HAS_WQ)
    for t in range(_first_k_tile(num_q_tiles), _qk_num_tiles(k, TILE_GK, TILE_HK), ct.num_blocks(0)):
        acc_k = _qk_bwd_tile(dyk, k, wtk, rstd_k, dk, acc_k, t, TILE_GK, TILE_HK, TILE_N, HAS_WK)
    if HAS_WQ:
        ct.store(dw_partial, (ct.bid(0), 0, 0), ct.reshape(acc_q, (1, 1, TILE_N)), allow_tma=False)
    if HAS_WK:
        ct.store(dw_partial, (ct.bid(0), 1, 0), ct.reshape(acc_k, (1, 1, TILE_N)), allow_tma=False)


# ----------------------------------------------------------------------------------------------
# Gated RMSNorm (gated_rms_norm): with s = silu(z), y = rms_norm(x) * w~ * s (NORM_BEFORE_GATE) or
# y = rms_norm(x * s) * w~, each group of columns normalized with its own rstd
#
# x, z, y and their gradients arrive as 3-D ``(M, G, S)`` views of the ``(M, N)`` rows (G groups of S
# columns; one group: G = 1, S = N), the weight as ``(G, S)``, rstd as ``(M, G)``. A tile is ``TILE_M`` rows of
# ``TILE_G`` whole groups, each padded to ``TILE_S = next_pow2(S)``: a group of any size fills its own tile
# axis (padding loads zeros, which add nothing to a sum of squares), so no group straddles two tiles and a
# group's sum is one reduction over axis 2. Grid axis 1 is the chunk of ``TILE_G`` groups a block owns (its
# weight stays in registers); axis 0 grid-strides over row tiles. The casting mode rounds as the reference's
# gated_rms_norm_forward.
# ----------------------------------------------------------------------------------------------


def _gated_weight(w, chunk, offset, TILE_G, TILE_S, HAS_W, CAST, dtype):
    """``offset + w`` for group chunk ``chunk`` as a ``(1, TILE_G, TILE_S)`` fp32 tile (ones without a weight)."""
    if HAS_W:
        wt = ct.reshape(_load_f32(w, (chunk, 0), (TILE_G, TILE_S), None), (1, TILE_G, TILE_S))
        return _offset_weight(wt, offset, CAST, dtype)
    return ct.full((1, TILE_G, TILE_S), 1.0, dtype=_F32)


def _silu_and_slope(zf):
    """``silu(z)`` and its derivative ``sigmoid(z) * (1 + z * (1 - sigmoid(z)))``, fp32; silu as torch writes it,
    ``z / (1 + exp(-z))`` (reference._silu_and_slope)."""
    e = 1.0 + ct.exp(-zf)
    sig = 1.0 / e
    return zf / e, sig * (1.0 + zf * (1.0 - sig))


def _gate(zf, CAST, dtype):
    """``silu(z)`` as the forward uses it: fp32, or in ``none`` mode taken of z in ``dtype`` and rounded."""
    if CAST == CAST_NONE:
        return _round_to(_silu_and_slope(_round_to(zf, dtype))[0], dtype)
    return _silu_and_slope(zf)[0]


def _gated_input(xf, s, CAST, NORM_BEFORE_GATE, dtype):
    """The values normalized: ``x``, or ``x * s`` (rounded to ``dtype`` in ``none`` mode)."""
    if NORM_BEFORE_GATE:
        return xf
    if CAST == CAST_NONE:
        return _round_to(xf * s, dtype)
    return xf * s


def _gated_output(h, r, wt, s, CAST, NORM_BEFORE_GATE, dtype):
    """``y`` in ``dtype``: :func:`_normalize`, times the gate after it (fp32 in gemma mode, after the norm's
    rounding otherwise)."""
    if not NORM_BEFORE_GATE:
        return _normalize(h, r, wt, CAST, dtype)
    if CAST == CAST_GEMMA:
        return ct.astype(h * r * wt * s, dtype)
    return ct.astype(ct.astype(_normalize(h, r, wt, CAST, dtype), _F32) * s, dtype)


@experimental_kernel
@ct.kernel
def gated_rms_norm_fwd(
    x,
    z,
    w,
    y,
    rstd,
    eps,
    offset,
    TILE_M: ct.Constant[int],
    TILE_G: ct.Constant[int],
    TILE_S: ct.Constant[int],
    CAST: ct.Constant[int],
    HAS_W: ct.Constant[bool],
    NORM_BEFORE_GATE: ct.Constant[bool],
    STORE_RSTD: ct.Constant[bool],
):
    """One read of x and z, one write of y (and of rstd with ``STORE_RSTD``; else ``rstd`` is a dummy)."""
    chunk = ct.bid(1)
    shape = (TILE_M, TILE_G, TILE_S)
    wt = _gated_weight(w, chunk, offset, TILE_G, TILE_S, HAS_W, CAST, x.dtype)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
        s = _gate(_load_f32(z, (t, chunk, 0), shape, 10), CAST, x.dtype)
        h = _gated_input(_load_f32(x, (t, chunk, 0), shape, 10), s, CAST, NORM_BEFORE_GATE, x.dtype)
        r = _rstd_from_sum_sq(ct.sum(h * h, axis=2, keepdims=True), x.shape[2], eps, CAST, x.dtype)
        out = _gated_output(h, r, wt, s, CAST, NORM_BEFORE_GATE, y.dtype)
        ct.store(y, (t, chunk, 0), out, allow_tma=False, latency=3)
        if STORE_RSTD:
            ct.store(rstd, (t, chunk), ct.reshape(r, (TILE_M, TILE_G)), allow_tma=False)


@experimental_kernel
@ct.kernel
def gated_rms_norm_bwd(
    dy,
    x,
    z,
    w,
    rstd,
    dx,
    dz,
    dw_partial,
    offset,
    TILE_M: ct.Constant[int],
    TILE_G: ct.Constant[int],
    TILE_S: ct.Constant[int],
    HAS_W: ct.Constant[bool],
    NORM_BEFORE_GATE: ct.Constant[bool],
):
    """dx, dz and the block's dw share in one pass over x, z and dy. With ``n = h * rstd`` the normalized
    values and ``dn`` the gradient of ``n * w~`` (``dy * s`` before the gate, ``dy`` after it):
    ``dh = rstd * (w~ dn - n * mean(n * w~ dn))`` per group, ``dw += sum_rows dn * n``; before the gate
    ``dx = dh``, ``dz = dy * n * w~ * silu'(z)``, after it ``dx = dh * s``, ``dz = dh * x * silu'(z)``. dw
    goes to row ``bid(0)`` of ``dw_partial`` (a ``(grid, G, S)`` view of ``(grid, N)``), which
    ``rms_norm_dw_reduce`` sums in a fixed order (deterministic)."""
    chunk = ct.bid(1)
    shape = (TILE_M, TILE_G, TILE_S)
    wt = _gated_weight(w, chunk, offset, TILE_G, TILE_S, HAS_W, CAST_GEMMA, x.dtype)
    dw_acc = ct.zeros((1, TILE_G, TILE_S), dtype=_F32)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
        r = ct.reshape(ct.load(rstd, (t, chunk), (TILE_M, TILE_G), padding_mode=_ZERO), (TILE_M, TILE_G, 1))
        xf = _load_f32(x, (t, chunk, 0), shape, 10)
        dyf = _load_f32(dy, (t, chunk, 0), shape, 10)
        s, slope = _silu_and_slope(_load_f32(z, (t, chunk, 0), shape, 10))
        n = (xf if NORM_BEFORE_GATE else xf * s) * r
        dn = dyf * s if NORM_BEFORE_GATE else dyf
        if HAS_W:
            dw_acc = dw_acc + ct.sum(dn * n, axis=0, keepdims=True)
        g = dn * wt
        c = ct.sum(g * n, axis=2, keepdims=True) / x.shape[2]
        dh = _dx(g, n, c, r, dx, (0, 0, 0), shape, False, _F32)  # no residual gradient: dx stands in for dres
        if NORM_BEFORE_GATE:
            dxv, dzv = dh, dyf * n * wt * slope
        else:
            dxv, dzv = dh * s, dh * xf * slope
        ct.store(dx, (t, chunk, 0), ct.astype(dxv, dx.dtype), allow_tma=False, latency=3)
        ct.store(dz, (t, chunk, 0), ct.astype(dzv, dz.dtype), allow_tma=False, latency=3)
    if HAS_W:
        ct.store(dw_partial, (ct.bid(0), chunk, 0), dw_acc, allow_tma=False)


# ----------------------------------------------------------------------------------------------
# FP8 output (rms_norm_fp8, fused_add_rms_norm_fp8): the norm's y, rounded to x's dtype, quantized in the same
# pass (reference.quantize_fp8). QUANT: a static scale, dynamic per-row scales, or per group of GROUP columns
# (scales shaped (M, cdiv(N, GROUP))). A block owns TILE_M whole rows (TILE_N >= N) and loops over nothing, so
# a row's code never depends on M. Padded columns load as zeros, whose y is 0: they never raise an amax, and
# the stores drop them (and the scales of groups past the row's end).
# ----------------------------------------------------------------------------------------------

QUANT_STATIC, QUANT_TOKEN, QUANT_GROUP = 0, 1, 2


def _pow2_ceil(s):
    """The smallest power of two ``>= s`` (a UE8M0 scale), exactly: reference.pow2_ceil's carry into the
    exponent. ``ct.log2`` could round ``log2`` of a scale just above a power of two down to an integer."""
    bits = ct.bitwise_and(ct.bitcast(s, ct.int32) + 0x7FFFFF, 0x7F800000)
    return ct.where(ct.isnan(s), s, ct.bitcast(bits, _F32))


def _dynamic_scale(amax, ub, fp8_max, amax_floor, HAS_UB, UE8M0):
    """``max(min(amax, ub), floor) / fp8_max`` (a true division), rounded up to a power of two with UE8M0; NaN
    propagates (reference._fp8_dynamic_scale)."""
    if HAS_UB:
        amax = ct.minimum(amax, ub, propagate_nan=True)
    s = ct.maximum(amax, amax_floor, propagate_nan=True) / fp8_max
    if UE8M0:
        s = _pow2_ceil(s)
    return s


def _saturate(q, fp8_max, dtype):
    """Clamp to the finite range of the fp8 ``dtype``, NaN kept, then round to nearest even."""
    q = ct.minimum(ct.maximum(q, -fp8_max, propagate_nan=True), fp8_max, propagate_nan=True)
    return ct.astype(q, dtype)


@experimental_kernel
@ct.kernel
def rms_norm_fp8_fwd(
    x,
    w,
    y_q,
    scales,
    scale_in,
    scale_ub,
    residual,
    res_out,
    eps,
    offset,
    fp8_max,
    amax_floor,
    TILE_M: ct.Constant[int],
    TILE_N: ct.Constant[int],
    CAST: ct.Constant[int],
    HAS_W: ct.Constant[bool],
    ADD: ct.Constant[int],
    QUANT: ct.Constant[int],
    GROUP: ct.Constant[int],
    HAS_UB: ct.Constant[bool],
    UE8M0: ct.Constant[bool],
):
    """``y_q`` (fp8) and, when dynamic, ``scales`` (fp32: ``(M,)`` per row, ``(M, cdiv(N, GROUP))`` per group)
    for row tile ``bid``. ``scale_in`` (one element) is read when static, ``scale_ub`` (one element) with
    ``HAS_UB``; otherwise each stands in for a dummy, as ``scales`` does when static. ``ADD`` (ADD_NONE or
    ADD_PRE) as in the forward: the sum is stored into ``res_out``, which may be ``residual`` itself."""
    b = ct.bid(0)
    sdt = residual.dtype  # as in rms_norm_fwd_gather
    xf = _load_input(x, residual, res_out, (b, 0), (TILE_M, TILE_N), ADD, ADD == ADD_PRE)
    r = _rstd_from_sum_sq(_sum_sq(xf), x.shape[1], eps, CAST, sdt)
    wt = _effective_weight(w, 0, offset, TILE_N, HAS_W, CAST, sdt)
    y = ct.astype(_normalize_as(xf, r, wt, CAST, sdt, x.dtype), _F32)  # rounded to x's dtype, as stored unfused
    if QUANT == QUANT_STATIC:
        s = ct.reshape(ct.load(scale_in, (0,), (1,)), (1, 1))
        q = y / s
    else:
        ub = 0.0
        if HAS_UB:
            ub = ct.reshape(ct.load(scale_ub, (0,), (1,)), (1, 1))
        if QUANT == QUANT_TOKEN:
            amax = ct.max(ct.abs(y), axis=1, keepdims=True, propagate_nan=True)
            s = _dynamic_scale(amax, ub, fp8_max, amax_floor, HAS_UB, UE8M0)
            q = y / s
            ct.store(scales, (b,), ct.reshape(s, (TILE_M,)), allow_tma=False)
        else:
            groups = ct.reshape(y, (TILE_M, TILE_N // GROUP, GROUP))
            amax = ct.max(ct.abs(groups), axis=2, keepdims=True, propagate_nan=True)
            s = _dynamic_scale(amax, ub, fp8_max, amax_floor, HAS_UB, UE8M0)
            q = ct.reshape(groups / s, (TILE_M, TILE_N))
            ct.store(scales, (b, 0), ct.reshape(s, (TILE_M, TILE_N // GROUP)), allow_tma=False)
    ct.store(y_q, (b, 0), _saturate(q, fp8_max, y_q.dtype), allow_tma=False)
