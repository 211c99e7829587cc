"""The tile helpers every cuTile kernel shares (inlined into each kernel) and the compile-time codes."""

from __future__ import annotations

import cuda.tile as ct

from ...reference import CASTING_CODES

CAST_LLAMA, CAST_GEMMA, CAST_NONE = (CASTING_CODES[m] for m in ("llama", "gemma", "none"))
# The forward's ADD switch: no residual add, the fused add storing the sum ("pre"), or not ("post").
ADD_NONE, ADD_PRE, ADD_POST = 0, 1, 2

_ZERO = ct.PaddingMode.ZERO
_F32 = ct.float32


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


def _effective_weights(w, offset, TILE_N, TAIL_N, HAS_W, CAST, dtype):
    """:func:`_effective_weight` of a row held as a tile and, with ``TAIL_N``, a tail tile of the next ``TAIL_N``
    columns: ``(head, tail)`` (without a tail the head again, never read as one)."""
    wt = _effective_weight(w, 0, offset, TILE_N, HAS_W, CAST, dtype)
    wt_tail = wt
    if TAIL_N:
        wt_tail = _effective_weight(w, TILE_N // TAIL_N, offset, TAIL_N, HAS_W, CAST, dtype)
    return wt, wt_tail


def _sum_sq(xf):
    """Per-row sum of squares of an fp32 tile, as a ``(rows, 1)`` column."""
    return ct.sum(xf * xf, axis=1, keepdims=True)


def _rstd_from_sum_sq(sum_sq, n, eps, CAST, dtype):
    """``1 / sqrt(sum_sq / n + eps)`` in fp32; ``none`` mode rounds rstd to ``dtype`` (the mean square
    stays fp32: in fp16 it would overflow)."""
    return _rstd_from_mean_sq(sum_sq / n, eps, CAST, dtype)


def _rstd_from_mean_sq(mean_sq, eps, CAST, dtype):
    """:func:`_rstd_from_sum_sq` of a mean square computed by the caller."""
    r = ct.rsqrt(mean_sq + eps)
    if CAST == CAST_NONE:
        return _round_to(r, dtype)
    return r


def _rstd_of_rows(sum_sq, n, eps, CAST, dtype, EXACT_N, TILE_N):
    """:func:`_rstd_from_sum_sq` of rows of ``n`` columns. ``EXACT_N``: ``n == TILE_N``, a power of two, and the mean
    multiplies by ``1 / TILE_N``, exact at compile time: the division's bits without the division that every thread
    computes for every row of a many-row tile (PERFORMANCE.md, "Compiler facts")."""
    if EXACT_N:
        return _rstd_from_mean_sq(sum_sq * (1.0 / TILE_N), eps, CAST, dtype)
    return _rstd_from_sum_sq(sum_sq, n, eps, CAST, dtype)


def _normalize(xf, r, wt, CAST, dtype):
    """``y = x * rstd * w~`` with the casting mode's roundings, returned in ``dtype``."""
    if CAST == CAST_GEMMA:
        return ct.astype(xf * r * wt, dtype)
    return ct.astype(_round_to(xf * r, dtype) * wt, dtype)


def _normalize_as(xf, r, wt, CAST, dtype, out_dtype):
    """:func:`_normalize` rounded in ``dtype`` (a fused add's sum), then cast to ``out_dtype`` (x's):
    the reference's ``rms_norm_forward(s).to(x.dtype)``; a no-op cast without the add."""
    return ct.astype(_normalize(xf, r, wt, CAST, dtype), out_dtype)
