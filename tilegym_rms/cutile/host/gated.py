"""The gated-norm host (:class:`tilegym_rms.dispatch.GatedBackend`): one forward launch; one backward launch and
the dw reduction of its ``(grid, N)`` partial buffer. The kernels take 3-D ``(M, G, S)`` views of the ``(M, N)``
rows (G groups of S columns); a group wider than their widest tile (``config.gated_config``) runs the
reference's torch math instead."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ... import reference
from ...batch_invariance import is_batch_invariant
from ...reference import CASTING_CODES, GATE_CODES
from .. import config
from . import common
from .backward import reduce, reduce_launch
from .common import Launch, Target, make_launch, plain, target


def config_for(tgt: Target, m: int, n: int, group_size: int, dtype: torch.dtype, gate_dtype: torch.dtype | None = None,
               norm_before_gate: bool = True) -> config.GatedConfig | None:  # fmt: skip
    return config.gated_config(
        m, n, group_size, dtype, tgt.sms, tgt.invariant, gate_dtype, norm_before_gate, tgt.params()
    )


def forward_launch(tgt: Target, m, n, group_size, dtype, casting_mode, has_w, norm_before_gate, store_rstd,
                   activation="silu") -> Launch | None:  # fmt: skip
    """The forward's launch, or None where the torch math runs (see :func:`config_for`)."""
    cfg = config_for(tgt, m, n, group_size, dtype, norm_before_gate=norm_before_gate)
    if cfg is None:
        return None
    f = cfg.fwd
    constants = (f.tile_m, f.tile_g, *cfg.group_tiles(f), CASTING_CODES[casting_mode], has_w, norm_before_gate,
                 GATE_CODES[activation], store_rstd, f.walk)  # fmt: skip
    return make_launch(common.kernels().gated_rms_norm_fwd, f.grid, constants, f.hints)


@dataclass(frozen=True)
class GatedBackwardLaunches:
    """The gated backward and, with a weight, the dw reduction of its ``(grid, N)`` partial buffer."""

    main: Launch
    partial_shape: tuple[int, int]  # (1, 1): a dummy without a weight
    reduce: Launch | None


def backward_launches(tgt: Target, m, n, group_size, dtype, gate_dtype, has_w, norm_before_gate,
                      activation="silu") -> GatedBackwardLaunches | None:  # fmt: skip
    """The backward's launches, or None where the torch math runs (see :func:`config_for`)."""
    cfg = config_for(tgt, m, n, group_size, dtype, gate_dtype, norm_before_gate)
    if cfg is None:
        return None
    b = cfg.bwd
    constants = (b.tile_m, b.tile_g, cfg.tile_s, has_w, norm_before_gate, GATE_CODES[activation])
    main = make_launch(common.kernels().gated_rms_norm_bwd, b.grid, constants, b.hints)
    if not has_w:
        return GatedBackwardLaunches(main, (1, 1), None)
    return GatedBackwardLaunches(main, (b.grid[0], n), reduce_launch(tgt, n))


