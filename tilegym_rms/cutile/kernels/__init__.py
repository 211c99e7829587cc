"""cuTile RMSNorm kernels, one module per operation (:mod:`.forward`, :mod:`.backward`, :mod:`.qk`,
:mod:`.gated`, :mod:`.fp8`) on the tile helpers of :mod:`.common`.

Every kernel works on a 2-D view ``(M, N)`` whose rows may be strided (the last dim is dense).
Out-of-range columns are loaded as zeros, so padding never changes a sum of squares, a row dot
product or a dw column. Compile-time constants:

* ``TILE_M`` / ``TILE_N``: tile shape (powers of two); ``TILE_N >= N`` in the single-tile kernels.
* ``CAST``: casting mode (:data:`CAST_LLAMA`, :data:`CAST_GEMMA`, :data:`CAST_NONE`).
* ``HAS_W``: False for RMSNorm without affine (the weight argument is then a dummy).
* ``STORE_RSTD`` (gather forward): False when no backward will follow (inference); ``rstd`` is then a
  dummy (the output ``y``), which spares the host an allocation per call. The persistent forward
  always stores rstd, fused add included: without the store its fp32 code ran 5-8% slower
  (PERFORMANCE.md, "Forward"), and at the sizes it serves the allocation does not matter.
* ``ADD`` (forward): the fused residual add, :data:`ADD_NONE`, :data:`ADD_PRE` or :data:`ADD_POST`. The
  kernel normalizes ``s = x + residual``, summed in fp32 and rounded to ``residual``'s dtype (exactly
  :func:`tilegym_rms.reference.fused_add_sum`); the casting mode rounds in that dtype and ``y`` gets
  x's. "pre" also stores ``s`` into ``res_out``. Without the add, ``residual`` is ``x`` and ``res_out``
  ``y`` (dummies, never read or written). ``res_out`` may be ``residual`` itself (the in-place
  variant): every element of ``residual`` is read for the last time in the step that writes its
  ``s``, so the write never precedes a read of the same element.
* ``DW_PER_ROW`` (persistent backward): the block's fp32 dw share is kept as one accumulator per tile row,
  summed over the rows once at the end, instead of a ``(1, TILE_N)`` accumulator that each row tile is
  summed into. The per-step sum over the tile's rows is a reduction across the block's threads; for short
  rows with many rows per tile that reduction, not the loads, sets the pace of a step. It costs
  ``TILE_M x TILE_N`` more fp32 registers. Summation order changes with it, still fixed (deterministic).
* ``HAS_DRES`` (backward): adds ``dres``, the gradient of a fused add's ``residual_out`` (mode "pre"),
  to dx in fp32 before its one rounding, so that ``ds`` is written once; else ``dres`` is a dummy.

``eps`` and ``offset`` are run-time scalars so that changing them never recompiles.
"""

from .backward import (
    rms_norm_bwd_column_chunk,
    rms_norm_bwd_direct,
    rms_norm_bwd_persistent,
    rms_norm_bwd_row_dot,
    rms_norm_dw_reduce,
)
from .common import ADD_NONE, ADD_POST, ADD_PRE, CAST_GEMMA, CAST_LLAMA, CAST_NONE
from .forward import rms_norm_fwd_gather, rms_norm_fwd_persistent, rms_norm_fwd_split
from .fp8 import QUANT_GROUP, QUANT_STATIC, QUANT_TOKEN, rms_norm_fp8_fwd
from .gated import gated_rms_norm_bwd, gated_rms_norm_fwd
from .qk import qk_rms_norm_bwd, qk_rms_norm_fwd

__all__ = [
    "ADD_NONE",
    "ADD_POST",
    "ADD_PRE",
    "CAST_GEMMA",
    "CAST_LLAMA",
    "CAST_NONE",
    "QUANT_GROUP",
    "QUANT_STATIC",
    "QUANT_TOKEN",
    "gated_rms_norm_bwd",
    "gated_rms_norm_fwd",
    "qk_rms_norm_bwd",
    "qk_rms_norm_fwd",
    "rms_norm_bwd_column_chunk",
    "rms_norm_bwd_direct",
    "rms_norm_bwd_persistent",
    "rms_norm_bwd_row_dot",
    "rms_norm_dw_reduce",
    "rms_norm_fp8_fwd",
    "rms_norm_fwd_gather",
    "rms_norm_fwd_persistent",
    "rms_norm_fwd_split",
]
