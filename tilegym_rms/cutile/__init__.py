"""cuTile backend: host side of the kernels in :mod:`.kernels`, tuned by :mod:`.config` and :mod:`.tuning`.

Implements the backend contract of :mod:`tilegym_rms.dispatch` on 2-D ``(M, N)`` views whose
last dim is dense, with the fused residual add (:class:`~tilegym_rms.dispatch.FusedAddBackend`, the
kernels' ``ADD`` and ``HAS_DRES`` switches). ``cuda.tile`` is imported lazily so that this package
imports anywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .._checks import KERNEL_DTYPES
from ..reference import CASTING_CODES
from . import config, tuning

# Compute capabilities that tileiras targets: 8.x, 9.0, 10.x and 12.x.
SUPPORTED_CC_MAJORS = (8, 10, 12)
SUPPORTED_CC_EXACT = ((9, 0),)
SUPPORTED_DTYPES = KERNEL_DTYPES
FORWARD_KERNELS = config.FORWARD_KERNELS
# The kernels add in fp32 and round to the residual's dtype, whatever x's (an fp32 residual stream).
FUSED_ADD_MIXED_DTYPES = True
# The kernels' ADD switch (kernels.ADD_NONE / ADD_PRE / ADD_POST; kernels imports cuda.tile).
_ADD_NONE, _ADD_MODES = 0, {"pre": 1, "post": 2}


@functools.cache
def _toolchain_status() -> tuple[bool, str]:
    try:
        import cuda.tile  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return False, f"cuda.tile is not importable ({exc}); pip install 'tilegym_rms[cuda]'"
    try:
        from cuda.tile._compile import _find_compiler_bin

        _find_compiler_bin()
    except Exception as exc:
        return False, f"the tileiras compiler was not found ({exc})"
    return True, ""


def cc_supported(cc: tuple[int, int]) -> bool:
    return cc[0] in SUPPORTED_CC_MAJORS or tuple(cc) in SUPPORTED_CC_EXACT


@functools.cache
def _device_status(device_index: int) -> tuple[bool, str]:
    cc = torch.cuda.get_device_capability(device_index)
    if not cc_supported(cc):
        return False, f"compute capability {cc[0]}.{cc[1]} is not a tileiras target (8.x, 9.0, 10.x, 12.x)"
    return _toolchain_status()


def available(device: torch.device) -> tuple[bool, str]:
    """Whether the cuTile kernels can run on ``device``, and if not, why."""
    if device.type != "cuda":
        return False, f"cuTile runs on CUDA devices, not {device.type}"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is available"
    return _device_status(_device_index(device))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _kernels():
    """The kernel module, imported on first launch (it needs ``cuda.tile``)."""
    from . import kernels

    return kernels


@functools.cache
def _launch():
    from .launch import launch

    return launch


def _plain(t: torch.Tensor) -> torch.Tensor:
    # cuTile reads tensors through DLPack, which refuses tensors that require grad (a slow fallback
    # then); detaching is free of copies.
    return t.detach() if t.requires_grad else t


@functools.lru_cache(maxsize=4096)
def _forward_config(device_index, m, n, dtype, kernel, op="forward"):
    from .launch import num_sms

    # Tiles come from M's bucket (a new M compiles nothing new); the grid follows the real M. ``op``
    # "fused_forward": the fused add's own table entry first (it moves twice the bytes per row).
    table = tuning.table_for(device_index)
    cfg = config.forward_config(config.m_bucket(m), n, dtype, num_sms(device_index), kernel, table, op)
    grid = m if cfg.kernel == "gather" else min(cfg.grid, config.cdiv(m, cfg.tile_m))
    return dataclasses.replace(cfg, grid=grid)


@functools.lru_cache(maxsize=4096)
def _backward_config(device_index, m, n, dtype):
    from .launch import num_sms

    return config.backward_config(m, n, dtype, num_sms(device_index), tuning.table_for(device_index))


@functools.lru_cache(maxsize=4096)
def _reduce_config(device_index, n):
    from .launch import num_sms

    return config.reduce_config(n, num_sms(device_index))


def clear_caches() -> None:
    """Forget the cached configurations and launches (after a tuning script changed :mod:`.config`)."""
    for cache in (_forward_config, _backward_config, _reduce_config, _forward_launch, _backward_launch, _qk_config):
        cache.cache_clear()


def forward_config(x: torch.Tensor, kernel: str | None = None) -> config.ForwardConfig:
    """The forward configuration the dispatcher picks for ``x`` (M, N); tests assert on it."""
    m, n = x.shape
    return _forward_config(_device_index(x.device), m, n, x.dtype, kernel)


def _weight_arg(weight, x):
    # Kernels without affine never read the weight; any 1-D tensor of the right kind stands in.
    return _plain(weight) if weight is not None else x.new_empty((1,))


@dataclasses.dataclass(frozen=True)
class _ForwardLaunch:
    """Everything of one forward launch but its tensors and run-time scalars, cached per call signature
    so that a call does one lookup instead of rebuilding it (host time is the latency at small M)."""

    kernel: object
    built: object  # ``kernel`` built with ``hints`` (launch.with_hints), looked up once here
    grid: tuple[int]
    hints: config.Hints
    constants: tuple  # the kernel's ct.Constant arguments, in order
    allocates_rstd: bool


@functools.lru_cache(maxsize=4096)
def _forward_launch(device_index, m, n, dtype, kernel, casting_mode, has_w, store_rstd, add) -> _ForwardLaunch:
    # The fused add (both modes) looks up its own table entry for x's (M, N, dtype), then the plain
    # norm's (tuning.FALLBACK): cached apart, since the two may differ.
    k = _kernels()
    cfg = _forward_config(device_index, m, n, dtype, kernel, "fused_forward" if add != _ADD_NONE else "forward")
    cast = CASTING_CODES[casting_mode]
    if cfg.kernel == "gather":
        kernel, grid = k.rms_norm_fwd_gather, (m,)
        constants = (cfg.tile_n, cast, has_w, cfg.single_tile, store_rstd, add)
    else:
        kernel, grid = k.rms_norm_fwd_persistent, (cfg.grid,)
        constants = (cfg.tile_m, cfg.tile_n, cfg.tail_n, cast, has_w, add)
    # The persistent kernel always stores rstd (see kernels.STORE_RSTD).
    allocates_rstd = store_rstd or cfg.kernel != "gather"
    return _ForwardLaunch(kernel, _built(kernel, cfg.hints), grid, cfg.hints, constants, allocates_rstd)


def _built(kernel, hints):
    # Through the module attribute: bench/tools/tune_cutile.py swaps launch.with_hints (and clears the plans).
    from . import launch

    return launch.with_hints(kernel, hints)


def _forward(x, residual, res_out, weight, eps, offset, casting_mode, store_rstd, kernel, add):
    """One forward launch: ``(y, rstd)``, with ``add`` the kernels' ADD (``residual`` read, ``res_out``
    written in "pre" mode; both None without the add)."""
    m, n = x.shape
    dev = x.get_device()
    plan = _forward_launch(dev, m, n, x.dtype, kernel, casting_mode, weight is not None, store_rstd, add)
    y = torch.empty_like(x)  # contiguous: x's rows are dense (the cheapest allocation call, 1.8 us)
    # Sizes as separate ints: torch parses them faster than a tuple (PERFORMANCE.md, "Host path").
    rstd = torch.empty(m, dtype=torch.float32, device=x.device) if plan.allocates_rstd else None
    x = _plain(x)
    # Without rstd the kernel stores none, without the add it reads no residual and writes no sum: y and x
    # stand in for those arguments.
    args = (x, _weight_arg(weight, x), y, y if rstd is None else rstd, x if residual is None else _plain(residual),
            y if res_out is None else res_out, float(eps), float(offset), *plan.constants)  # fmt: skip
    _launch()(plan.kernel, plan.grid, args, dev, built=plan.built)
    return y, (rstd if store_rstd else None)


def forward(x, weight, eps, offset, casting_mode, *, store_rstd=True, kernel=None):
    """``(y, rstd)`` for a 2-D ``x`` (``rstd`` None unless ``store_rstd``); see
    :class:`tilegym_rms.dispatch.Backend`. ``kernel``: one of :data:`FORWARD_KERNELS`, None chooses."""
    return _forward(x, None, None, weight, eps, offset, casting_mode, store_rstd, kernel, _ADD_NONE)


def fused_add_forward(x, residual, weight, eps, offset, casting_mode, *, mode, store_rstd=True, residual_out=None,
                      kernel=None):  # fmt: skip
    """``(y, residual_out, rstd)`` of ``s = x + residual`` in one pass; see
    :class:`tilegym_rms.dispatch.FusedAddBackend`. ``residual`` may have another dtype than ``x`` (the sum
    is kept in residual's). ``residual_out`` (mode "pre") may be ``residual`` itself: each element of the
    residual is read before the kernel overwrites it with its sum, by the same block (kernels.ADD)."""
    if mode == "pre" and residual_out is None:
        residual_out = torch.empty_like(residual)  # contiguous, as y: residual's rows are dense
    res_out = residual_out if mode == "pre" else None
    y, rstd = _forward(x, residual, res_out, weight, eps, offset, casting_mode, store_rstd, kernel, _ADD_MODES[mode])
    return y, (res_out if mode == "pre" else y), rstd


def backward_workspace_bytes(m: int, n: int, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes of the fp32 dw partial buffer (grid x N x 4) the backward allocates (none in the direct plan)."""
    cfg = _backward_config(_device_index(device), m, n, dtype)
    return 0 if cfg.plan == "direct" else cfg.grid * n * 4


def _reduce_dw(dw_partial, dw, dev) -> None:
    """``dw = dw_partial.sum(0)`` in a fixed order (``rms_norm_dw_reduce``); ``dw_partial`` is 2-D."""
    red = _reduce_config(dev, dw.shape[0])
    kernel = _kernels().rms_norm_dw_reduce  # no hints: built is the kernel itself
    _launch()(kernel, (red.grid,), (dw_partial, dw, red.tile_g, red.tile_n), dev, built=kernel)


def backward(x, dy, weight, rstd, offset, casting_mode):
    """``(dx, dw)`` for 2-D ``x`` and ``dy``; see :class:`tilegym_rms.dispatch.Backend`."""
    del casting_mode  # the backward formula is the same for every casting mode
    return _backward(x, dy, None, weight, rstd, offset)


def fused_add_backward(s, dy, dres, weight, rstd, offset, casting_mode):
    """``(ds, dw)``: the norm's backward at the sum ``s`` plus ``dres`` (the gradient of residual_out, mode
    "pre"), added in the same pass; see :class:`tilegym_rms.dispatch.FusedAddBackend`."""
    del casting_mode  # as in backward
    return _backward(s, dy, dres, weight, rstd, offset)


@dataclasses.dataclass(frozen=True)
class _BackwardLaunch:
    """The launches of one backward but their tensors and ``offset``, cached per call signature (as
    :class:`_ForwardLaunch`): ``kernel`` writes dx (and dw in the direct plan, dw partial rows otherwise);
    the chunked plan runs ``rms_norm_bwd_row_dot`` over ``row_dot_grid`` first."""

    cfg: config.BackwardConfig
    kernel: object
    built: object  # as in _ForwardLaunch
    grid: tuple[int]
    constants: tuple  # the kernel's ct.Constant arguments, in order
    partial_shape: tuple[int, int]  # the fp32 dw partial buffer; (1, 1): a dummy (direct plan, no weight)
    row_dot_grid: tuple[int] = (0,)
    row_dot_built: object = None  # rms_norm_bwd_row_dot built with the config's hints (chunked plan)
    row_dot_constants: tuple = ()


@functools.lru_cache(maxsize=4096)
def _backward_launch(device_index, m, n, dtype, has_w, has_dres) -> _BackwardLaunch:
    k = _kernels()
    cfg = _backward_config(device_index, m, n, dtype)
    partial = (cfg.grid, n) if has_w and cfg.plan != "direct" else (1, 1)
    if cfg.plan == "direct":
        constants = (cfg.tile_m, cfg.tile_n, cfg.strip_n, cfg.strip_m, has_w, has_dres)
        grid = (cfg.grid + (cfg.num_chunks if has_w else 0),)
        return _BackwardLaunch(
            cfg, k.rms_norm_bwd_direct, _built(k.rms_norm_bwd_direct, cfg.hints), grid, constants, partial
        )
    if cfg.plan == "persistent":
        constants = (cfg.tile_m, cfg.tile_n, cfg.tail_n, has_w, has_dres, cfg.dw_per_row)
        kernel = k.rms_norm_bwd_persistent
        return _BackwardLaunch(cfg, kernel, _built(kernel, cfg.hints), (cfg.grid,), constants, partial)
    row_dot_grid = (min(config.cdiv(m, cfg.tile_m), cfg.grid * cfg.num_chunks),)
    constants = (cfg.tile_m, cfg.tile_n, has_w, has_dres)
    kernel = k.rms_norm_bwd_column_chunk
    grid = (cfg.grid, cfg.num_chunks)
    row_dot = (_built(k.rms_norm_bwd_row_dot, cfg.hints), (cfg.tile_m, cfg.tile_n, has_w))
    return _BackwardLaunch(cfg, kernel, _built(kernel, cfg.hints), grid, constants, partial, row_dot_grid, *row_dot)


def _backward(x, dy, dres, weight, rstd, offset):
    """The backward launches; ``dres`` (or None) is added to dx by the kernels' HAS_DRES."""
    m, n = x.shape
    has_w, has_dres = weight is not None, dres is not None
    dev = x.get_device()
    plan = _backward_launch(dev, m, n, x.dtype, has_w, has_dres)
    launch, cfg = _launch(), plan.cfg
    dx = torch.empty_like(x)
    dy, x, w = _plain(dy), _plain(x), _weight_arg(weight, x)
    dres = _plain(dres) if has_dres else dx  # a dummy without the add (never read then)
    dw = torch.empty_like(weight) if has_w else None  # weight is dense: (N,) contiguous, in its dtype
    if cfg.plan == "direct":
        args = (dy, x, w, rstd, dx, w if dw is None else dw, dres, float(offset), *plan.constants)
        launch(plan.kernel, plan.grid, args, dev, built=plan.built)
        return dx, dw
    # A dummy keeps the signature when there is no weight (nothing is written to it then).
    dw_partial = torch.empty(*plan.partial_shape, dtype=torch.float32, device=x.device)
    if cfg.plan == "persistent":
        args = (dy, x, w, rstd, dx, dw_partial, dres, float(offset))
    else:
        row_dot = torch.empty(m, dtype=torch.float32, device=x.device)
        args = (dy, x, w, rstd, row_dot, float(offset), *plan.row_dot_constants)
        launch(_kernels().rms_norm_bwd_row_dot, plan.row_dot_grid, args, dev, built=plan.row_dot_built)
        args = (dy, x, w, rstd, row_dot, dx, dw_partial, dres, float(offset))
    launch(plan.kernel, plan.grid, args + plan.constants, dev, built=plan.built)
    if has_w:
        _reduce_dw(dw_partial, dw, dev)
    return dx, dw


# ----------------------------------------------------------------------------------------------
# QK-norm (dispatch.QKNormBackend): q and k in one launch forward, one backward (and the dw reduction)
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _qk_config(device_index, m_q, m_k, d, dtype):
    from .launch import num_sms

    table = tuning.table_for(device_index)
    entry = table.lookup("qk", m_q + m_k, d, dtype) if table is not None else None
    return config.qk_config(m_q, m_k, d, dtype, num_sms(device_index), entry)


def _tile_rows_along_dim0(*views):
    """The kernels take row tiles along dim 0 of a ``(G, H, D)`` view. Where H > G (few, long groups: gaps
    between batches only) every tile would hold G rows and pad the rest: the same rows are handed over as
    ``(H, G, D)`` views instead (rstd too), which keeps the row order of the buffers."""
    return tuple(v.transpose(0, 1) for v in views) if views[0].shape[1] > views[0].shape[0] else views


def qk_forward(q, k, q_weight, k_weight, eps, offset, casting_mode):
    """``(q_out, k_out, q_rstd, k_rstd)`` for 3-D views; see :class:`tilegym_rms.dispatch.QKNormBackend`."""
    dev = q.get_device()
    cfg = _qk_config(dev, q.shape[0] * q.shape[1], k.shape[0] * k.shape[1], q.shape[2], q.dtype)
    yq, yk = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rq, rk = (t.new_empty(t.shape[:2], dtype=torch.float32) for t in (q, k))
    qv, yqv, rqv = _tile_rows_along_dim0(_plain(q), yq, rq)
    kv, ykv, rkv = _tile_rows_along_dim0(_plain(k), yk, rk)
    args = (qv, kv, _weight_arg(q_weight, q), _weight_arg(k_weight, k), yqv, ykv, rqv, rkv, float(eps), float(offset))
    args += (cfg.fwd_tile_m, cfg.tile_n, CASTING_CODES[casting_mode], q_weight is not None, k_weight is not None)
    _launch()(_kernels().qk_rms_norm_fwd, (cfg.fwd_grid,), args, dev, cfg.fwd_hints)
    return yq, yk, rq, rk


def _qk_dw(dw_partial, q_weight, k_weight, dev):
    """Both weights' dw from the ``(grid, 2, D)`` partials: one reduction over ``2 * D`` columns when both
    exist in one dtype, else one per weight over its slot."""
    d = dw_partial.shape[2]
    if q_weight is not None and k_weight is not None and q_weight.dtype == k_weight.dtype:
        dw = q_weight.new_empty((2, d))
        _reduce_dw(dw_partial.view(dw_partial.shape[0], 2 * d), dw.view(2 * d), dev)
        return dw[0], dw[1]
    dws = []
    for slot, w in enumerate((q_weight, k_weight)):
        dws.append(None if w is None else w.new_empty((d,)))
        if w is not None:
            _reduce_dw(dw_partial[:, slot], dws[-1], dev)
    return tuple(dws)


def qk_backward(q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset, casting_mode):
    """``(dq, dk, dq_weight, dk_weight)``; see :class:`tilegym_rms.dispatch.QKNormBackend`."""
    del casting_mode  # the backward formula is the same for every casting mode
    dev = q.get_device()
    d = q.shape[2]
    cfg = _qk_config(dev, q.shape[0] * q.shape[1], k.shape[0] * k.shape[1], d, q.dtype)
    dq, dk = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    has_w = q_weight is not None or k_weight is not None
    # A dummy keeps the signature when there is no weight (nothing is written to it then).
    dw_partial = q.new_empty((cfg.bwd_grid, 2, d) if has_w else (1, 1, 1), dtype=torch.float32)
    qv = _tile_rows_along_dim0(_plain(dq_out), _plain(q), q_rstd, dq)
    kv = _tile_rows_along_dim0(_plain(dk_out), _plain(k), k_rstd, dk)
    args = (qv[0], kv[0], qv[1], kv[1], _weight_arg(q_weight, q), _weight_arg(k_weight, k), qv[2], kv[2], qv[3], kv[3])
    args += (dw_partial, float(offset), cfg.bwd_tile_m, cfg.tile_n, q_weight is not None, k_weight is not None)
    _launch()(_kernels().qk_rms_norm_bwd, (cfg.bwd_grid,), args, dev, cfg.bwd_hints)
    return (dq, dk, *_qk_dw(dw_partial, q_weight, k_weight, dev)) if has_w else (dq, dk, None, None)
