"""RMSNorm backend in Triton for Huawei Ascend NPUs (triton-ascend).

The same kernels run on NVIDIA GPUs under standard Triton and on the CPU under the Triton
interpreter (``TRITON_INTERPRET=1``). Semantics are those of :mod:`tilegym_rms.reference`.

Importing this package never imports triton, torch_npu or triton-ascend: the kernels module is
imported on first use, so :func:`available` can report what is missing instead of failing.

Satisfies :class:`tilegym_rms.dispatch.Backend`, :class:`~tilegym_rms.dispatch.FusedAddBackend` and
:class:`~tilegym_rms.dispatch.WorkspaceBackend`.
"""

from __future__ import annotations

import torch

from tilegym_rms._checks import KERNEL_DTYPES
from tilegym_rms.reference import CASTING_CODES, CASTING_MODES, FUSED_ADD_MODES
from tilegym_rms.triton import config
from tilegym_rms.triton import launch as _launch
from tilegym_rms.triton.config import choose_path, choose_tiles

__all__ = [
    "FORWARD_KERNELS",
    "SUPPORTED_DTYPES",
    "backward_workspace_bytes",
    "available",
    "backward",
    "choose_path",
    "choose_tiles",
    "forward",
    "fused_add_forward",
]

SUPPORTED_DTYPES = KERNEL_DTYPES
FORWARD_KERNELS = config.PATHS
_TRITON_INSTALL_HINT = "triton is not installed: pip install 'tilegym_rms[triton]' (NVIDIA GPUs, CPU interpreter)"
_NPU_INSTALL_HINT = "torch_npu / triton-ascend not installed: pip install 'tilegym_rms[ascend]'"


def _kernels():
    # Deferred: importing triton (and jitting the kernels) only when a kernel is about to run.
    from tilegym_rms.triton import kernels

    return kernels


def available(device) -> tuple[bool, str]:
    """Whether this backend can run on ``device``, and if not, why."""
    device = torch.device(device)
    try:
        import triton
    except ImportError:
        return False, _TRITON_INSTALL_HINT
    if device.type == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return False, _NPU_INSTALL_HINT
        try:
            backend = triton.runtime.driver.active.get_current_target().backend
        except (
            AttributeError,
            RuntimeError,
        ) as exc:  # no active driver, or not the Ascend backend's
            return False, f"{_NPU_INSTALL_HINT} (no active Triton NPU driver: {exc})"
        if backend != "npu":
            return (
                False,
                f"{_NPU_INSTALL_HINT} (active Triton backend is {backend!r}, not 'npu')",
            )
        return True, ""
    if config.interpreter_enabled():
        if device.type not in ("cpu", "cuda"):
            return (
                False,
                f"the Triton interpreter does not support device type {device.type!r}",
            )
        try:
            import numpy  # noqa: F401
        except ImportError:
            return (
                False,
                "the Triton interpreter (TRITON_INTERPRET=1) needs numpy: pip install numpy",
            )
        return True, ""
    if device.type == "cpu":
        return False, "CPU needs TRITON_INTERPRET=1"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        return True, ""
    return False, f"unsupported device type {device.type!r}"


def _dense_rows(t) -> bool:
    """Unit column stride, or a single column (whose stride is never used, and which torch calls
    contiguous whatever it is)."""
    return t.stride(1) == 1 or t.shape[1] <= 1


def _check(x, weight, casting_mode) -> None:
    if x.dim() != 2 or not _dense_rows(x):
        raise ValueError(f"x must be 2-D with unit column stride, got shape {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x dtype must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
    if weight is not None and (weight.shape != (x.shape[1],) or not weight.is_contiguous()):
        raise ValueError(f"weight must be a contiguous ({x.shape[1]},) tensor, got shape {tuple(weight.shape)}")


def _schedule(tiles, device) -> tuple[int, int]:
    """``(grid, tasks_per_program)`` for a tiling: at most one program per core and per row task.

    The block-row schedule hands each program a contiguous slab of ``tasks_per_program`` row blocks;
    the grid is then trimmed so that no program's slab is empty.
    """
    grid = config.grid_size(tiles.num_tasks, device)
    tasks_per_program = config.cdiv(tiles.num_tasks, grid)
    if tiles.path == "block_row":
        grid = config.cdiv(tiles.num_tasks, tasks_per_program)
    return grid, tasks_per_program


def _forward_impl(x, residual, weight, eps, offset, casting_mode, store_rstd, store_residual, op, path=None):
    """Shared launch of the plain and fused forward: the fused add is the kernels' HAS_RESIDUAL case."""
    _check(x, weight, casting_mode)
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    res_out = torch.empty((M, N), dtype=x.dtype, device=x.device) if store_residual else y
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device) if store_rstd else None
    k = _kernels()
    tiles = choose_tiles(M, N, x.dtype, op, path)
    grid, tasks_per_program = _schedule(tiles, x.device)
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
    if residual.shape != x.shape or not _dense_rows(residual):
        raise ValueError("residual must have x's shape and unit column stride")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual dtype {residual.dtype} must match x dtype {x.dtype}")
    y, res_out, rstd = _forward_impl(
        x, residual, weight, eps, offset, casting_mode, store_rstd, mode == "pre", "fused_add", kernel
    )
    if mode == "pre" and residual_out is not None:
        res_out = residual_out.copy_(res_out)
    return y, res_out, rstd


def backward_workspace_bytes(m: int, n: int, dtype: torch.dtype, device) -> int:
    """Bytes of the fp32 dw partial buffer (grid x N x 4) that :func:`backward` allocates with a weight."""
    if m == 0:
        return 0
    tiles = choose_tiles(m, n, dtype, "backward")
    return _schedule(tiles, torch.device(device))[0] * n * 4


def backward(x, dy, weight, rstd, offset, casting_mode):
    """RMSNorm backward (the fp32 formula for every casting mode). Returns ``(dx, dw)``.

    ``dx = rstd * (w~*dy - x^ * mean(x^ * w~ * dy))`` with ``x^ = x*rstd``, ``w~ = offset + w``;
    ``dw = sum_rows(dy * x^)`` in weight's dtype, or None without weight. dw is reduced in two
    deterministic steps: per-program fp32 rows ``(grid, N)``, then a reduction kernel.
    """
    _check(x, weight, casting_mode)
    if dy.shape != x.shape or not _dense_rows(dy):
        raise ValueError("dy must have x's shape and unit column stride")
    M, N = x.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    has_w = weight is not None
    k = _kernels()
    rstd = rstd.to(torch.float32).contiguous()
    tiles = choose_tiles(M, N, x.dtype, "backward")
    grid, tasks_per_program = _schedule(tiles, x.device)
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
    dw = torch.empty((N,), dtype=weight.dtype, device=x.device)
    P = grid
    block_p = min(config.REDUCE_BLOCK_P, config.next_pow2(P))
    block_n = config.reduce_block_n(N)
    reduce_grid = config.grid_size(config.cdiv(N, block_n), x.device)
    _launch.launch(
        k.rms_norm_dw_reduce_kernel,
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
    return dx, dw
