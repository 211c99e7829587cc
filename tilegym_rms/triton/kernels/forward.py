"""The forward kernels: a row fits one tile (plain and fused residual add), or it is walked in column chunks."""

from __future__ import annotations

import triton.language as tl

from .common import (
    _load_input,
    _load_weight,
    _normalize,
    _npu_experimental,
    _rstd_from_sum_sq,
    _store_tile,
    _store_vec,
    _sum_sq_chunks,
    _task_range,
)


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
