"""The forward host: the norm (:meth:`tilegym_rms.dispatch.Backend.forward`) and the fused residual add
(:meth:`tilegym_rms.dispatch.FusedAddBackend.fused_add_forward`, the kernels' ``ADD`` switch) on 2-D ``(M, N)``
views whose last dim is dense: one launch of the gather, the persistent (walking its row tiles, or one tile per
block) or the split kernel (a block per column chunk, after zeroing its ticket and marking its sums empty)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...batch_invariance import is_batch_invariant
from ...reference import CASTING_CODES
from .. import config
from . import common
from .common import Launch, Target, make_launch, plain, target, weight_arg

# The kernels' ADD switch (kernels.ADD_NONE / ADD_PRE / ADD_POST; kernels imports cuda.tile).
ADD_NONE, ADD_MODES = 0, {"pre": 1, "post": 2}


def config_for(tgt: Target, m: int, n: int, dtype: torch.dtype, kernel=None, op="forward") -> config.ForwardConfig:
    """The forward configuration for an ``(m, n)`` input: tiles from M's bucket (a new M compiles nothing
    new), the grid from the real M. ``op`` "fused_forward": the fused add's own table entry first (it moves
    twice the bytes per row), else the other 16-bit dtype's, then the plain forward's. In the batch-invariant
    mode: the gather kernel as for one row."""
    cfg = config.forward_config(config.m_bucket(m), n, dtype, tgt.sms, kernel, tgt.table, op, tgt.invariant)
    if cfg.kernel == "gather":
        grid = m
    elif cfg.kernel == "split":  # a block per (row, chunk), every one exactly: the kernel counts on its tickets
        grid = m * config.cdiv(n, cfg.tile_n)
    else:
        grid = min(cfg.grid, config.cdiv(m, cfg.tile_m))
    return dataclasses.replace(cfg, grid=grid)


@dataclasses.dataclass(frozen=True)
class ForwardLaunch(Launch):
    rows: int  # M: rstd's length (one call's shape is cheaper read here than from the tensor)
    allocates_rstd: bool  # the persistent and split kernels always store rstd (see kernels.STORE_RSTD)
    sum_slots: int = 0  # split: the fp32 slots per row for the chunks' sums of squares (0: another kernel)


def forward_launch(tgt: Target, m, n, dtype, kernel, casting_mode, has_w, store_rstd, add) -> ForwardLaunch:
    """The launch of one forward call (``add``: the kernels' ADD, :data:`ADD_NONE` or one of
    :data:`ADD_MODES`)."""
    k = common.kernels()
    cfg = config_for(tgt, m, n, dtype, kernel, "fused_forward" if add != ADD_NONE else "forward")
    cast = CASTING_CODES[casting_mode]
    slots = 0  # split: one fp32 slot per chunk, a power of two per row
    if cfg.kernel == "gather":
        kernel, grid = k.rms_norm_fwd_gather, (m,)
        constants = (cfg.tile_n, cast, has_w, cfg.single_tile, store_rstd, add)
    elif cfg.kernel == "split":
        chunks = config.cdiv(n, cfg.tile_n)
        slots = config.next_pow2(chunks)
        kernel, grid = k.rms_norm_fwd_split, (cfg.grid,)
        constants = (cfg.tile_n, chunks, slots, cast, has_w, add)
    else:  # "persistent" walks its row tiles, "tiles" runs one per block
        kernel, grid = k.rms_norm_fwd_persistent, (cfg.grid,)
        exact_n = n == cfg.tile_n  # a power of two (tiles are), the row one tile without a tail
        constants = (cfg.tile_m, cfg.tile_n, cfg.tail_n, cast, has_w, add, exact_n, cfg.kernel == "persistent")
    allocates_rstd = store_rstd or cfg.kernel != "gather"
    return make_launch(kernel, grid, constants, cfg.hints, ForwardLaunch, rows=m, allocates_rstd=allocates_rstd,
                       sum_slots=slots)  # fmt: skip


def start(fl: ForwardLaunch, x, residual, res_out, weight, eps, offset, dev: int, launch) -> tuple:
    """``(y, rstd)``: allocates the outputs of one forward call and launches its kernel (see :mod:`.common`).
    ``residual`` is read and ``res_out`` written in the fused add's "pre" mode (None without the add);
    ``rstd`` is None unless ``fl`` allocates it."""
    y = torch.empty_like(x)  # contiguous: x's rows are dense (the cheapest allocation call, 1.8 us)
    # Sizes as separate ints: torch parses them faster than a tuple (PERFORMANCE.md, "Host path").
    rstd = torch.empty(fl.rows, dtype=torch.float32, device=x.device) if fl.allocates_rstd else None
    x = plain(x)
    # Without rstd the kernel stores none, without the add it reads no residual and writes no sum: y and x
    # stand in for those arguments.
    args = (x, weight_arg(weight, x), y, y if rstd is None else rstd, x if residual is None else plain(residual),
            y if res_out is None else res_out)  # fmt: skip
    if fl.sum_slots:  # the split kernel's sums (-1: none yet) and its ticket (kernels.rms_norm_fwd_split)
        sums = torch.full((fl.rows * fl.sum_slots,), -1.0, dtype=torch.float32, device=x.device)
        args += (sums, torch.zeros(1, dtype=torch.int32, device=x.device))
    args += (float(eps), float(offset), *fl.constants)
    launch(fl.kernel, fl.grid, args, dev, fl.hints, fl.built)
    return y, rstd


# Keyed by the batch-invariant mode too (is_batch_invariant(), read at each call), which changes the launches.
@functools.lru_cache(maxsize=4096)
def cached_config(dev: int, m: int, n: int, dtype, kernel, op="forward", invariant=False) -> config.ForwardConfig:
    return config_for(target(dev, invariant), m, n, dtype, kernel, op)


@functools.lru_cache(maxsize=4096)
def cached_launch(
    dev: int, m, n, dtype, kernel, casting_mode, has_w, store_rstd, add, invariant=False
) -> ForwardLaunch:
    # The fused add (both modes) looks up its own table entry, else its fallbacks (tuning.fallback_chain): cached
    # apart from the plain norm's, since the two may differ.
    return forward_launch(target(dev, invariant), m, n, dtype, kernel, casting_mode, has_w, store_rstd, add)


CACHES = (cached_config, cached_launch)


def forward(x, weight, eps, offset, casting_mode, *, store_rstd=True, kernel=None):
    """``(y, rstd)`` for a 2-D ``x`` (``rstd`` None unless ``store_rstd``); see
    :class:`tilegym_rms.dispatch.Backend`. ``kernel``: one of ``config.FORWARD_KERNELS``, None chooses."""
    m, n = x.shape
    dev = x.get_device()
    fl = cached_launch(dev, m, n, x.dtype, kernel, casting_mode, weight is not None, store_rstd, ADD_NONE,
                       is_batch_invariant())  # fmt: skip
    y, rstd = start(fl, x, None, None, weight, eps, offset, dev, common.launcher())
    return y, (rstd if store_rstd else None)


def fused_add_forward(x, residual, weight, eps, offset, casting_mode, *, mode, store_rstd=True, residual_out=None,
                      kernel=None):  # fmt: skip
    """``(y, residual_out, rstd)`` of ``s = x + residual`` in one pass; see
    :class:`tilegym_rms.dispatch.FusedAddBackend`. ``residual`` may have another dtype than ``x`` (the sum
    is kept in residual's). ``residual_out`` (mode "pre") may be ``residual`` itself: each element of the
    residual is read before the kernel overwrites it with its sum, by the same block (kernels.ADD)."""
    if mode == "pre" and residual_out is None:
        residual_out = torch.empty_like(residual)  # contiguous, as y: residual's rows are dense
    res_out = residual_out if mode == "pre" else None
    m, n = x.shape
    dev = x.get_device()
    fl = cached_launch(dev, m, n, x.dtype, kernel, casting_mode, weight is not None, store_rstd, ADD_MODES[mode],
                       is_batch_invariant())  # fmt: skip
    y, rstd = start(fl, x, residual, res_out, weight, eps, offset, dev, common.launcher())
    return y, (res_out if mode == "pre" else y), (rstd if store_rstd else None)


def forward_config(x: torch.Tensor, kernel: str | None = None) -> config.ForwardConfig:
    """The forward configuration the dispatcher picks for ``x`` (M, N); tests assert on it."""
    m, n = x.shape
    return cached_config(common.device_index(x.device), m, n, x.dtype, kernel, "forward", is_batch_invariant())