def _groups(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """The ``(M, G, S)`` view of ``(M, N)`` rows (``(G, S)`` of a weight): splitting the dense last dim is
    always a view."""
    return t.view(*t.shape[:-1], t.shape[-1] // group_size, group_size)


def _weight_arg(weight, x, group_size):
    # Without a weight the kernels never read it; a 2-D tensor keeps the rank of the weight's view.
    return _groups(plain(weight), group_size) if weight is not None else x.new_empty((1, 1))


def start_forward(fl: Launch, x, z, weight, eps, offset, group_size, store_rstd, dev: int, launch) -> tuple:
    """``(y, rstd)``: allocates the outputs of the gated forward and launches it (see :mod:`.common`); ``rstd``
    ``(M, G)``, None unless ``store_rstd``."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y3 = _groups(y, group_size)
    rstd = x.new_empty((x.shape[0], y3.shape[1]), dtype=torch.float32) if store_rstd else None
    args = (_groups(plain(x), group_size), _groups(plain(z), group_size), _weight_arg(weight, x, group_size), y3,
            rstd if rstd is not None else y3, float(eps), float(offset), *fl.constants)  # fmt: skip
    launch(fl.kernel, fl.grid, args, dev, fl.hints, fl.built)
    return y, rstd


def start_backward(bl: GatedBackwardLaunches, x, z, dy, weight, rstd, offset, group_size, dev: int, launch) -> tuple:
    """``(dx, dz, dw)``: allocates the outputs of the gated backward and launches it and the dw reduction (see
    :mod:`.common`); ``dw`` None without a weight."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    dw_partial = x.new_empty(bl.partial_shape, dtype=torch.float32)
    partial = _groups(dw_partial, group_size) if weight is not None else dw_partial.view(1, 1, 1)
    args = (_groups(plain(dy), group_size), _groups(plain(x), group_size), _groups(plain(z), group_size),
            _weight_arg(weight, x, group_size), plain(rstd), _groups(dx, group_size), _groups(dz, group_size),
            partial, float(offset), *bl.main.constants)  # fmt: skip
    launch(bl.main.kernel, bl.main.grid, args, dev, bl.main.hints, bl.main.built)
    if bl.reduce is None:
        return dx, dz, None
    dw = weight.new_empty(weight.shape)
    reduce(bl.reduce, dw_partial, dw, dev, launch)
    return dx, dz, dw


# Keyed by the batch-invariant mode too (is_batch_invariant(), read at each call), which changes the launches.
@functools.lru_cache(maxsize=4096)
def cached_forward(dev: int, m, n, group_size, dtype, casting_mode, has_w, norm_before_gate, store_rstd,
                   activation="silu", invariant=False) -> Launch | None:  # fmt: skip
    args = (m, n, group_size, dtype, casting_mode, has_w, norm_before_gate, store_rstd, activation)
    return forward_launch(target(dev, invariant), *args)


@functools.lru_cache(maxsize=4096)
def cached_backward(dev: int, m, n, group_size, dtype, gate_dtype, has_w, norm_before_gate, activation="silu",
                    invariant=False) -> GatedBackwardLaunches | None:  # fmt: skip
    args = (m, n, group_size, dtype, gate_dtype, has_w, norm_before_gate, activation)
    return backward_launches(target(dev, invariant), *args)


CACHES = (cached_forward, cached_backward)


def gated_forward(x, z, weight, eps, offset, casting_mode, *, group_size, norm_before_gate, activation="silu",
                  store_rstd=True):  # fmt: skip
    """``(y, rstd)`` for 2-D rows; see :class:`tilegym_rms.dispatch.GatedBackend`."""
    dev = x.get_device()
    fl = cached_forward(dev, *x.shape, group_size, x.dtype, casting_mode, weight is not None, norm_before_gate,
                        store_rstd, activation, is_batch_invariant())  # fmt: skip
    if fl is None:
        y, rstd = reference.gated_rms_norm_forward(
            x, z, weight, eps, group_size, norm_before_gate, offset, casting_mode, activation
        )
        return y.contiguous(), rstd
    return start_forward(fl, x, z, weight, eps, offset, group_size, store_rstd, dev, common.launcher())


def gated_backward(x, z, dy, weight, rstd, offset, casting_mode, *, group_size, norm_before_gate, activation="silu"):
    """``(dx, dz, dw)`` for 2-D rows; see :class:`tilegym_rms.dispatch.GatedBackend`."""
    dev = x.get_device()
    bl = cached_backward(dev, *x.shape, group_size, x.dtype, z.dtype, weight is not None, norm_before_gate, activation,
                         is_batch_invariant())  # fmt: skip
    if bl is None:
        dx, dz, dw = reference.gated_rms_norm_backward(
            x, z, dy, weight, rstd, group_size, norm_before_gate, offset, casting_mode, activation
        )
        return dx.contiguous(), dz.contiguous(), dw
    del casting_mode  # the backward formula is the same for every casting mode
    return start_backward(bl, x, z, dy, weight, rstd, offset, group_size, dev, common.launcher())
