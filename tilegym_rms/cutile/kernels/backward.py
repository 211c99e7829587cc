"""The backward kernels (dx and the fp32 dw partials) and the deterministic dw reduction:
``dx = rstd * (g - x^ * mean(x^ * g))``, ``g = w~ * dy``, ``x^ = x * rstd``; ``dw = sum over rows of dy * x^``."""

from __future__ import annotations

import cuda.tile as ct

from ...experimental import experimental_kernel
from .common import _F32, _ZERO, CAST_GEMMA, _effective_weight, _effective_weights, _load_f32


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
    # 1 / n once per block: a tile's per-row values are held by every thread, so a division per row costs one per
    # element of a many-row tile (PERFORMANCE.md, "Toolchain", compiler facts).
    inv_n = 1.0 / n
    wt, wt_tail = _effective_weights(w, offset, TILE_N, TAIL_N, HAS_W, CAST_GEMMA, x.dtype)
    dw_acc = _dw_zeros(TILE_M, TILE_N, DW_PER_ROW)
    if TAIL_N:
        tail = TILE_N // TAIL_N  # the tail tile's column index
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
        c = dot * inv_n
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
    inv_n = 1.0 / n  # see rms_norm_bwd_persistent
    row_tiles = ct.cdiv(x.shape[0], TILE_M)
    b = ct.bid(0)
    if b < row_tiles:
        r = _load_row_values(rstd, b, TILE_M)
        if SINGLE_TILE:
            wt = _effective_weight(w, 0, offset, TILE_N, HAS_W, CAST_GEMMA, x.dtype)
            xhat, dyf = _xhat_and_dy(x, dy, r, b, 0, TILE_M, TILE_N)
            g = dyf * wt
            c = _row_dot(xhat, g) * inv_n
            dx_tile = _dx(g, xhat, c, r, dres, (b, 0), (TILE_M, TILE_N), HAS_DRES, dx.dtype)
            ct.store(dx, (b, 0), dx_tile, allow_tma=False)
        else:
            num_chunks = ct.cdiv(n, TILE_N)
            acc = ct.zeros((TILE_M, TILE_N), dtype=_F32)
            for j in range(num_chunks):
                xhat, dyf = _xhat_and_dy(x, dy, r, b, j, TILE_M, TILE_N)
                acc = acc + xhat * (dyf * _effective_weight(w, j, offset, TILE_N, HAS_W, CAST_GEMMA, x.dtype))
            c = ct.sum(acc, axis=1, keepdims=True) * inv_n
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
    inv_n = 1.0 / n  # see rms_norm_bwd_persistent
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
        r = _load_row_values(rstd, t, TILE_M)
        acc = ct.zeros((TILE_M, TILE_N), dtype=_F32)
        for j in range(ct.cdiv(n, TILE_N)):
            wt = _effective_weight(w, j, offset, TILE_N, HAS_W, CAST_GEMMA, x.dtype)
            acc = acc + _load_f32(x, (t, j), (TILE_M, TILE_N), 10) * _load_f32(dy, (t, j), (TILE_M, TILE_N), 10) * wt
        ct.store(row_dot, (t,), ct.reshape(ct.sum(acc, axis=1, keepdims=True) * r * inv_n, (TILE_M,)))


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
