"""The Triton forward host: the plain forward and the fused residual add, one launch each.

The fused add is the same kernels' ``HAS_RESIDUAL`` case; the column-partitioned kernel takes rows
that do not fit one tile.
"""

from __future__ import annotations

import torch

from tilegym_rms.batch_invariance import is_batch_invariant
from tilegym_rms.reference import CASTING_CODES, FUSED_ADD_MODES
from tilegym_rms.triton import config
from tilegym_rms.triton import launch as _launch
from tilegym_rms.triton.host.common import check_inputs, dense_rows, load_kernels


def _forward_impl(x, residual, weight, eps, offset, casting_mode, store_rstd, store_residual, op, path=None):
    """Shared launch of the plain and fused forward: the fused add is the kernels' HAS_RESIDUAL case."""
    check_inputs(x, weight, casting_mode)
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    res_out = torch.empty((M, N), dtype=x.dtype, device=x.device) if store_residual else y
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device) if store_rstd else None
    k = load_kernels()
    tiles = config.choose_tiles(M, N, x.dtype, op, path, is_batch_invariant())
    grid, tasks_per_program = config.schedule(tiles, x.device)
    has_res = residual is not None
    r = residual if has_res else x  # unused pointer when HAS_RESIDUAL is off
    common_args = (
        x, r, y, res_out, weight if weight is not None else x, rstd if store_rstd else y,
        M, N, x.stride(0), r.stride(0), y.stride(0), res_out.stride(0), float(eps), float(offset),
    )  # fmt: skip
    flags = {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "CASTING": CASTING_CODES[casting_mode],
        "HAS_W": weight is not None,
        "HAS_RESIDUAL": has_res,
        "STORE_RESIDUAL": store_residual,
        "STORE_RSTD": store_rstd,
        "EVEN_M": tiles.even_m,
        "EVEN_N": tiles.even_n,
    }
    if tiles.path == "partitioned":
        _launch.launch(k.rms_norm_fwd_partitioned_kernel, (grid,), *common_args, **flags)
    else:
        _launch.launch(
            k.rms_norm_fwd_kernel,
            (grid,),
            *common_args,
            tasks_per_program,
            BLOCK_ROW_SCHEDULE=tiles.path == "block_row",
            **flags,
        )
    return y, res_out, rstd


def forward(x, weight, eps, offset, casting_mode, *, store_rstd=True, kernel=None):
    """RMSNorm forward. Returns ``(y, rstd)``: ``y`` contiguous in x's dtype, ``rstd`` (M,) fp32 or None.

    ``kernel`` forces a kernel path (one of :data:`FORWARD_KERNELS`: ``"block"``, ``"block_row"``,
    ``"partitioned"``); by default :func:`choose_path` picks it.
    """
    y, _, rstd = _forward_impl(x, None, weight, eps, offset, casting_mode, store_rstd, False, "forward", kernel)
    return y, rstd


FUSED_ADD_MIXED_DTYPES = False  # the kernels take x and residual of one dtype


def fused_add_forward(x, residual, weight, eps, offset, casting_mode, *, mode, store_rstd=True, residual_out=None,
                      kernel=None):  # fmt: skip
    """``S = x + residual``; ``y = rms_norm(S)``. Returns ``(y, residual_out, rstd)``.

    ``mode="pre"``: ``residual_out = S``. ``mode="post"``: ``residual_out`` is ``y`` itself and ``S``
    is never written to memory. A given ``residual_out`` receives a copy of ``S``: the partitioned kernel
    re-reads the residual after writing S, so it cannot write over the residual it reads. ``kernel``
    forces a path, as in :func:`forward`.
    """
    if mode not in FUSED_ADD_MODES:
        raise ValueError(f"mode must be one of {FUSED_ADD_MODES}, got {mode!r}")
    if residual.shape != x.shape or not dense_rows(residual):
        raise ValueError("residual must have x's shape and unit column stride")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual dtype {residual.dtype} must match x dtype {x.dtype}")
    y, res_out, rstd = _forward_impl(
        x, residual, weight, eps, offset, casting_mode, store_rstd, mode == "pre", "fused_add", kernel
    )
    if mode == "pre" and residual_out is not None:
        res_out = residual_out.copy_(res_out)
    return y, res_out, rstd
