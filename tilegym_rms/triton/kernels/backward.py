"""The backward kernels (dx and the per-program fp32 dw rows, a row in one tile or in column chunks) and the
deterministic dw reduction."""

from __future__ import annotations

import triton.language as tl

from .common import (
    _load_bwd_chunk,
    _load_tile,
    _load_vec,
    _npu_experimental,
    _store_tile,
    _store_vec,
    _task_range,
)


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
                DY, X, W, dy_off, x_off, rows, cols, rstd, M, N, offset, HAS_W, EVEN_M, EVEN_N, BLOCK_N
            )  # fmt: skip
            dot += xhat * g
        c = tl.sum(dot, 1) / N
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            dy, xhat, g = _load_bwd_chunk(
                DY, X, W, dy_off, x_off, rows, cols, rstd, M, N, offset, HAS_W, EVEN_M, EVEN_N, BLOCK_N
            )  # fmt: skip
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
