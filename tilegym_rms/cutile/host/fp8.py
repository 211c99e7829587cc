"""The FP8-output host (:class:`tilegym_rms.dispatch.FP8Backend`): the norm, or the fused add, quantized to fp8 in
one launch of ``rms_norm_fp8_fwd`` on 2-D ``(M, N)`` views whose last dim is dense."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...batch_invariance import is_batch_invariant
from ...reference import CASTING_CODES, fp8_amax_floor
from .. import config
from . import common
from .common import Launch, Target, make_launch, plain, target, weight_arg
from .forward import ADD_MODES, ADD_NONE

# The kernel's QUANT and WORDS switches (kernels.QUANT_* and kernels.WORDS_*; kernels imports cuda.tile).
QUANT_STATIC, QUANT_TOKEN, QUANT_GROUP = 0, 1, 2
WORDS_NONE, WORDS_E4M3, WORDS_E5M2 = 0, 1, 2
FP8_MAX_N = config.FP8_MAX_TILE_N  # wider rows: ops/fp8.py runs the norm, then quantizes in torch


def quant_mode(static: bool, group_size) -> int:
    return QUANT_STATIC if static else QUANT_TOKEN if group_size is None else QUANT_GROUP


def words_mode(n: int, out_dtype: torch.dtype, wanted: bool) -> int:
    """How the kernel stores y_q: as int64 words of 8 fp8 values where ``wanted`` (the configuration's choice) and
    a row is whole words (the view of a fresh contiguous y_q is then 8-byte aligned), else value by value."""
    if not wanted or n % 8:
        return WORDS_NONE
    return WORDS_E5M2 if out_dtype == torch.float8_e5m2 else WORDS_E4M3


@dataclass(frozen=True)
class FP8Launch(Launch):
    words: int  # the kernel's WORDS: y_q is passed as its int64 view unless WORDS_NONE


def fp8_launch(tgt: Target, m, n, dtype, casting_mode, has_w, add, quant, group_size, has_ub, ue8m0,
               out_dtype) -> FP8Launch:  # fmt: skip
    """The launch of one call (``add``: the kernel's ADD, :data:`.forward.ADD_NONE` or "pre"'s; ``quant``: one
    of :data:`QUANT_STATIC`, :data:`QUANT_TOKEN`, :data:`QUANT_GROUP`; ``out_dtype``: y_q's, which sets how it is
    stored, :func:`words_mode`). ``dtype`` is x's: the tiles count elements, the same for every dtype."""
    del dtype
    grouped = group_size if quant == QUANT_GROUP else None
    cfg = config.fp8_config(m, n, grouped, tgt.sms, tgt.invariant, tgt.params(), add=add != ADD_NONE)
    group = grouped or 1  # the constant of the other modes, never read
    walk = cfg.grid < config.cdiv(m, cfg.tile_m)  # else each block owns exactly one tile
    words = words_mode(n, out_dtype, cfg.words)
    constants = (cfg.tile_m, cfg.tile_n, cfg.tail_n, CASTING_CODES[casting_mode], has_w, add, quant, group, has_ub,
                 ue8m0, words, walk)  # fmt: skip
    kernel = common.kernels().rms_norm_fp8_fwd
    return make_launch(kernel, (cfg.grid,), constants, cfg.hints, cls=FP8Launch, words=words)


def start(fl: FP8Launch, x, residual, weight, scale, scale_ub, out_dtype, group_size, eps, offset, dev: int,
          launch) -> tuple:  # fmt: skip
    """``(y_q, scales)``: allocates the outputs of one call and launches its kernel (see :mod:`.common`).
    ``scales`` is None when ``scale`` (static) is given, else fp32 ``(M, 1)`` per row or ``(M, cdiv(N,
    group_size))`` per group. With ``residual`` its rows get the sum, in place."""
    m, n = x.shape
    y_q = torch.empty((m, n), dtype=out_dtype, device=x.device)
    scales = None
    if scale is None:
        groups = 1 if group_size is None else config.cdiv(n, group_size)
        scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    x = plain(x)
    # The kernel writes per-row scales as a vector; a static call writes none and reads scale instead. Arguments a
    # call never touches stand in for the others (the one-element scale_in, scale_ub).
    out_scales = scale if scales is None else scales.view(m) if group_size is None else scales
    scale_in = scale if scale is not None else scales.view(-1)
    res = x if residual is None else plain(residual)
    fp8_max = torch.finfo(out_dtype).max
    y_arg = y_q if fl.words == WORDS_NONE else y_q.view(torch.int64)
    args = (x, weight_arg(weight, x), y_arg, out_scales, scale_in, scale_in if scale_ub is None else scale_ub, res,
            res if residual is not None else y_q, float(eps), float(offset), fp8_max, fp8_amax_floor(group_size),
            *fl.constants)  # fmt: skip
    launch(fl.kernel, fl.grid, args, dev, fl.hints, fl.built)
    return y_q, scales


# Keyed by the batch-invariant mode (is_batch_invariant(), read at each call), which changes the tiles.
@functools.lru_cache(maxsize=4096)
def cached_launch(dev: int, m, n, dtype, casting_mode, has_w, add, quant, group_size, has_ub, ue8m0, out_dtype,
                  invariant=False) -> FP8Launch:  # fmt: skip
    return fp8_launch(target(dev, invariant), m, n, dtype, casting_mode, has_w, add, quant, group_size, has_ub, ue8m0,
                      out_dtype)  # fmt: skip


CACHES = (cached_launch,)


def fp8_forward(x, residual, weight, eps, offset, casting_mode, *, out_dtype, scale, group_size, scale_ub, use_ue8m0):
    """``(y_q, scales)`` of a 2-D ``x`` of at most :data:`FP8_MAX_N` columns (with ``residual``, of the sum
    ``x + residual``, written over ``residual``); see :class:`tilegym_rms.dispatch.FP8Backend`."""
    m, n = x.shape
    dev = x.get_device()
    add = ADD_NONE if residual is None else ADD_MODES["pre"]
    quant = quant_mode(scale is not None, group_size)
    fl = cached_launch(dev, m, n, x.dtype, casting_mode, weight is not None, add, quant, group_size,
                       scale_ub is not None, use_ue8m0, out_dtype, is_batch_invariant())  # fmt: skip
    return start(fl, x, residual, weight, scale, scale_ub, out_dtype, group_size, eps, offset, dev, common.launcher())
