"""The Triton backward host: dx in one launch, dw reduced from per-program fp32 rows in a second."""

from __future__ import annotations

import torch

from tilegym_rms.batch_invariance import is_batch_invariant
from tilegym_rms.triton import config
from tilegym_rms.triton import launch as _launch
from tilegym_rms.triton.host.common import check_inputs, dense_rows, load_kernels


def backward_workspace_bytes(m: int, n: int, dtype: torch.dtype, device) -> int:
    """Bytes of the fp32 dw partial buffer (grid x N x 4) that :func:`backward` allocates with a weight."""
    if m == 0:
        return 0
    tiles = config.choose_tiles(m, n, dtype, "backward", invariant=is_batch_invariant())
    return config.schedule(tiles, torch.device(device))[0] * n * 4


def backward(x, dy, weight, rstd, offset, casting_mode):
    """RMSNorm backward (the fp32 formula for every casting mode). Returns ``(dx, dw)``.

    ``dx = rstd * (w~*dy - x^ * mean(x^ * w~ * dy))`` with ``x^ = x*rstd``, ``w~ = offset + w``;
    ``dw = sum_rows(dy * x^)`` in weight's dtype, or None without weight. dw is reduced in two
    deterministic steps: per-program fp32 rows ``(grid, N)``, then a reduction kernel.
    """
    check_inputs(x, weight, casting_mode)
    if dy.shape != x.shape or not dense_rows(dy):
        raise ValueError("dy must have x's shape and unit column stride")
    M, N = x.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    has_w = weight is not None
    k = load_kernels()
    rstd = rstd.to(torch.float32).contiguous()
    tiles = config.choose_tiles(M, N, x.dtype, "backward", invariant=is_batch_invariant())
    grid, tasks_per_program = config.schedule(tiles, x.device)
    partitioned = tiles.path == "partitioned"
    if has_w:
        # Partitioned programs accumulate into their row in place (needs zeros); tile programs
        # write their whole row once.
        alloc = torch.zeros if partitioned else torch.empty
        partial = alloc((grid, N), dtype=torch.float32, device=x.device)
    else:
        partial = dx  # unused pointer when HAS_W is off
    args = (
        dy,
        x,
        weight if has_w else x,
        rstd,
        dx,
        partial,
        M,
        N,
        dy.stride(0),
        x.stride(0),
        dx.stride(0),
    )
    flags = {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "HAS_W": has_w,
        "EVEN_M": tiles.even_m,
        "EVEN_N": tiles.even_n,
    }
    if partitioned:
        cta_barrier = x.device.type == "cuda"
        _launch.launch(
            k.rms_norm_bwd_partitioned_kernel,
            (grid,),
            *args,
            float(offset),
            CTA_BARRIER=cta_barrier,
            **flags,
        )
    else:
        _launch.launch(
            k.rms_norm_bwd_kernel,
            (grid,),
            *args,
            float(offset),
            tasks_per_program,
            BLOCK_ROW_SCHEDULE=tiles.path == "block_row",
            **flags,
        )
    if not has_w:
        return dx, None
    return dx, reduce_dw(partial, weight)


def reduce_dw(partial, weight):
    """``dw = partial.sum(0)`` in the weight's dtype, in a fixed order (deterministic): the per-program fp32
    rows ``(P, N)`` of a backward reduced by ``rms_norm_dw_reduce_kernel``."""
    P, N = partial.shape
    dw = torch.empty((N,), dtype=weight.dtype, device=partial.device)
    block_p = min(config.REDUCE_BLOCK_P, config.next_pow2(P))
    block_n = config.reduce_block_n(N)
    reduce_grid = config.grid_size(config.cdiv(N, block_n), partial.device)
    _launch.launch(
        load_kernels().rms_norm_dw_reduce_kernel,
        (reduce_grid,),
        partial,
        dw,
        P,
        N,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        EVEN_P=P % block_p == 0,
        EVEN_N=N % block_n == 0,
    )
    return dw
