"""Triton RMSNorm kernels written for triton-ascend; they also run under standard Triton and in the interpreter.

Kernels (all marked experimental on ``npu``: they have not run on Ascend hardware yet; the gated ones on
``cuda`` too, until the GPU tests have run them):

* :data:`rms_norm_fwd_kernel`: a row fits one tile. Each step normalizes ``BLOCK_M`` whole rows.
  With ``HAS_RESIDUAL`` it is the single-pass fused residual add: ``S = x + residual`` stays on chip
  and x, residual are read once. ``BLOCK_ROW_SCHEDULE`` selects the block-row schedule (each program
  owns a contiguous slab of row blocks) instead of the grid-stride one.
* :data:`rms_norm_fwd_partitioned_kernel`: a row does not fit. Pass 1 accumulates the sum of squares
  over column chunks (writing ``S`` in fused "pre" mode), pass 2 normalizes chunk by chunk,
  recomputing ``S`` from x and residual.
* :data:`rms_norm_bwd_kernel` / :data:`rms_norm_bwd_partitioned_kernel`: the backward, same split.
  Each program accumulates its dw contribution in fp32 into its own row of a ``(grid, N)`` buffer.
* :data:`rms_norm_dw_reduce_kernel`: sums the per-program dw rows in a fixed order (deterministic,
  no atomics) and casts to the weight dtype.
* :data:`gated_rms_norm_fwd_kernel` / :data:`gated_rms_norm_bwd_kernel`: the gated norm, a group of columns
  per program column (see their section).

Constraints kept for triton-ascend: no ``num_warps``/``num_stages``/cache or eviction hints, no fp64,
no unsigned loads, power-of-two ``tl.arange`` sizes. Every tile is computed in fp32; masks are
compile-time optional (``EVEN_M`` drops the row mask, ``EVEN_N`` the column mask).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tilegym_rms.experimental import experimental_kernel
from tilegym_rms.reference import CASTING_CODES, GATE_CODES

_CAST_LLAMA = tl.constexpr(CASTING_CODES["llama"])
_CAST_GEMMA = tl.constexpr(CASTING_CODES["gemma"])
_CAST_NONE = tl.constexpr(CASTING_CODES["none"])
_GATE_SIGMOID = tl.constexpr(GATE_CODES["sigmoid"])


def _npu_experimental(fn):
    """``experimental_kernel(on=("npu",))`` over ``triton.jit``: the registered object is the launchable one."""
    return experimental_kernel(on=("npu",))(triton.jit(fn))


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _task_range(num_tasks, tasks_per_program, BLOCK_ROW_SCHEDULE: tl.constexpr):
    """The row tasks of this program: a contiguous slab (block-row schedule) or a grid-stride walk."""
    pid = tl.program_id(0)
    if BLOCK_ROW_SCHEDULE:
        start = pid * tasks_per_program
        stop = tl.minimum(start + tasks_per_program, num_tasks)
        step = 1
    else:
        start = pid
        stop = num_tasks
        step = tl.num_programs(0)
    return start, stop, step


@triton.jit
def _load_tile(ptr, row_off, rows, cols, M, N, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """Loads a ``(BLOCK_M, BLOCK_N)`` tile as fp32, masking only the dimensions that are not aligned."""
    ptrs = ptr + row_off[:, None] + cols[None, :]
    if EVEN_M and EVEN_N:
        val = tl.load(ptrs)
    elif EVEN_M:
        val = tl.load(ptrs, mask=cols[None, :] < N, other=0.0)
    elif EVEN_N:
        val = tl.load(ptrs, mask=rows[:, None] < M, other=0.0)
    else:
        val = tl.load(ptrs, mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
    return val.to(tl.float32)


@triton.jit
def _store_tile(ptr, row_off, rows, cols, M, N, val, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """Stores a tile, cast to the pointer's dtype, masking only the dimensions that are not aligned."""
    ptrs = ptr + row_off[:, None] + cols[None, :]
    val = val.to(ptr.dtype.element_ty)
    if EVEN_M and EVEN_N:
        tl.store(ptrs, val)
    elif EVEN_M:
        tl.store(ptrs, val, mask=cols[None, :] < N)
    elif EVEN_N:
        tl.store(ptrs, val, mask=rows[:, None] < M)
    else:
        tl.store(ptrs, val, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _load_vec(ptr, idx, limit, EVEN: tl.constexpr):
    """Loads a 1-D fp32 vector (per-row rstd, a weight chunk, a dw chunk)."""
    if EVEN:
        val = tl.load(ptr + idx)
    else:
        val = tl.load(ptr + idx, mask=idx < limit, other=0.0)
    return val.to(tl.float32)


@triton.jit
def _store_vec(ptr, idx, limit, val, EVEN: tl.constexpr):
    val = val.to(ptr.dtype.element_ty)
    if EVEN:
        tl.store(ptr + idx, val)
    else:
        tl.store(ptr + idx, val, mask=idx < limit)


@triton.jit
def _round_to(val, REF):
    """Rounds an fp32 value through the element dtype of pointer ``REF`` (a no-op for fp32)."""
    return val.to(REF.dtype.element_ty).to(tl.float32)


@triton.jit
def _load_weight(W, cols, N, offset, HAS_W: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr):
    """``w~ = offset + w`` in fp32 for a column chunk; ones when there is no weight (w~ = 1)."""
    if HAS_W:
        w = _load_vec(W, cols, N, EVEN_N) + offset
    else:
        w = tl.full((BLOCK_N,), 1.0, tl.float32)
    return w


@triton.jit
def _load_input(
    X,
    R,
    x_off,
    r_off,
    rows,
    cols,
    M,
    N,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """The normalized input as fp32: ``x``, or ``S = x + residual`` rounded to x's dtype like torch's add."""
    x = _load_tile(X, x_off, rows, cols, M, N, EVEN_M, EVEN_N)
    if HAS_RESIDUAL:
        r = _load_tile(R, r_off, rows, cols, M, N, EVEN_M, EVEN_N)
        x = _round_to(x + r, X)
    return x


@triton.jit
def _rstd_from_sum_sq(sum_sq, N, eps, REF, CASTING: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` in fp32; mode "none" rounds rstd to x's dtype (the mean square stays
    fp32: in fp16 it would overflow)."""
    rstd = tl.rsqrt(sum_sq / N + eps)
    if CASTING == _CAST_NONE:
        rstd = _round_to(rstd, REF)
    return rstd


@triton.jit
def _normalize(x, rstd, w, REF, CASTING: tl.constexpr, HAS_W: tl.constexpr):
    """``y`` in fp32 (the caller's store performs the final rounding) following the casting mode.

    llama: ``x*rstd`` rounded to x's dtype, times the fp32 ``w~``. gemma: all fp32. none: ``x*rstd``
    rounded, times ``w~`` rounded to x's dtype (the product of two rounded values is exact in fp32,
    so the store's rounding equals torch's low-precision multiply).
    """
    y = x * rstd[:, None]
    if CASTING == _CAST_LLAMA:
        y = _round_to(y, REF)
        if HAS_W:
            y = y * w[None, :]
    elif CASTING == _CAST_GEMMA:
        if HAS_W:
            y = y * w[None, :]
    else:
        y = _round_to(y, REF)
        if HAS_W:
            y = y * _round_to(w, REF)[None, :]
    return y


@triton.jit
def _sum_sq_chunks(
    X,
    R,
    RES_OUT,
    x_off,
    r_off,
    res_off,
    rows,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """Pass 1 of the partitioned forward: per-row sum of squares over column chunks (never a whole row).

    In fused "pre" mode the chunk of ``S`` is written to ``RES_OUT`` here, while it is on chip.
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = _load_input(X, R, x_off, r_off, rows, cols, M, N, HAS_RESIDUAL, EVEN_M, EVEN_N)
        if STORE_RESIDUAL:
            _store_tile(RES_OUT, res_off, rows, cols, M, N, x, EVEN_M, EVEN_N)
        acc += x * x
    return tl.sum(acc, 1)


@triton.jit
def _load_bwd_chunk(
    DY,
    X,
    W,
    dy_off,
    x_off,
    rows,
    cols,
    rstd,
    M,
    N,
    offset,
    HAS_W: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Backward operands of one tile in fp32: ``dy``, ``x^ = x*rstd`` and ``g = w~*dy``."""
    dy = _load_tile(DY, dy_off, rows, cols, M, N, EVEN_M, EVEN_N)
    xhat = _load_tile(X, x_off, rows, cols, M, N, EVEN_M, EVEN_N) * rstd[:, None]
    g = dy * _load_weight(W, cols, N, offset, HAS_W, EVEN_N, BLOCK_N)[None, :]
    return dy, xhat, g


# --------------------------------------------------------------------------------------------------
# Forward (plain and fused residual add)
# --------------------------------------------------------------------------------------------------


@_npu_experimental
def rms_norm_fwd_kernel(
    X, R, Y, RES_OUT, W, RSTD,
    M, N, stride_x, stride_r, stride_y, stride_res, eps, offset, tasks_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CASTING: tl.constexpr, HAS_W: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr, STORE_RSTD: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_ROW_SCHEDULE: tl.constexpr,
):  # fmt: skip
    """Single-pass forward: ``BLOCK_M`` whole rows per step (block and block-row paths, fused add too)."""
    cols = tl.arange(0, BLOCK_N)
    # The weight row is loaded once per program and reused for every row block.
    w = _load_weight(W, cols, N, offset, HAS_W, EVEN_N, BLOCK_N)
    start, stop, step = _task_range(tl.cdiv(M, BLOCK_M), tasks_per_program, BLOCK_ROW_SCHEDULE)
    for task in range(start, stop, step):
        rows = task * BLOCK_M + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)  # row offsets in int64: M * stride may exceed 2**31
        x = _load_input(
            X,
            R,
            rows64 * stride_x,
            rows64 * stride_r,
            rows,
            cols,
            M,
            N,
            HAS_RESIDUAL,
            EVEN_M,
            EVEN_N,
        )
        if STORE_RESIDUAL:
            _store_tile(RES_OUT, rows64 * stride_res, rows, cols, M, N, x, EVEN_M, EVEN_N)
        rstd = _rstd_from_sum_sq(tl.sum(x * x, 1), N, eps, Y, CASTING)
        y = _normalize(x, rstd, w, Y, CASTING, HAS_W)
        _store_tile(Y, rows64 * stride_y, rows, cols, M, N, y, EVEN_M, EVEN_N)
        if STORE_RSTD:
            _store_vec(RSTD, rows, M, rstd, EVEN_M)


@_npu_experimental
def rms_norm_fwd_partitioned_kernel(
    X, R, Y, RES_OUT, W, RSTD,
    M, N, stride_x, stride_r, stride_y, stride_res, eps, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CASTING: tl.constexpr, HAS_W: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr, STORE_RSTD: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """Two-pass forward over column chunks for rows that do not fit the Unified Buffer."""
    for task in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = task * BLOCK_M + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        x_off = rows64 * stride_x
        r_off = rows64 * stride_r
        sum_sq = _sum_sq_chunks(
            X, R, RES_OUT, x_off, r_off, rows64 * stride_res, rows, M, N,
            BLOCK_M, BLOCK_N, HAS_RESIDUAL, STORE_RESIDUAL, EVEN_M, EVEN_N,
        )  # fmt: skip
        rstd = _rstd_from_sum_sq(sum_sq, N, eps, Y, CASTING)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            # S is recomputed from x and residual rather than read back from RES_OUT: reading what
            # this program just wrote would need a store->load ordering guarantee we do not rely on.
            x = _load_input(X, R, x_off, r_off, rows, cols, M, N, HAS_RESIDUAL, EVEN_M, EVEN_N)
            w = _load_weight(W, cols, N, offset, HAS_W, EVEN_N, BLOCK_N)
            y = _normalize(x, rstd, w, Y, CASTING, HAS_W)
            _store_tile(Y, rows64 * stride_y, rows, cols, M, N, y, EVEN_M, EVEN_N)
        if STORE_RSTD:
            _store_vec(RSTD, rows, M, rstd, EVEN_M)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@_npu_experimental
def rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    M, N, stride_dy, stride_x, stride_dx, offset, tasks_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_W: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_ROW_SCHEDULE: tl.constexpr,
):  # fmt: skip
    """Single-pass backward: ``dx = rstd * (g - x^ * mean(x^ * g))``; dw summed on chip per program."""
    cols = tl.arange(0, BLOCK_N)
    dw_acc = tl.zeros((BLOCK_N,), tl.float32)
    start, stop, step = _task_range(tl.cdiv(M, BLOCK_M), tasks_per_program, BLOCK_ROW_SCHEDULE)
    for task in range(start, stop, step):
        rows = task * BLOCK_M + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        rstd = _load_vec(RSTD, rows, M, EVEN_M)
        dy, xhat, g = _load_bwd_chunk(
            DY, X, W, rows64 * stride_dy, rows64 * stride_x, rows, cols, rstd, M, N, offset,
            HAS_W, EVEN_M, EVEN_N, BLOCK_N,
        )  # fmt: skip
        c = tl.sum(xhat * g, 1) / N
        dx = rstd[:, None] * (g - xhat * c[:, None])
        _store_tile(DX, rows64 * stride_dx, rows, cols, M, N, dx, EVEN_M, EVEN_N)
        if HAS_W:
            # Masked rows and columns load as 0, so they add nothing.
            dw_acc += tl.sum(dy * xhat, 0)
    if HAS_W:
        _store_vec(DW_PARTIAL + tl.program_id(0).to(tl.int64) * N, cols, N, dw_acc, EVEN_N)


@_npu_experimental
def rms_norm_bwd_partitioned_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    M, N, stride_dy, stride_x, stride_dx, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_W: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, CTA_BARRIER: tl.constexpr,
):  # fmt: skip
    """Two-pass backward over column chunks: pass 1 the row dot ``sum(x^ * g)``, pass 2 dx and dw.

    ``DW_PARTIAL`` must be zero-initialized: each program adds its chunk sums into its own row. Only
    this program touches that row, so the read-modify-write needs no atomics and the sum order is
    fixed (deterministic). On CUDA a program is many threads whose layouts for the load and the store
    may differ, so ``CTA_BARRIER`` orders one row's stores before the next row's loads; an Ascend
    vector core runs the program as one instruction stream, where the barrier is not needed.
    """
    partial = DW_PARTIAL + tl.program_id(0).to(tl.int64) * N
    for task in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = task * BLOCK_M + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        dy_off = rows64 * stride_dy
        x_off = rows64 * stride_x
        rstd = _load_vec(RSTD, rows, M, EVEN_M)
        dot = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            dy, xhat, g = _load_bwd_chunk(
                DY,
                X,
                W,
                dy_off,
                x_off,
                rows,
                cols,
                rstd,
                M,
                N,
                offset,
                HAS_W,
                EVEN_M,
                EVEN_N,
                BLOCK_N,
            )
            dot += xhat * g
        c = tl.sum(dot, 1) / N
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            dy, xhat, g = _load_bwd_chunk(
                DY,
                X,
                W,
                dy_off,
                x_off,
                rows,
                cols,
                rstd,
                M,
                N,
                offset,
                HAS_W,
                EVEN_M,
                EVEN_N,
                BLOCK_N,
            )
            dx = rstd[:, None] * (g - xhat * c[:, None])
            _store_tile(DX, rows64 * stride_dx, rows, cols, M, N, dx, EVEN_M, EVEN_N)
            if HAS_W:
                dw = _load_vec(partial, cols, N, EVEN_N) + tl.sum(dy * xhat, 0)
                _store_vec(partial, cols, N, dw, EVEN_N)
        if HAS_W and CTA_BARRIER:
            tl.debug_barrier()


@_npu_experimental
def rms_norm_dw_reduce_kernel(
    DW_PARTIAL, DW, P, N,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_P: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """``dw[n] = sum_p partial[p, n]`` in a fixed order (deterministic), cast to the weight dtype."""
    for task in range(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        cols = task * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
        for p0 in range(0, P, BLOCK_P):
            prow = p0 + tl.arange(0, BLOCK_P)
            acc += _load_tile(DW_PARTIAL, prow.to(tl.int64) * N, prow, cols, P, N, EVEN_P, EVEN_N)
        _store_vec(DW, cols, N, tl.sum(acc, 0), EVEN_N)


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


ALL_KERNELS = (
    rms_norm_fwd_kernel,
    rms_norm_fwd_partitioned_kernel,
    rms_norm_bwd_kernel,
    rms_norm_bwd_partitioned_kernel,
    rms_norm_dw_reduce_kernel,
    gated_rms_norm_fwd_kernel,
    gated_rms_norm_bwd_kernel,
)
