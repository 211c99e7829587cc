"""RMSNorm (and the fused add) with its output quantized to fp8, in one pass (rms_norm_fp8,
fused_add_rms_norm_fp8): the norm's y, rounded to x's dtype, quantized in the same pass
(reference.quantize_fp8). QUANT: a static scale, dynamic per-row scales, or per group of GROUP columns
(scales shaped (M, cdiv(N, GROUP))). A tile is TILE_M whole rows (TILE_N >= N, or with TAIL_N the row's first
TILE_N columns beside a tail tile of the next TAIL_N, TILE_N + TAIL_N >= N: no arithmetic on a padding to the next
power of two, config.split_row); a block walks several tiles (WALK) or runs one, without the loop, so that in
one-row-per-block launches a row's code never depends on M. Padded columns load as zeros, whose y is 0: they never
raise an amax, and the stores drop them (and the scales of groups past the row's end). Each element is multiplied
by its scale's reciprocal (reference.quantize_fp8): an IEEE division per element, with its slow-path branch, was a
third of the dynamic builds' instructions ("FP8 output" in PERFORMANCE.md)."""

from __future__ import annotations

import cuda.tile as ct

from ...experimental import experimental_kernel
from .common import _F32, ADD_PRE, _effective_weights, _load_input, _normalize_as, _rstd_from_sum_sq, _sum_sq

QUANT_STATIC, QUANT_TOKEN, QUANT_GROUP = 0, 1, 2
# The kernel's WORDS switch: y_q stored value by value (an fp8 tensor), or as int64 words of 8 values (an int64
# view of the fp8 rows) holding e4m3fn or e5m2 codes. A thread then stores 8 values an instruction, where it stores
# one a value otherwise (PERFORMANCE.md, "FP8 output").
WORDS_NONE, WORDS_E4M3, WORDS_E5M2 = 0, 1, 2


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


