"""Tile sizing and path selection for the Ascend (triton-ascend) RMSNorm kernels.

Everything here is plain Python (no triton import at module level), so the dispatch decisions can
be unit-tested without a device. The launch code in :mod:`tilegym_rms.triton` calls
:func:`choose_tiles`, which calls :func:`choose_path`; tests call the same functions to assert which
path a shape takes.

Sizing model. Each Ascend vector core owns a small Unified Buffer (UB): 192 KB on Atlas A2. A tile
that does not fit fails to compile, so tiles are sized against a byte budget rather than tuned for
occupancy as on CUDA. Half of the UB is usable per tile because the compiler double-buffers loads
against compute, and we keep a safety margin for the compiler's own scratch (masks, reductions,
weight row). A tile costs ``LIVE_TILES[op] * 4`` bytes per element: every tile is computed in fp32,
and ``LIVE_TILES`` is a conservative count of the tile-sized values alive at the same time.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from .._tiling import cdiv, next_pow2, prev_pow2

# --- Unified Buffer budget ---------------------------------------------------------------------
UB_BYTES_ENV = "TILEGYM_RMS_UB_BYTES"
DEFAULT_UB_BYTES = 192 * 1024  # Atlas A2 vector core
UB_SAFETY_FRACTION = 0.875  # room for compiler scratch that our live-tile count does not see
UB_DOUBLE_BUFFER_DIVISOR = 2  # the compiler ping-pongs loads against compute: half the UB per tile
FP32_BYTES = 4  # tiles are computed in fp32 whatever the input dtype

# Tile-sized fp32 values alive at once (conservative): forward x, x*rstd, y; fused add also
# the residual; backward x, dy, x^, w~*dy, dx, dy*x^; the gated norm also z and silu(z) (and its slope, dz
# and the gate's products in the backward).
LIVE_TILES = {"forward": 3, "fused_add": 4, "backward": 6, "gated_forward": 4, "gated_backward": 10}
MIN_TILE_ELEMS = 16  # floor so that an absurdly small override still yields a valid tile

# --- Path thresholds -----------------------------------------------------------------------------
BLOCK_ROW_MAX_N = 512  # block-row path only for small hidden sizes ...
BLOCK_ROW_MIN_M = 4096  # ... and only with enough rows to give every core long contiguous slabs
BLOCK_M_CAP = 16  # block path: rows per tile at most (keeps several row tasks per core)
BLOCK_ROW_CAP = 64  # block-row path: rows per step at most
REDUCE_BLOCK_P = 16  # dw reduction: partial rows summed per step
REDUCE_BLOCK_N_CAP = 1024  # dw reduction: columns per program task at most

# --- Grid ----------------------------------------------------------------------------------------
INTERPRETER_NUM_PROGRAMS = 4  # TRITON_INTERPRET=1: a few programs exercise the grid-stride loops

PATHS = ("block", "block_row", "partitioned")
OPS = tuple(LIVE_TILES)


def ub_bytes() -> int:
    """The Unified Buffer size that tiles are sized against: ``TILEGYM_RMS_UB_BYTES`` if set, else 192 KB."""
    value = os.environ.get(UB_BYTES_ENV, "").strip()
    if not value:
        return DEFAULT_UB_BYTES
    try:
        parsed = int(value)
    except ValueError as exc:
        raise ValueError(f"{UB_BYTES_ENV} must be an integer byte count, got {value!r}") from exc
    if parsed <= 0:
        raise ValueError(f"{UB_BYTES_ENV} must be positive, got {parsed}")
    return parsed


def max_tile_elems(op: str) -> int:
    """Largest power-of-two element count of one fp32 tile of ``op`` that fits the UB budget."""
    if op not in LIVE_TILES:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    usable = int(ub_bytes() * UB_SAFETY_FRACTION) // UB_DOUBLE_BUFFER_DIVISOR
    elems = usable // (LIVE_TILES[op] * FP32_BYTES)
    return max(MIN_TILE_ELEMS, prev_pow2(elems))


def choose_path(M: int, N: int, dtype=None, op: str = "forward") -> str:
    """Which kernel path ``op`` takes for an ``(M, N)`` input.

    * ``"partitioned"``: one row does not fit the tile budget; columns are processed in chunks.
    * ``"block_row"``: small hidden size (``N <= BLOCK_ROW_MAX_N``) with many rows
      (``M >= BLOCK_ROW_MIN_M``); each program walks a contiguous slab of rows, several per step.
    * ``"block"``: everything else; a row fits, programs take row blocks in grid-stride order.

    ``dtype`` is accepted for API stability: tiles are budgeted in fp32, so it does not change the
    decision today.
    """
    del dtype
    if next_pow2(N) > max_tile_elems(op):
        return "partitioned"
    if N <= BLOCK_ROW_MAX_N and M >= BLOCK_ROW_MIN_M:
        return "block_row"
    return "block"


@dataclass(frozen=True)
class Tiling:
    """How a launch tiles its input: the path, the tile shape and the alignment flags the kernels
    specialize on."""

    path: str
    block_m: int
    block_n: int
    num_tasks: int  # row blocks of ``block_m`` rows

    even_m: bool  # M % block_m == 0: the row mask can be dropped at compile time
    even_n: bool  # N % block_n == 0: the column mask can be dropped at compile time


def choose_tiles(
    M: int, N: int, dtype=None, op: str = "forward", path: str | None = None, invariant: bool = False
) -> Tiling:
    """The path from :func:`choose_path` (or ``path``, to force one) plus the tile shape for it.

    Block path: ``BLOCK_N = next_pow2(N)``; ``BLOCK_M`` fills the budget, capped by ``BLOCK_M_CAP``
    and by ``next_pow2(M)`` (no point in masked rows beyond M). Block-row: as many rows per step as
    fit, capped by ``BLOCK_ROW_CAP``. Partitioned: one row per task, the largest column chunk that
    fits.

    ``invariant`` (the batch-invariant mode): the path and tiles of the largest M, for every M (a row tile's
    shape sets how the compiler lays out, and so sums, a row), and never the block-row schedule, whose
    slabs and rows per step follow M.
    """
    budget = max_tile_elems(op)
    if invariant and path == "block_row":
        raise ValueError(
            "path 'block_row' walks slabs of rows whose length follows M: not batch invariant; in the "
            "batch-invariant mode the path must be None, 'block' or 'partitioned'"
        )
    if path is None:
        path = "block" if invariant and next_pow2(N) <= budget else choose_path(M, N, dtype, op)
    elif path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    elif path != "partitioned" and next_pow2(N) > budget:
        raise ValueError(f"path {path!r} needs a whole row in one tile; N={N} exceeds the {budget}-element budget")
    if path == "partitioned":
        block_m, block_n = 1, min(budget, next_pow2(N))
    else:
        block_n = next_pow2(N)
        rows = prev_pow2(budget // block_n)
        cap = BLOCK_ROW_CAP if path == "block_row" else BLOCK_M_CAP if invariant else min(BLOCK_M_CAP, next_pow2(M))
        block_m = max(1, min(rows, cap))
    num_tasks = cdiv(M, block_m)
    return Tiling(path, block_m, block_n, num_tasks, M % block_m == 0, N % block_n == 0)


def reduce_block_n(N: int) -> int:
    """Columns per task of the dw reduction kernel."""
    return min(REDUCE_BLOCK_N_CAP, next_pow2(N))


def interpreter_enabled() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


@functools.cache
def _hardware_programs(device_type: str, index: int) -> int:
    # Cached per device: the property queries go through the driver and are not free.
    if device_type == "npu":
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return int(props["num_vectorcore"])
    if device_type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(index).multi_processor_count)
    raise ValueError(f"no hardware core count for device type {device_type!r}")


def num_programs(device) -> int:
    """Persistent grid size: vector cores on NPU, SMs on CUDA, a small constant in the interpreter."""
    if interpreter_enabled() or device.type == "cpu":
        return INTERPRETER_NUM_PROGRAMS
    index = device.index
    if index is None:
        import torch

        index = torch.npu.current_device() if device.type == "npu" else torch.cuda.current_device()
    return _hardware_programs(device.type, index)


def grid_size(num_tasks: int, device) -> int:
    """Programs to launch for ``num_tasks`` row tasks: never more than the tasks, never zero."""
    return max(1, min(num_programs(device), num_tasks))


def schedule(tiles: Tiling, device) -> tuple[int, int]:
    """``(grid, tasks_per_program)`` for a tiling: at most one program per core and per row task.

    The block-row schedule hands each program a contiguous slab of ``tasks_per_program`` row blocks;
    the grid is then trimmed so that no program's slab is empty.
    """
    grid = grid_size(tiles.num_tasks, device)
    tasks_per_program = cdiv(tiles.num_tasks, grid)
    if tiles.path == "block_row":
        grid = cdiv(tiles.num_tasks, tasks_per_program)
    return grid, tasks_per_program
