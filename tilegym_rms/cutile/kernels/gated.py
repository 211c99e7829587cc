"""The gated RMSNorm of hybrid models, forward and backward: with ``s = silu(z)`` or ``sigmoid(z)`` (``GATE``, a
``reference.GATE_CODES`` value), ``y = rms_norm(x) * w~ * s`` (``NORM_BEFORE_GATE``) or ``y = rms_norm(x * s) * w~``,
each group of columns normalized with its own rstd.

x, z, y and their gradients arrive as 3-D ``(M, G, S)`` views of the ``(M, N)`` rows (G groups of S
columns; one group: G = 1, S = N), the weight as ``(G, S)``, rstd as ``(M, G)``. A tile is ``TILE_M`` rows of
``TILE_G`` whole groups, each padded to ``TILE_S = next_pow2(S)``: a group of any size fills its own tile
axis (padding loads zeros, which add nothing to a sum of squares), so no group straddles two tiles and a
group's sum is one reduction over axis 2. Grid axis 1 is the chunk of ``TILE_G`` groups a block owns (its
weight stays in registers); axis 0 grid-strides over row tiles. The casting mode rounds as the reference's
gated_rms_norm_forward.
"""

from __future__ import annotations

import cuda.tile as ct

from ...experimental import experimental_kernel
from ...reference import GATE_CODES
from .backward import _dx
from .common import (
    _F32,
    _ZERO,
    CAST_GEMMA,
    CAST_NONE,
    _load_f32,
    _normalize,
    _offset_weight,
    _round_to,
    _rstd_from_sum_sq,
)

GATE_SIGMOID = GATE_CODES["sigmoid"]


def _gated_weight(w, chunk, offset, TILE_G, TILE_S, HAS_W, CAST, dtype, part=0):
    """``offset + w`` for group chunk ``chunk`` as a ``(1, TILE_G, TILE_S)`` fp32 tile (ones without a weight);
    ``part``: the tile's index along a group (a tail's ``TILE_S // TAIL_S`` in its own width)."""
    if HAS_W:
        wt = ct.reshape(_load_f32(w, (chunk, part), (TILE_G, TILE_S), None), (1, TILE_G, TILE_S))
        return _offset_weight(wt, offset, CAST, dtype)
    return ct.full((1, TILE_G, TILE_S), 1.0, dtype=_F32)