def _store_q(y_q, index, q, fp8_max, TILE_M, WIDTH, WORDS):
    """Saturate ``q`` (a ``(TILE_M, WIDTH)`` tile) and store it at tile ``index`` of ``y_q``: value by value, or
    with ``WORDS`` (not :data:`WORDS_NONE`) as int64 words into the int64 view of the fp8 rows."""
    if WORDS != WORDS_NONE:
        q8 = _saturate(q, fp8_max, ct.float8_e5m2 if WORDS == WORDS_E5M2 else ct.float8_e4m3fn)
        words = ct.unpack_from_bytes(ct.pack_to_bytes(q8), ct.int64)
        ct.store(y_q, index, ct.reshape(words, (TILE_M, WIDTH // 8)), allow_tma=False, latency=3)
    else:
        ct.store(y_q, index, _saturate(q, fp8_max, y_q.dtype), allow_tma=False, latency=3)


def _group_scaled(y, scales, index, ub, fp8_max, amax_floor, TILE_M, WIDTH, GROUP, HAS_UB, UE8M0):
    """``y`` (``(TILE_M, WIDTH)``) times the reciprocal of each group's dynamic scale; the scales are stored at
    tile ``index`` of ``scales`` (``WIDTH // GROUP`` a row)."""
    groups = ct.reshape(y, (TILE_M, WIDTH // GROUP, GROUP))
    amax = ct.max(ct.abs(groups), axis=2, keepdims=True, propagate_nan=True)
    s = _dynamic_scale(amax, ub, fp8_max, amax_floor, HAS_UB, UE8M0)
    ct.store(scales, index, ct.reshape(s, (TILE_M, WIDTH // GROUP)), allow_tma=False)
    return ct.reshape(groups * (1.0 / s), (TILE_M, WIDTH))


def _row_amax(y):
    return ct.max(ct.abs(y), axis=1, keepdims=True, propagate_nan=True)


def _quantize_tile(
    b,
    x,
    wt,
    wt_tail,
    y_q,
    scales,
    residual,
    res_out,
    eps,
    inv_static,
    ub,
    fp8_max,
    amax_floor,
    TILE_M,
    TILE_N,
    TAIL_N,
    CAST,
    ADD,
    QUANT,
    GROUP,
    HAS_UB,
    UE8M0,
    WORDS,
):
    """Row tile ``b``: its ``y_q``, its scales when dynamic, and with ``ADD`` its sum. With ``TAIL_N`` a row is
    the tile's ``TILE_N`` columns and a tail tile of the next ``TAIL_N`` (its column index ``TILE_N // TAIL_N``)."""
    sdt = residual.dtype  # as in rms_norm_fwd_gather
    xf = _load_input(x, residual, res_out, (b, 0), (TILE_M, TILE_N), ADD, ADD == ADD_PRE)
    sum_sq = _sum_sq(xf)
    if TAIL_N:
        tail = (b, TILE_N // TAIL_N)
        xf_tail = _load_input(x, residual, res_out, tail, (TILE_M, TAIL_N), ADD, ADD == ADD_PRE)
        sum_sq = sum_sq + _sum_sq(xf_tail)
    r = _rstd_from_sum_sq(sum_sq, x.shape[1], eps, CAST, sdt)
    y = ct.astype(_normalize_as(xf, r, wt, CAST, sdt, x.dtype), _F32)  # rounded to x's dtype, as stored unfused
    if TAIL_N:
        y_tail = ct.astype(_normalize_as(xf_tail, r, wt_tail, CAST, sdt, x.dtype), _F32)
    if QUANT == QUANT_GROUP:
        q = _group_scaled(y, scales, (b, 0), ub, fp8_max, amax_floor, TILE_M, TILE_N, GROUP, HAS_UB, UE8M0)
        if TAIL_N:
            q_tail = _group_scaled(y_tail, scales, tail, ub, fp8_max, amax_floor, TILE_M, TAIL_N, GROUP, HAS_UB, UE8M0)
    else:
        inv = inv_static
        if QUANT == QUANT_TOKEN:
            amax = _row_amax(y)
            if TAIL_N:
                amax = ct.maximum(amax, _row_amax(y_tail), propagate_nan=True)
            s = _dynamic_scale(amax, ub, fp8_max, amax_floor, HAS_UB, UE8M0)
            ct.store(scales, (b,), ct.reshape(s, (TILE_M,)), allow_tma=False)
            inv = 1.0 / s
        q = y * inv
        if TAIL_N:
            q_tail = y_tail * inv
    _store_q(y_q, (b, 0), q, fp8_max, TILE_M, TILE_N, WORDS)
    if TAIL_N:
        _store_q(y_q, tail, q_tail, fp8_max, TILE_M, TAIL_N, WORDS)


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
    TAIL_N: ct.Constant[int],
    CAST: ct.Constant[int],
    HAS_W: ct.Constant[bool],
    ADD: ct.Constant[int],
    QUANT: ct.Constant[int],
    GROUP: ct.Constant[int],
    HAS_UB: ct.Constant[bool],
    UE8M0: ct.Constant[bool],
    WORDS: ct.Constant[int],
    WALK: ct.Constant[bool],
):
    """``y_q`` (fp8) and, when dynamic, ``scales`` (fp32: ``(M,)`` per row, ``(M, cdiv(N, GROUP))`` per group)
    of its row tiles: with ``WALK`` a grid-stride walk over them (the persistent walk, whose next tiles' loads the
    compiler keeps in flight), else tile ``bid(0)`` alone (a grid of one block per tile: few rows, the
    batch-invariant mode; without the loop the compiler builds no load ring). ``scale_in`` (one element) is read
    when static, ``scale_ub`` (one element) with ``HAS_UB``; otherwise each stands in for a dummy, as ``scales``
    does when static. ``ADD`` (ADD_NONE or ADD_PRE) as in the forward: the sum is stored into ``res_out``, which
    may be ``residual`` itself. ``WORDS``: how ``y_q`` is stored (:data:`WORDS_NONE`, or as int64 words)."""
    wt, wt_tail = _effective_weights(w, offset, TILE_N, TAIL_N, HAS_W, CAST, residual.dtype)
    inv_static = 1.0
    if QUANT == QUANT_STATIC:
        inv_static = 1.0 / ct.reshape(ct.load(scale_in, (0,), (1,)), (1, 1))
    ub = 0.0
    if HAS_UB:
        ub = ct.reshape(ct.load(scale_ub, (0,), (1,)), (1, 1))
    args = (x, wt, wt_tail, y_q, scales, residual, res_out, eps, inv_static, ub, fp8_max, amax_floor)
    consts = (TILE_M, TILE_N, TAIL_N, CAST, ADD, QUANT, GROUP, HAS_UB, UE8M0, WORDS)
    if WALK:
        for b in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
            _quantize_tile(b, *args, *consts)
    else:
        _quantize_tile(ct.bid(0), *args, *consts)
