"""The Triton gated-norm host (:class:`tilegym_rms.dispatch.GatedBackend`): one forward launch; one backward
launch and the dw reduction of its ``(P, N)`` partial rows. Programs are laid out ``(P, groups)``, one group of
columns per program column; a group wider than one tile's budget runs the reference's torch math."""

from __future__ import annotations

import warnings

import torch

from tilegym_rms import reference
from tilegym_rms.batch_invariance import BatchInvarianceWarning, is_batch_invariant
from tilegym_rms.reference import CASTING_CODES, GATE_CODES
from tilegym_rms.triton import config
from tilegym_rms.triton import launch as _launch
from tilegym_rms.triton.host.backward import reduce_dw
from tilegym_rms.triton.host.common import load_kernels


def _tiles(m: int, group_size: int, dtype, op: str) -> config.Tiling | None:
    """Rows of one group per tile (the block path of :func:`config.choose_tiles` at N = group size), or None
    where a group does not fit one tile: the reference's torch math then runs, whose kernels follow M, so in the
    batch-invariant mode that warns (:class:`BatchInvarianceWarning`)."""
    budget = config.max_tile_elems(op)
    if config.next_pow2(group_size) > budget:
        if is_batch_invariant():
            warnings.warn(
                f"batch-invariant mode: the Triton gated {op.removeprefix('gated_')} takes groups of at most "
                f"{budget} columns; this group of {group_size} runs torch's math, whose results may follow the "
                "number of rows (backend='cutile' takes wider groups)",
                BatchInvarianceWarning,
                stacklevel=4,
            )
        return None
    return config.choose_tiles(m, group_size, dtype, op, "block", is_batch_invariant())


def _grid(tiles: config.Tiling, groups: int, device) -> tuple[int, int]:
    """About one program per core over both axes, at most one per row block along axis 0."""
    return max(1, min(tiles.num_tasks, config.cdiv(config.num_programs(device), groups))), groups


def _flags(tiles: config.Tiling, has_w: bool, norm_before_gate: bool, activation: str) -> dict:
    return {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "HAS_W": has_w,
        "NORM_BEFORE_GATE": norm_before_gate,
        "GATE": GATE_CODES[activation],
        "EVEN_M": tiles.even_m,
        "EVEN_N": tiles.even_n,
    }


def gated_forward(x, z, weight, eps, offset, casting_mode, *, group_size, norm_before_gate, activation="silu",
                  store_rstd=True):  # fmt: skip
    """``(y, rstd)`` for 2-D rows; see :class:`tilegym_rms.dispatch.GatedBackend`."""
    M, N = x.shape
    tiles = _tiles(M, group_size, x.dtype, "gated_forward")
    if tiles is None:
        y, rstd = reference.gated_rms_norm_forward(
            x, z, weight, eps, group_size, norm_before_gate, offset, casting_mode, activation
        )
        return y.contiguous(), rstd
    groups = N // group_size
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty((M, groups), dtype=torch.float32, device=x.device) if store_rstd else None
    args = (x, z, weight if weight is not None else x, y, rstd if store_rstd else y,
            M, N, group_size, x.stride(0), z.stride(0), y.stride(0), float(eps), float(offset))  # fmt: skip
    _launch.launch(
        load_kernels().gated_rms_norm_fwd_kernel,
        _grid(tiles, groups, x.device),
        *args,
        CASTING=CASTING_CODES[casting_mode],
        STORE_RSTD=store_rstd,
        **_flags(tiles, weight is not None, norm_before_gate, activation),
    )
    return y, rstd


def gated_backward(x, z, dy, weight, rstd, offset, casting_mode, *, group_size, norm_before_gate, activation="silu"):
    """``(dx, dz, dw)`` for 2-D rows; see :class:`tilegym_rms.dispatch.GatedBackend`."""
    M, N = x.shape
    tiles = _tiles(M, group_size, x.dtype, "gated_backward")
    if tiles is None:
        dx, dz, dw = reference.gated_rms_norm_backward(
            x, z, dy, weight, rstd, group_size, norm_before_gate, offset, casting_mode, activation
        )
        return dx.contiguous(), dz.contiguous(), dw
    grid = _grid(tiles, N // group_size, x.device)
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    dz = torch.empty((M, N), dtype=z.dtype, device=x.device)
    has_w = weight is not None
    # Every program writes its whole partial row (each of its group's columns, once).
    partial = torch.empty((grid[0], N), dtype=torch.float32, device=x.device) if has_w else dx
    args = (dy, x, z, weight if has_w else x, rstd.contiguous(), dx, dz, partial, M, N, group_size,
            dy.stride(0), x.stride(0), z.stride(0), dx.stride(0), dz.stride(0), float(offset))  # fmt: skip
    flags = _flags(tiles, has_w, norm_before_gate, activation)
    _launch.launch(load_kernels().gated_rms_norm_bwd_kernel, grid, *args, **flags)
    return dx, dz, (reduce_dw(partial, weight) if has_w else None)
