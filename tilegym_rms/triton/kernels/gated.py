"""Gated RMSNorm kernels: ``y = rms_norm(x) * w~ * gate(z)`` or ``rms_norm(x * gate(z)) * w~`` per group of columns."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    _CAST_GEMMA,
    _CAST_NONE,
    _GATE_SIGMOID,
    _load_tile,
    _load_vec,
    _load_weight,
    _normalize,
    _npu_experimental,
    _round_to,
    _rstd_from_sum_sq,
    _store_tile,
    _store_vec,
)

# --------------------------------------------------------------------------------------------------
# Gated RMSNorm: with s = silu(z) or sigmoid(z) (GATE), y = rms_norm(x) * w~ * s (NORM_BEFORE_GATE) or
# y = rms_norm(x * s) * w~, each group of S columns normalized with its own rstd
#
# Program (p, g) owns group g (columns [g * S, (g + 1) * S), program axis 1) and grid-strides over blocks of
# BLOCK_M rows along axis 0, so a tile is BLOCK_M rows of one group (BLOCK_N = next_pow2(S)), its weight is
# loaded once and its dw share stays on chip. rstd is (M, G), row-major.
# --------------------------------------------------------------------------------------------------


@triton.jit
def _gate_and_slope(z, GATE: tl.constexpr):
    """The gate and its derivative, fp32 (reference._gate_and_slope): sigmoid, ``1 / (1 + exp(-z))`` and
    ``s * (1 - s)``; silu as torch writes it, ``z / (1 + exp(-z))``, and ``sigmoid(z) * (1 + z * (1 -
    sigmoid(z)))``."""
    e = 1.0 + tl.exp(-z)
    sig = 1.0 / e
    if GATE == _GATE_SIGMOID:
        return sig, sig * (1.0 - sig)
    return z / e, sig * (1.0 + z * (1.0 - sig))


@triton.jit
def _gate(z, REF, CASTING: tl.constexpr, GATE: tl.constexpr):
    """The gate as the forward uses it: fp32, or in mode "none" taken of z in x's dtype and rounded."""
    if CASTING == _CAST_NONE:
        s, _ = _gate_and_slope(_round_to(z, REF), GATE)
        return _round_to(s, REF)
    s, _ = _gate_and_slope(z, GATE)
    return s


@_npu_experimental
def gated_rms_norm_fwd_kernel(
    X, Z, W, Y, RSTD,
    M, N, S, stride_x, stride_z, stride_y, eps, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CASTING: tl.constexpr, HAS_W: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr, GATE: tl.constexpr, STORE_RSTD: tl.constexpr, EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):  # fmt: skip
    """One read of x and z, one write of y (and rstd); the casting mode rounds as the reference's."""
    g = tl.program_id(1)
    groups = N // S
    col0 = g.to(tl.int64) * S
    cols = tl.arange(0, BLOCK_N)
    w = _load_weight(W + col0, cols, S, offset, HAS_W, EVEN_N, BLOCK_N)
    for task in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = task * BLOCK_M + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        s = _gate(_load_tile(Z + col0, rows64 * stride_z, rows, cols, M, S, EVEN_M, EVEN_N), Y, CASTING, GATE)
        h = _load_tile(X + col0, rows64 * stride_x, rows, cols, M, S, EVEN_M, EVEN_N)
        if not NORM_BEFORE_GATE:
            h = h * s
            if CASTING == _CAST_NONE:
                h = _round_to(h, Y)
        rstd = _rstd_from_sum_sq(tl.sum(h * h, 1), S, eps, Y, CASTING)
        y = _normalize(h, rstd, w, Y, CASTING, HAS_W)
        if NORM_BEFORE_GATE:
            if CASTING == _CAST_GEMMA:
                y = y * s
            else:  # the norm's own rounding first, as the reference
                y = _round_to(y, Y) * s
        _store_tile(Y + col0, rows64 * stride_y, rows, cols, M, S, y, EVEN_M, EVEN_N)
        if STORE_RSTD:
            _store_vec(RSTD + g, rows * groups, M * groups, rstd, EVEN_M)


@_npu_experimental
def gated_rms_norm_bwd_kernel(
    DY, X, Z, W, RSTD, DX, DZ, DW_PARTIAL,
    M, N, S, stride_dy, stride_x, stride_z, stride_dx, stride_dz, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_W: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
    GATE: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """dx, dz and dw in one pass. With ``n = h * rstd`` and ``dn`` the gradient of ``n * w~`` (``dy * s``
    before the gate, ``dy`` after it): ``dh = rstd * (w~ dn - n * mean(n * w~ dn))``, ``dw += sum_rows dn * n``;
    before the gate ``dx = dh``, ``dz = dy * n * w~ * s'(z)``, after it ``dx = dh * s``,
    ``dz = dh * x * s'(z)``. Program (p, g) writes its dw share of group g into row p of ``DW_PARTIAL``."""
    g = tl.program_id(1)
    groups = N // S
    col0 = g.to(tl.int64) * S
    cols = tl.arange(0, BLOCK_N)
    w = _load_weight(W + col0, cols, S, offset, HAS_W, EVEN_N, BLOCK_N)
    dw_acc = tl.zeros((BLOCK_N,), tl.float32)
    for task in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = task * BLOCK_M + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        rstd = _load_vec(RSTD + g, rows * groups, M * groups, EVEN_M)
        dy = _load_tile(DY + col0, rows64 * stride_dy, rows, cols, M, S, EVEN_M, EVEN_N)
        x = _load_tile(X + col0, rows64 * stride_x, rows, cols, M, S, EVEN_M, EVEN_N)
        z = _load_tile(Z + col0, rows64 * stride_z, rows, cols, M, S, EVEN_M, EVEN_N)
        s, slope = _gate_and_slope(z, GATE)
        if NORM_BEFORE_GATE:
            n = x * rstd[:, None]
            dn = dy * s
        else:
            n = x * s * rstd[:, None]
            dn = dy
        if HAS_W:
            dw_acc += tl.sum(dn * n, 0)  # masked rows and columns load as 0: they add nothing
        gw = dn * w[None, :]
        c = tl.sum(gw * n, 1) / S
        dh = rstd[:, None] * (gw - n * c[:, None])
        if NORM_BEFORE_GATE:
            dx = dh
            dz = dy * n * w[None, :] * slope
        else:
            dx = dh * s
            dz = dh * x * slope
        _store_tile(DX + col0, rows64 * stride_dx, rows, cols, M, S, dx, EVEN_M, EVEN_N)
        _store_tile(DZ + col0, rows64 * stride_dz, rows, cols, M, S, dz, EVEN_M, EVEN_N)
    if HAS_W:
        _store_vec(DW_PARTIAL + tl.program_id(0).to(tl.int64) * N + col0, cols, S, dw_acc, EVEN_N)