def _gated_weights(w, chunk, offset, TILE_G, TILE_S, TAIL_S, HAS_W, CAST, dtype):
    """:func:`_gated_weight` of a group held as a tile and, with ``TAIL_S``, a tail tile of the next ``TAIL_S``
    columns: ``(head, tail)`` (without a tail the head again, never read as one), as ``_effective_weights`` for
    rows."""
    wt = _gated_weight(w, chunk, offset, TILE_G, TILE_S, HAS_W, CAST, dtype)
    wt_tail = wt
    if TAIL_S:
        wt_tail = _gated_weight(w, chunk, offset, TILE_G, TAIL_S, HAS_W, CAST, dtype, TILE_S // TAIL_S)
    return wt, wt_tail


def _gate_and_slope(zf, GATE):
    """The gate and its derivative, fp32 (reference._gate_and_slope): sigmoid, ``1 / (1 + exp(-z))`` and
    ``s * (1 - s)``; silu as torch writes it, ``z / (1 + exp(-z))``, and ``sigmoid(z) * (1 + z * (1 -
    sigmoid(z)))``."""
    e = 1.0 + ct.exp(-zf)
    sig = 1.0 / e
    return (sig if GATE == GATE_SIGMOID else zf / e), _slope(zf, sig, GATE)


def _slope(zf, sig, GATE):
    """The gate's derivative from ``sig = sigmoid(z)``."""
    if GATE == GATE_SIGMOID:
        return sig * (1.0 - sig)
    return sig * (1.0 + zf * (1.0 - sig))


def _gate_and_slope_for_gradient(zf, GATE):
    """:func:`_gate_and_slope` with the hardware's approximate reciprocal of ``1 + exp(-z)`` (an ulp or two) and
    silu as ``z * sigmoid(z)``: gradients carry no bits to match, and two IEEE divisions per element (each with
    a slow-path branch) were most of the backward's instructions and its spills ("Gated RMSNorm" in
    PERFORMANCE.md)."""
    sig = ct.truediv(1.0, 1.0 + ct.exp(-zf), rounding_mode=ct.RoundingMode.APPROX)
    return (sig if GATE == GATE_SIGMOID else zf * sig), _slope(zf, sig, GATE)


def _gate(zf, CAST, GATE, dtype):
    """The gate as the forward uses it: fp32, or in ``none`` mode taken of z in ``dtype`` and rounded."""
    if CAST == CAST_NONE:
        return _round_to(_gate_and_slope(_round_to(zf, dtype), GATE)[0], dtype)
    return _gate_and_slope(zf, GATE)[0]


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


def _gated_part(x, z, index, shape, CAST, NORM_BEFORE_GATE, GATE):
    """The gate and the values normalized (:func:`_gated_input`) of one tile of x and z."""
    s = _gate(_load_f32(z, index, shape, 10), CAST, GATE, x.dtype)
    return s, _gated_input(_load_f32(x, index, shape, 10), s, CAST, NORM_BEFORE_GATE, x.dtype)


def _gated_fwd_tile(t, x, z, y, rstd, wt, wt_tail, eps, chunk, TILE_M, TILE_G, TILE_S, TAIL_S, CAST, NORM_BEFORE_GATE,
                    GATE, STORE_RSTD):  # fmt: skip
    """Row tile ``t`` of group chunk ``chunk``: y (and rstd with ``STORE_RSTD``). With ``TAIL_S`` a group is the
    tile's ``TILE_S`` columns and a tail tile of the next ``TAIL_S`` (its index along the group ``TILE_S //
    TAIL_S``)."""
    s, h = _gated_part(x, z, (t, chunk, 0), (TILE_M, TILE_G, TILE_S), CAST, NORM_BEFORE_GATE, GATE)
    sum_sq = ct.sum(h * h, axis=2, keepdims=True)
    if TAIL_S:
        tail = (t, chunk, TILE_S // TAIL_S)
        s_tail, h_tail = _gated_part(x, z, tail, (TILE_M, TILE_G, TAIL_S), CAST, NORM_BEFORE_GATE, GATE)
        sum_sq = sum_sq + ct.sum(h_tail * h_tail, axis=2, keepdims=True)
    r = _rstd_from_sum_sq(sum_sq, x.shape[2], eps, CAST, x.dtype)
    ct.store(y, (t, chunk, 0), _gated_output(h, r, wt, s, CAST, NORM_BEFORE_GATE, y.dtype), allow_tma=False, latency=3)
    if TAIL_S:
        out_tail = _gated_output(h_tail, r, wt_tail, s_tail, CAST, NORM_BEFORE_GATE, y.dtype)
        ct.store(y, tail, out_tail, allow_tma=False, latency=3)
    if STORE_RSTD:
        ct.store(rstd, (t, chunk), ct.reshape(r, (TILE_M, TILE_G)), allow_tma=False)


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
    TAIL_S: ct.Constant[int],
    CAST: ct.Constant[int],
    HAS_W: ct.Constant[bool],
    NORM_BEFORE_GATE: ct.Constant[bool],
    GATE: ct.Constant[int],
    STORE_RSTD: ct.Constant[bool],
    WALK: ct.Constant[bool],
):
    """One read of x and z, one write of y (and of rstd with ``STORE_RSTD``; else ``rstd`` is a dummy).
    ``WALK``: grid axis 0 strides over the row tiles; otherwise each block runs row tile ``bid(0)`` alone (no loop,
    no ring of load stages: the plain forward's ``"tiles"``). ``TAIL_S``: see :func:`_gated_fwd_tile`."""
    chunk = ct.bid(1)
    wt, wt_tail = _gated_weights(w, chunk, offset, TILE_G, TILE_S, TAIL_S, HAS_W, CAST, x.dtype)
    args = (x, z, y, rstd, wt, wt_tail, eps, chunk)
    consts = (TILE_M, TILE_G, TILE_S, TAIL_S, CAST, NORM_BEFORE_GATE, GATE, STORE_RSTD)
    if WALK:
        for t in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
            _gated_fwd_tile(t, *args, *consts)
    else:
        _gated_fwd_tile(ct.bid(0), *args, *consts)


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
    GATE: ct.Constant[int],
):
    """dx, dz and the block's dw share in one pass over x, z and dy. With ``n = h * rstd`` the normalized
    values and ``dn`` the gradient of ``n * w~`` (``dy * s`` before the gate, ``dy`` after it):
    ``dh = rstd * (w~ dn - n * mean(n * w~ dn))`` per group, ``dw += sum_rows dn * n``; before the gate
    ``dx = dh``, ``dz = dy * n * w~ * s'(z)``, after it ``dx = dh * s``, ``dz = dh * x * s'(z)``. dw
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
        s, slope = _gate_and_slope_for_gradient(_load_f32(z, (t, chunk, 0), shape, 10), GATE)
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
