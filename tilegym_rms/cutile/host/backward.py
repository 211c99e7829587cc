"""The backward host: the norm's backward (:meth:`tilegym_rms.dispatch.Backend.backward`) and the fused add's
(:meth:`tilegym_rms.dispatch.FusedAddBackwardBackend.fused_add_backward`, the kernels' ``HAS_DRES`` switch) on
2-D views, and the dw reduction the qk backward shares: one to three launches (``config.BackwardConfig.strategy``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...batch_invariance import is_batch_invariant
from .. import config
from . import common
from .common import Launch, Target, make_launch, plain, target, weight_arg


def config_for(tgt: Target, m: int, n: int, dtype: torch.dtype) -> config.BackwardConfig:
    return config.backward_config(m, n, dtype, tgt.sms, tgt.table, tgt.invariant)


def reduce_launch(tgt: Target, n: int) -> Launch:
    """The dw reduction of an fp32 ``(rows, n)`` partial buffer into ``n`` columns."""
    red = config.reduce_config(n, tgt.sms)
    return make_launch(common.kernels().rms_norm_dw_reduce, (red.grid,), (red.tile_g, red.tile_n), red.hints)


def reduce(what: Launch, dw_partial, dw, dev: int, launch) -> None:
    """Launches ``dw = dw_partial.sum(0)`` in a fixed order (``rms_norm_dw_reduce``, built by
    :func:`reduce_launch`); ``dw_partial`` is 2-D."""
    launch(what.kernel, what.grid, (dw_partial, dw, *what.constants), dev, what.hints, what.built)


@dataclass(frozen=True)
class BackwardLaunches:
    """The launches of one backward call: ``main`` writes dx (and dw in the direct strategy, dw partial rows
    otherwise), after ``row_dot`` in the chunked strategy; ``reduce`` sums the partial rows into dw (with a
    weight, outside the direct strategy)."""

    cfg: config.BackwardConfig
    main: Launch
    partial_shape: tuple[int, int]  # the fp32 dw partial buffer; (1, 1): a dummy (direct strategy, no weight)
    row_dot: Launch | None = None
    reduce: Launch | None = None


def backward_launches(tgt: Target, m, n, dtype, has_w, has_dres) -> BackwardLaunches:
    k = common.kernels()
    cfg = config_for(tgt, m, n, dtype)
    if cfg.strategy == "direct":
        constants = (cfg.tile_m, cfg.tile_n, cfg.strip_n, cfg.strip_m, cfg.tile_n >= n, has_w, has_dres)
        grid = (cfg.grid + (cfg.num_chunks if has_w else 0),)
        return BackwardLaunches(cfg, make_launch(k.rms_norm_bwd_direct, grid, constants, cfg.hints), (1, 1))
    partial = (cfg.grid, n) if has_w else (1, 1)
    sums = reduce_launch(tgt, n) if has_w else None
    if cfg.strategy == "persistent":
        constants = (cfg.tile_m, cfg.tile_n, cfg.tail_n, has_w, has_dres, cfg.dw_per_row)
        main = make_launch(k.rms_norm_bwd_persistent, (cfg.grid,), constants, cfg.hints)
        return BackwardLaunches(cfg, main, partial, reduce=sums)
    row_dot_grid = (min(config.cdiv(m, cfg.tile_m), cfg.grid * cfg.num_chunks),)
    row_dot = make_launch(k.rms_norm_bwd_row_dot, row_dot_grid, (cfg.tile_m, cfg.tile_n, has_w), cfg.hints)
    constants = (cfg.tile_m, cfg.tile_n, has_w, has_dres)
    main = make_launch(k.rms_norm_bwd_column_chunk, (cfg.grid, cfg.num_chunks), constants, cfg.hints)
    return BackwardLaunches(cfg, main, partial, row_dot, sums)


def start(bl: BackwardLaunches, x, dy, dres, weight, rstd, offset, dev: int, launch) -> tuple:
    """``(dx, dw)``: allocates the outputs of one backward call and launches its kernels in order (see
    :mod:`.common`); ``dres`` (or None) is added to dx by the kernels' HAS_DRES."""
    dx = torch.empty_like(x)
    dy, x, w = plain(dy), plain(x), weight_arg(weight, x)
    dres = plain(dres) if dres is not None else dx  # a dummy without the add (never read then)
    dw = torch.empty_like(weight) if weight is not None else None  # weight is dense: (N,) contiguous, in its dtype
    offset, main = float(offset), bl.main
    if bl.cfg.strategy == "direct":
        args = (dy, x, w, rstd, dx, w if dw is None else dw, dres, offset, *main.constants)
        launch(main.kernel, main.grid, args, dev, main.hints, main.built)
        return dx, dw
    # A dummy keeps the signature when there is no weight (nothing is written to it then).
    dw_partial = torch.empty(*bl.partial_shape, dtype=torch.float32, device=x.device)
    if bl.row_dot is None:
        args = (dy, x, w, rstd, dx, dw_partial, dres, offset, *main.constants)
    else:
        row_dot, first = torch.empty(x.shape[0], dtype=torch.float32, device=x.device), bl.row_dot
        args = (dy, x, w, rstd, row_dot, offset, *first.constants)
        launch(first.kernel, first.grid, args, dev, first.hints, first.built)
        args = (dy, x, w, rstd, row_dot, dx, dw_partial, dres, offset, *main.constants)
    launch(main.kernel, main.grid, args, dev, main.hints, main.built)
    if dw is not None:
        reduce(bl.reduce, dw_partial, dw, dev, launch)
    return dx, dw


# Keyed by the batch-invariant mode too (is_batch_invariant(), read at each call), which changes the launches.
@functools.lru_cache(maxsize=4096)
def cached_config(dev: int, m: int, n: int, dtype, invariant=False) -> config.BackwardConfig:
    return config_for(target(dev, invariant), m, n, dtype)


@functools.lru_cache(maxsize=4096)
def cached_launches(dev: int, m, n, dtype, has_w, has_dres, invariant=False) -> BackwardLaunches:
    return backward_launches(target(dev, invariant), m, n, dtype, has_w, has_dres)


CACHES = (cached_config, cached_launches)


def backward(x, dy, weight, rstd, offset, casting_mode):
    """``(dx, dw)`` for 2-D ``x`` and ``dy``; see :class:`tilegym_rms.dispatch.Backend`."""
    del casting_mode  # the backward formula is the same for every casting mode
    m, n = x.shape
    dev = x.get_device()
    bl = cached_launches(dev, m, n, x.dtype, weight is not None, False, is_batch_invariant())
    return start(bl, x, dy, None, weight, rstd, offset, dev, common.launcher())


def fused_add_backward(s, dy, dres, weight, rstd, offset, casting_mode):
    """``(ds, dw)``: the norm's backward at the sum ``s`` plus ``dres`` (the gradient of residual_out, mode
    "pre"), added in the same pass; see :class:`tilegym_rms.dispatch.FusedAddBackend`."""
    del casting_mode  # as in backward
    m, n = s.shape
    dev = s.get_device()
    bl = cached_launches(dev, m, n, s.dtype, weight is not None, True, is_batch_invariant())
    return start(bl, s, dy, dres, weight, rstd, offset, dev, common.launcher())


def backward_workspace_bytes(m: int, n: int, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes of the fp32 dw partial buffer (grid x N x 4) the backward allocates (none in the direct strategy)."""
    cfg = cached_config(common.device_index(device), m, n, dtype, is_batch_invariant())
    return 0 if cfg.strategy == "direct" else cfg.grid * n * 4
