"""Triton RMSNorm kernels written for triton-ascend; they also run under standard Triton and in the interpreter.

Kernels (all marked experimental on ``npu``: they have not run on Ascend hardware yet; the gated ones on
``cuda`` too, until the GPU tests have run them):

* :data:`rms_norm_fwd_kernel`: a row fits one tile. Each step normalizes ``BLOCK_M`` whole rows.
  With ``HAS_RESIDUAL`` it is the single-pass fused residual add: ``S = x + residual`` stays on chip
  and x, residual are read once. ``BLOCK_ROW_SCHEDULE`` selects the block-row schedule (each program
  owns a contiguous slab of row blocks) instead of the grid-stride one.
* :data:`rms_norm_fwd_partitioned_kernel`: a row does not fit. Pass 1 accumulates the sum of squares
  over column chunks (writing ``S`` in fused "pre" mode), pass 2 normalizes chunk by chunk,
  recomputing ``S`` from x and residual.
* :data:`rms_norm_bwd_kernel` / :data:`rms_norm_bwd_partitioned_kernel`: the backward, same split.
  Each program accumulates its dw contribution in fp32 into its own row of a ``(grid, N)`` buffer.
* :data:`rms_norm_dw_reduce_kernel`: sums the per-program dw rows in a fixed order (deterministic,
  no atomics) and casts to the weight dtype.
* :data:`gated_rms_norm_fwd_kernel` / :data:`gated_rms_norm_bwd_kernel`: the gated norm, a group of columns
  per program column (:mod:`.gated`).

Constraints kept for triton-ascend: no ``num_warps``/``num_stages``/cache or eviction hints, no fp64,
no unsigned loads, power-of-two ``tl.arange`` sizes. Every tile is computed in fp32; masks are
compile-time optional (``EVEN_M`` drops the row mask, ``EVEN_N`` the column mask).
"""

from __future__ import annotations

from .backward import rms_norm_bwd_kernel, rms_norm_bwd_partitioned_kernel, rms_norm_dw_reduce_kernel
from .forward import rms_norm_fwd_kernel, rms_norm_fwd_partitioned_kernel
from .gated import gated_rms_norm_bwd_kernel, gated_rms_norm_fwd_kernel

ALL_KERNELS = (
    rms_norm_fwd_kernel,
    rms_norm_fwd_partitioned_kernel,
    rms_norm_bwd_kernel,
    rms_norm_bwd_partitioned_kernel,
    rms_norm_dw_reduce_kernel,
    gated_rms_norm_fwd_kernel,
    gated_rms_norm_bwd_kernel,
)
