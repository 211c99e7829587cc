"""Shared pieces of the Triton kernels: the casting and gate codes, the experimental marker, tile loads and stores,
the weight, the input (with the fused add) and the normalization."""

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
    DY, X, W, dy_off, x_off, rows, cols, rstd, M, N, offset,
    HAS_W: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Backward operands of one tile in fp32: ``dy``, ``x^ = x*rstd`` and ``g = w~*dy``."""
    dy = _load_tile(DY, dy_off, rows, cols, M, N, EVEN_M, EVEN_N)
    xhat = _load_tile(X, x_off, rows, cols, M, N, EVEN_M, EVEN_N) * rstd[:, None]
    g = dy * _load_weight(W, cols, N, offset, HAS_W, EVEN_N, BLOCK_N)[None, :]
    return dy, xhat, g
