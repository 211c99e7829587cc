"""Compile check: every cuTile kernel variant the dispatcher can select compiles to a cubin.

Needs no GPU, only ``cuda-tile`` and the matched tileiras toolchain. Run it as
``python -m tilegym_rms.aot [--arch sm_90 ...]`` or ``tilegym-rms aot``: it prints a table and
exits non-zero on any failure. The variants are what the host launches (:mod:`tilegym_rms.cutile.host`: its
own functions run on meta tensors, each launch recorded instead of made) under the heuristics and the shipped
tuning tables, over a representative set of hidden sizes (the arithmetic-only axes, other dtypes than bf16
included, at one width per tile class, ``TILE_CLASS_N``).
"""

from __future__ import annotations

import argparse
import inspect
import io
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .cutile import _toolchain_status, config, fp8_cc_supported
from .cutile.host import backward as bwd
from .cutile.host import forward as fwd
from .cutile.host import fp8, gated, qk
from .cutile.host.common import Target
from .experimental import kernel_name
from .reference import CASTING_MODES, DEFAULT_CASTING_MODE

ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")
# Hidden sizes that reach every tile shape class: tiny, a head dim (the short-row hints), non-power-of-two,
# the common LLM widths, rows split into a tile and a tail tile (5120, 12288), the widest single tile
# (32768), and rows wider than one tile (chunked kernels).
REPRESENTATIVE_N = (64, 128, 1000, 4096, 5120, 8192, 12288, 16384, 32768, 65536)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One width per tile class: a narrow single tile, a tile plus a tail tile at two widths, column chunks.
# The axes that change a kernel's arithmetic but not its tiles are compiled at these widths only: the
# casting-mode, no-weight and no-rstd switches, and the dtypes other than bf16 (the dtype LLMs train and
# serve in gets every width). That keeps the check within CI's time: four archs on two cores.
TILE_CLASS_N = (64, 5120, 12288, 65536)
# Large and small M reach both forward kernels; SM count of an H100 (the heuristics scale with it).
REPRESENTATIVE_M = (128, 65536)
REFERENCE_SMS = 132


@dataclass(frozen=True)
class Variant:
    kernel_name: str
    params: tuple  # per kernel parameter: ("array", dtype, ndim) | ("scalar",) | a constant value
    hints: tuple = ()  # compiler hints (see tilegym_rms.cutile.launch.with_hints)

    def describe(self) -> str:
        shown = []
        for p in self.params:
            if isinstance(p, tuple) and p[0] == "array":
                shown.append(str(p[1]).replace("torch.", ""))
            elif not isinstance(p, tuple):
                shown.append(str(p))
        hints = "".join(f" {k}={v}" for k, v in self.hints)
        return f"{self.kernel_name}[{','.join(shown)}]{hints}"

    def constants(self) -> dict[str, object]:
        """The compile-time constants by the kernel's parameter names, e.g. ``{"TILE_N": 4096, "CAST": 0, ...}``."""
        from .cutile import kernels

        names = inspect.signature(getattr(kernels, self.kernel_name)._pyfunc).parameters
        return {name: p for name, p in zip(names, self.params, strict=True) if not isinstance(p, tuple)}


def params_of(args: tuple) -> tuple:
    """:attr:`Variant.params` of a launch's arguments: arrays by dtype and rank, float scalars, constants."""
    return tuple(
        ("array", a.dtype, a.ndim) if isinstance(a, torch.Tensor) else ("scalar",) if isinstance(a, float) else a
        for a in args
    )


def _collector(grids: dict | None = None):
    """``(found, record)``: ``record`` is a launcher for the host's ``start`` functions
    (:mod:`tilegym_rms.cutile.host.common`) that keeps the variant of each launch in ``found``, in order, and
    its first launch's grid in ``grids`` when given."""
    found: dict[Variant, None] = {}

    def record(kernel, grid, args, device_index, hints=(), built=None):
        variant = Variant(kernel_name(kernel), params_of(args), hints)
        found.setdefault(variant, None)
        if grids is not None:
            grids.setdefault(variant, tuple(grid))

    return found, record


def _meta(dtype, *shape) -> torch.Tensor:
    # The host allocates and views tensors as for a launch; on the meta device that costs nothing.
    return torch.empty(shape, dtype=dtype, device="meta")


def _available(target: Target, m: int, n: int, dtype, kernels, op: str = "forward") -> list:
    """The forward kernels of ``kernels`` (None: the dispatcher's choice) that serve rows of ``n``."""
    out = []
    for kernel in kernels:
        try:
            fwd.config_for(target, m, n, dtype, kernel, op)
        except ValueError:
            continue  # e.g. the persistent kernel on rows wider than its widest tile
        out.append(kernel)
    return out


def variants_for(
    m: int,
    n: int,
    dtype,
    num_sms: int = REFERENCE_SMS,
    kernels=(None, *config.FORWARD_KERNELS),
    every_path: bool = True,
    table=None,
    invariant: bool = False,
    grids: dict | None = None,
) -> list[Variant]:
    """The kernel variants the dispatcher launches for an ``(m, n)`` input of ``dtype`` (forward in each of
    ``kernels``, backward and the dw reduction): with ``every_path``, every casting mode, the no-weight and
    the no-rstd variants on bf16; otherwise only a training call's (default casting, weight, rstd stored).
    ``table``: a tuning table whose winners the configs follow (None: the analytic heuristics); ``invariant``:
    in the batch-invariant mode; ``grids``, when given, receives each variant's launch grid. The weight has
    x's dtype."""
    target = Target(num_sms, table, invariant)
    found, record = _collector(grids)
    x, w, rstd = _meta(dtype, m, n), _meta(dtype, n), _meta(torch.float32, m)
    for kernel in _available(target, m, n, dtype, kernels):
        # Every mode with a weight, the default without ("torch" launches "gemma"'s variant: one entry).
        for casting_mode, has_w in (*((mode, True) for mode in CASTING_MODES), (DEFAULT_CASTING_MODE, False)):
            if (dtype != torch.bfloat16 or not every_path) and (casting_mode, has_w) != (DEFAULT_CASTING_MODE, True):
                continue  # the cast / no-weight axes are covered once, on bf16
            for store in (True, False) if every_path else (True,):
                launch = fwd.forward_launch(target, m, n, dtype, kernel, casting_mode, has_w, store, fwd.ADD_NONE)
                fwd.start(launch, x, None, None, w if has_w else None, 0.0, 0.0, -1, record)
    for has_w in (True, False) if every_path else (True,):
        launches = bwd.backward_launches(target, m, n, dtype, has_w, False)
        bwd.start(launches, x, x, None, w if has_w else None, rstd, 0.0, -1, record)
    return list(found)


# The fused residual add: (x dtype, residual dtype) pairs, the fp32 residual stream included, over widths
# that reach a single tile, a tile plus a tail tile and the chunked kernels. Representative rather than
# exhaustive (the variants of the plain norm cover the tile shapes): every mode and the no-rstd forward
# on bf16 only, and the other dtype pairs at the tile-plus-tail width (5120) only.
FUSED_ADD_DTYPES = (
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
)
FUSED_ADD_N = (1000, 5120, 65536)


def fused_add_variants_for(
    m: int,
    n: int,
    dtype,
    residual_dtype,
    num_sms: int = REFERENCE_SMS,
    kernels=config.FORWARD_KERNELS,
    table=None,
    invariant: bool = False,
) -> list[Variant]:
    """The variants a fused add of ``(m, n)`` launches: the forward in each of ``kernels`` (None: the
    dispatcher's choice), in modes "pre" and "post", and the backward adding the gradient of residual_out
    (``HAS_DRES``), which runs on the sum (``residual_dtype``, as its weight). The default casting with a
    weight of x's dtype. ``table``: a tuning table whose winners the configs follow (the forward's ``fused_forward``
    entry, then its ``forward`` one, as the host); ``invariant``: in the batch-invariant mode."""
    target = Target(num_sms, table, invariant)
    found, record = _collector()
    full = dtype == residual_dtype == torch.bfloat16
    x, w, residual = _meta(dtype, m, n), _meta(dtype, n), _meta(residual_dtype, m, n)
    for kernel in _available(target, m, n, dtype, kernels, "fused_forward"):
        for mode in fwd.ADD_MODES if full else ("pre",):
            for store in (True, False) if full else (True,):
                add_mode = fwd.ADD_MODES[mode]
                launch = fwd.forward_launch(target, m, n, dtype, kernel, DEFAULT_CASTING_MODE, True, store, add_mode)
                res_out = torch.empty_like(residual) if mode == "pre" else None  # as the host's fused_add_forward
                fwd.start(launch, x, residual, res_out, w, 0.0, 0.0, -1, record)
    launches = bwd.backward_launches(target, m, n, residual_dtype, True, True)
    s, rstd = residual, _meta(torch.float32, m)
    bwd.start(launches, s, s, s, _meta(residual_dtype, n), rstd, 0.0, -1, record)
    return list(found)


def variants(arch: str | None = None) -> list[Variant]:
    """The distinct kernel variants reachable from the dispatcher over the representative grid, plus the
    measured winners of the tuning tables for ``arch`` (None: of every table). An arch without fp8 types
    (``cutile.FP8_MIN_CC``) gets no FP8 kernel: the host quantizes after the norm there."""
    found = dict.fromkeys(_heuristic_variants())
    found.update(dict.fromkeys(table_variants(arch)))
    if arch is not None and not fp8_arch(arch):
        return [v for v in found if v.kernel_name != FP8_KERNEL]
    return list(found)


FP8_KERNEL = "rms_norm_fp8_fwd"


def fp8_arch(arch: str) -> bool:
    """Whether ``arch`` (``sm_90``) has the fp8 types the FP8 kernel stores."""
    digits = arch.removeprefix("sm_")
    return fp8_cc_supported((int(digits[:-1]), int(digits[-1])))


def _heuristic_variants() -> list[Variant]:
    """What the heuristics (``config.HEURISTICS``, as overridden at the call) launch over the representative grid,
    in the default and in the batch-invariant mode (the gather forward and the direct backward at every width)."""
    found: dict[Variant, None] = dict.fromkeys(qk_variants())
    found.update(dict.fromkeys(gated_variants()))
    found.update(dict.fromkeys(fp8_variants()))
    for invariant in (False, True):
        for dtype in DTYPES:
            for n in REPRESENTATIVE_N if dtype == torch.bfloat16 else TILE_CLASS_N:
                for m in REPRESENTATIVE_M:
                    more = variants_for(m, n, dtype, every_path=n in TILE_CLASS_N, invariant=invariant)
                    found.update(dict.fromkeys(more))
        for dtype, residual_dtype in FUSED_ADD_DTYPES:
            for n in FUSED_ADD_N if dtype == residual_dtype == torch.bfloat16 else FUSED_ADD_N[1:2]:
                for m in REPRESENTATIVE_M:
                    more = fused_add_variants_for(m, n, dtype, residual_dtype, invariant=invariant)
                    found.update(dict.fromkeys(more))
    # The reduction's strip width depends on N alone; every width the heuristic can pick is compiled, in
    # every dw dtype, and in bf16 without the occupancy hint (reduce_occupancy 0, which an override may ask for).
    reductions, record = _collector()
    tile_n = config.HEURISTICS.reduce_min_tile_n
    while tile_n <= config.HEURISTICS.reduce_max_tile_n:
        n = tile_n * REFERENCE_SMS
        assert config.reduce_config(n, REFERENCE_SMS).tile_n == tile_n
        launch = bwd.reduce_launch(Target(REFERENCE_SMS), n)
        for dtype in DTYPES:
            bwd.reduce(launch, _meta(torch.float32, REFERENCE_SMS, n), _meta(dtype, n), -1, record)
        with config.override(reduce_occupancy=0):
            launch = bwd.reduce_launch(Target(REFERENCE_SMS), n)
        bwd.reduce(launch, _meta(torch.float32, REFERENCE_SMS, n), _meta(torch.bfloat16, n), -1, record)
        tile_n *= 2
    found.update(reductions)
    return list(found)


def table_arch(doc: dict) -> str:
    """The compile target of a tuning table's device class, e.g. ``"sm_90"`` for ``sm90_132sm``."""
    major, minor = doc["device"]["capability"]
    return f"sm_{major}{minor}"


def table_variants(arch: str | None = None) -> list[Variant]:
    """The variants the shipped tuning tables' measured winners launch (bench/tools/tune_table.py may pick tiles,
    hints and kernels the heuristics never do; analytic entries are the heuristics', covered above): a
    training call's variants at each measured run (the fused forward's: both modes, x and the residual of
    one dtype; a backward winner's also with the residual gradient, as the fused add runs it). A winner's
    constants do not depend on N within its bucket, so the bucket's own width stands for every N in it.

    With ``arch``, only the tables of that compile target: a table applies to its own device class alone
    (other devices fall back to the heuristics), so its winners need no cubin for the other archs."""
    from .cutile import tuning

    found: dict[Variant, None] = {}
    for key in tuning.packaged_keys():
        table = tuning.packaged(key)
        if arch is not None and table_arch(table.doc) != arch:
            continue
        sms = table.doc["device"]["sms"]
        for op in tuning.OPS:
            for dt, by_n in table.doc.get(op, {}).items():
                dtype = tuning.DTYPES[dt]
                for n_b, runs in by_n.items():
                    for run in (r for r in runs if "gbps" in r):
                        if op == "fused_forward":
                            more = fused_add_variants_for(run["m"], int(n_b), dtype, dtype, sms, (None,), table)
                        elif op == "qk":  # k's rows: q's and k's together fall in the run's M bucket
                            m_k = max(1, run["m"] // (QK_HEADS_RATIO + 1))
                            more = qk_variants_for(m_k, int(n_b), dtype, sms, False, table)
                        else:
                            more = variants_for(run["m"], int(n_b), dtype, sms, (None,), False, table)
                        if op == "backward":  # the fused add's backward (HAS_DRES) runs on the same winner
                            more += fused_add_variants_for(run["m"], int(n_b), dtype, dtype, sms, (), table)
                        found.update(dict.fromkeys(more))
    return list(found)


# ----------------------------------------------------------------------------------------------
# QK-norm: the qk kernels on 4-D (A, G, H, D) views and the dw reduction of their partial buffer
# ----------------------------------------------------------------------------------------------

# Head dims of the common models; the other sizes of a head dim share these tile classes (96 pads to 128).
QK_REPRESENTATIVE_D = (64, 128, 256)
# Head dims a head tile plus a tail tile can hold (config.qk_head_tiles): 64 + 16 and 64 + 32.
QK_TAIL_D = (80, 96)
# GQA: 4 query heads per key head in the dense layouts (their tiles do not depend on the heads). Rows of q and
# k: a small and a large step, as REPRESENTATIVE_M.
QK_HEADS_RATIO = 4
# Head counts (q, k) of the strided layouts, whose tiles split along tokens and heads (config.qk_tile_split):
# powers of two at 4:1 and 8:1, and head counts that are not (40 and 28 query heads).
QK_HEADS = ((32, 8), (32, 4), (40, 8), (28, 4))
# The (A, G, H) shapes ops/qk.py hands over for ``tokens`` tokens of ``heads`` heads: a dense tensor, a slice
# of a fused qkv output (tokens, heads), and a gradient transposed back from a (B, H, S, D) consumer beside a
# dense q (batch 2, sequence, heads).
QK_LAYOUTS = ("dense", "qkv_slice", "transposed_back")


def qk_view_shape(layout: str, tokens: int, heads: int) -> tuple[int, int, int]:
    if layout == "dense":
        return 1, 1, tokens * heads
    if layout == "qkv_slice":
        return 1, tokens, heads
    return 2, max(tokens // 2, 1), heads


def qk_variants_for(
    m: int,
    d: int,
    dtype,
    num_sms: int = REFERENCE_SMS,
    every_path: bool = True,
    table=None,
    layout: str = "dense",
    heads: tuple[int, int] = (QK_HEADS_RATIO, 1),
) -> list[Variant]:
    """The qk kernel variants for ``m`` tokens of k (``heads`` query and key heads per token; dense: ``m`` rows
    of k, ``QK_HEADS_RATIO * m`` of q) of head dim ``d`` in ``layout`` (:data:`QK_LAYOUTS`): forward, backward
    and the dw reduction; with ``every_path``, every casting mode and the no-weight variants on bf16 (as
    :func:`variants_for`). ``table``: a tuning table whose qk winners the configs follow (None: the heuristics).
    The weights have q's dtype."""
    target = Target(num_sms, table)
    found, record = _collector()
    tokens = m if layout != "dense" else m // heads[1]
    shapes = tuple(qk_view_shape(layout, tokens, h) for h in heads)
    q, k = (_meta(dtype, *shape, d) for shape in shapes)
    w = _meta(dtype, d)
    first = DEFAULT_CASTING_MODE
    modes = (first, *(mode for mode in CASTING_MODES if mode != first))  # a training call's first
    combos = (*((mode, True, True) for mode in modes), (first, False, False), (first, True, False))
    for casting_mode, has_wq, has_wk in combos if dtype == torch.bfloat16 and every_path else combos[:1]:
        wq, wk = (w if has else None for has in (has_wq, has_wk))
        launch = qk.forward_launch(target, *shapes, d, dtype, casting_mode, has_wq, has_wk)
        *_, rq, rk = qk.start_forward(launch, q, k, wq, wk, 0.0, 0.0, -1, record)
        launches = qk.backward_launches(target, *shapes, d, dtype, has_wq, has_wk, has_wq and has_wk)
        qk.start_backward(launches, q, k, q, k, wq, wk, rq, rk, 0.0, -1, record)
    return list(found)


def qk_variants() -> list[Variant]:
    """The distinct qk variants over the representative head dims, dtypes, row counts, layouts and head counts
    (the casting and weight axes at one head dim in the dense layout: they add no tile shape)."""
    found: dict[Variant, None] = {}
    for dtype in DTYPES:
        for d in QK_REPRESENTATIVE_D if dtype == torch.bfloat16 else (128,):  # other dtypes: as TILE_CLASS_N
            for m in REPRESENTATIVE_M:
                found.update(dict.fromkeys(qk_variants_for(m, d, dtype, every_path=d == 128)))
                for layout in QK_LAYOUTS[1:]:
                    for heads in QK_HEADS:
                        more = qk_variants_for(m, d, dtype, every_path=False, layout=layout, heads=heads)
                        found.update(dict.fromkeys(more))
    # The forward of one tile per block (a tuning entry's fwd_blocks_per_sm 0), 4096-element tiles at occupancy 8.
    with config.override(qk_fwd_blocks_per_sm=0, qk_fwd_tile_elems=4096, qk_fwd_occupancy=8):
        for d in QK_REPRESENTATIVE_D:
            found.update(dict.fromkeys(qk_variants_for(REPRESENTATIVE_M[-1], d, torch.bfloat16, every_path=False)))
    # Heads held as a tile and a tail by the forward too (qk_fwd_min_tail_n; the backward by default): 80 and 96
    # columns, dense and a fused qkv slice.
    with config.override(qk_fwd_min_tail_n=16):
        for d in QK_TAIL_D:
            for layout, heads in (("dense", (QK_HEADS_RATIO, 1)), ("qkv_slice", QK_HEADS[0])):
                more = qk_variants_for(REPRESENTATIVE_M[-1], d, torch.bfloat16, False, layout=layout, heads=heads)
                found.update(dict.fromkeys(more))
    return list(found)


# ----------------------------------------------------------------------------------------------
# Gated RMSNorm: the gated kernels on (M, G, S) views and the dw reduction of their partial buffer
# ----------------------------------------------------------------------------------------------

# (N, group size) that reach each tile class: one head-dim group (Qwen3-Next), a row as one group padded to
# a wide tile, three groups in a tile of four, many groups of a size that is not a power of two, and a wide row
# of power-of-two groups (Mamba2); the arithmetic-only axes at the last one (GATED_FULL).
GATED_SHAPES = ((128, 128), (5120, 5120), (1536, 512), (3072, 96), (8192, 1024))
GATED_FULL = (8192, 1024)
# (x dtype, gate dtype) pairs beyond bf16 with a bf16 gate, at GATED_FULL only: an fp32 gate beside 16-bit x.
GATED_MORE_DTYPES = ((torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float32))


def gated_variants_for(
    m: int, n: int, group_size: int, dtype, gate_dtype, num_sms: int = REFERENCE_SMS, every_path: bool = True,
    invariant: bool = False, activation: str = "silu",
) -> list[Variant]:  # fmt: skip
    """The gated kernel variants for ``(m, n)`` rows in groups of ``group_size`` gated by ``activation``: forward,
    backward and the dw reduction, for both orders of norm and gate; with ``every_path``, every casting mode, the
    no-weight and the no-rstd variants too (a training call's: the default casting, a weight of x's dtype, rstd
    stored)."""
    target = Target(num_sms, None, invariant)
    found, record = _collector()
    x, z, w = _meta(dtype, m, n), _meta(gate_dtype, m, n), _meta(dtype, n)
    first = (DEFAULT_CASTING_MODE, True, True)
    combos = (first, *((mode, True, True) for mode in CASTING_MODES if mode != first[0]),
              (DEFAULT_CASTING_MODE, False, True), (DEFAULT_CASTING_MODE, True, False))  # fmt: skip
    for norm_before_gate in (True, False):
        for casting_mode, has_w, store in combos if every_path else combos[:1]:
            weight = w if has_w else None
            fl = gated.forward_launch(
                target, m, n, group_size, dtype, casting_mode, has_w, norm_before_gate, store, activation
            )
            _, rstd = gated.start_forward(fl, x, z, weight, 0.0, 0.0, group_size, store, -1, record)
            if store:
                bl = gated.backward_launches(
                    target, m, n, group_size, dtype, gate_dtype, has_w, norm_before_gate, activation
                )
                gated.start_backward(bl, x, z, x, weight, rstd, 0.0, group_size, -1, record)
    return list(found)


def gated_variants() -> list[Variant]:
    """The distinct gated variants over :data:`GATED_SHAPES` at both representative M (the casting, weight and
    rstd axes, the sigmoid gate and the other dtype pairs at :data:`GATED_FULL` and the large M only: they add no
    tile shape), and a training call's in the batch-invariant mode."""
    found: dict[Variant, None] = {}
    for n, group_size in GATED_SHAPES:
        for m in REPRESENTATIVE_M:
            full = (n, group_size) == GATED_FULL and m == REPRESENTATIVE_M[-1]
            more = gated_variants_for(m, n, group_size, torch.bfloat16, torch.bfloat16, every_path=full)
            found.update(dict.fromkeys(more))
            for dtype, gate_dtype in GATED_MORE_DTYPES if full else ():
                found.update(dict.fromkeys(gated_variants_for(m, n, group_size, dtype, gate_dtype, every_path=False)))
            if full:  # the sigmoid gate on every path; its arithmetic differs from silu's, its tiles do not
                more = gated_variants_for(m, n, group_size, torch.bfloat16, torch.bfloat16, activation="sigmoid")
                found.update(dict.fromkeys(more))
        more = gated_variants_for(
            REPRESENTATIVE_M[0], n, group_size, torch.bfloat16, torch.bfloat16, False, False, True
        )
        found.update(dict.fromkeys(more))
    with config.override(gated_narrow_fwd_walk=True):  # the one-head forward walked, the switch's other side
        more = gated_variants_for(REPRESENTATIVE_M[-1], 128, 128, torch.bfloat16, torch.bfloat16, every_path=False)
        found.update(dict.fromkeys(more))
    return list(found)


# ----------------------------------------------------------------------------------------------
# FP8 output: rms_norm_fp8_fwd over its quantization modes, the fused add and both fp8 dtypes
# ----------------------------------------------------------------------------------------------

# Widths that reach the kernel's tile classes: a row narrower than a group (the tile is the group), a
# non-power-of-two row whose last group is partial, the common LLM widths, and the widest tile (FP8_MAX_N).
FP8_N = (32, 1000, 4096, 5120, 16384)
# The width at which every switch is compiled (the others take the default call of each quantization mode).
FP8_FULL_N = 5120
# (static, group_size) of each quantization mode: static, per row, per group of 64 and of 128. Every width gets
# the per-row and the 128-group mode (the tile shapes); the others, and every switch, go at FP8_FULL_N.
FP8_MODES = ((True, None), (False, None), (False, 64), (False, 128))
FP8_WIDTH_MODES = ((False, None), (False, 128))


def fp8_variants_for(m: int, n: int, dtype, every_path: bool, num_sms: int = REFERENCE_SMS,
                     invariant: bool = False) -> list[Variant]:  # fmt: skip
    """The FP8 kernel's variants for ``(m, n)`` of ``dtype``: the :data:`FP8_WIDTH_MODES` with a weight, the
    default casting, no add, e4m3; with ``every_path`` every mode, each also with the fused add and with e5m2,
    the dynamic ones with ``use_ue8m0``, and per row an fp32 residual, ``scale_ub``, no weight and every casting
    mode."""
    target = Target(num_sms, None, invariant)
    found, record = _collector()
    x, w, one = _meta(dtype, m, n), _meta(dtype, n), _meta(torch.float32, 1)
    # (static, group, residual dtype or None, out dtype, has_ub, ue8m0, casting mode, has_w)
    base = (False, None, None, torch.float8_e4m3fn, False, False, DEFAULT_CASTING_MODE, True)
    calls = [(static, group, *base[2:]) for static, group in (FP8_MODES if every_path else FP8_WIDTH_MODES)]
    if every_path:
        for static, group, *_ in list(calls):
            calls += [(static, group, dtype, *base[3:]), (static, group, None, torch.float8_e5m2, *base[4:])]
            if not static:
                calls.append((static, group, None, base[3], False, True, *base[6:]))
        calls += [(False, None, torch.float32, *base[3:]), (*base[:4], True, *base[5:]), (*base[:7], False)]
        calls += [(*base[:6], mode, True) for mode in CASTING_MODES]
    for static, group, residual_dtype, out_dtype, has_ub, ue8m0, casting_mode, has_w in calls:
        add = fwd.ADD_NONE if residual_dtype is None else fwd.ADD_MODES["pre"]
        quant = fp8.quant_mode(static, group)
        launch = fp8.fp8_launch(target, m, n, dtype, casting_mode, has_w, add, quant, group, has_ub, ue8m0)
        residual = None if residual_dtype is None else _meta(residual_dtype, m, n)
        fp8.start(launch, x, residual, w if has_w else None, one if static else None, one if has_ub else None,
                  out_dtype, group, 0.0, 0.0, -1, record)  # fmt: skip
    return list(found)


def fp8_variants() -> list[Variant]:
    """The distinct FP8 variants over :data:`FP8_N`, the dtypes (bf16 at every width, every switch at
    :data:`FP8_FULL_N`; the others there, in the default call), decode and prefill row counts (one row and several
    per tile), in the default and the batch-invariant mode."""
    found: dict[Variant, None] = {}
    for invariant in (False, True):
        for dtype in DTYPES:
            for n in FP8_N if dtype == torch.bfloat16 else (FP8_FULL_N,):
                for m in REPRESENTATIVE_M:
                    every_path = dtype == torch.bfloat16 and n == FP8_FULL_N and not invariant
                    more = fp8_variants_for(m, n, dtype, every_path, invariant=invariant)
                    found.update(dict.fromkeys(more))
    return list(found)


# Bytes to which a launched array's base address and row stride are aligned in the "as launched" signature.
LAUNCH_ALIGN_BYTES = 16


def _signature(v: Variant, as_launched: bool = False):
    """The variant's signature with no assumption on its arrays beyond their rank and dtype (the compile
    check's), or ``as_launched``: what a launch derives from contiguous tensors whose rows are 16-byte aligned
    (every hidden size that is a multiple of 8 in 16-bit, 4 in fp32). Only that build can use TMA, so it is the
    one the GPU runs for such shapes; its registers and shared memory differ (PERFORMANCE.md, "Toolchain")."""
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint

    ct_dtype = {torch.float32: ct.float32, torch.float16: ct.float16, torch.bfloat16: ct.bfloat16,
                torch.float8_e4m3fn: ct.float8_e4m3fn, torch.float8_e5m2: ct.float8_e5m2,
                torch.int32: ct.int32}  # fmt: skip
    params = []
    for p in v.params:
        if isinstance(p, tuple) and p[0] == "array":
            aligned = {}
            if as_launched:
                ndim, itemsize = p[2], p[1].itemsize
                aligned = dict(
                    stride_constant=(None,) * (ndim - 1) + (1,),
                    stride_divisible_by=(LAUNCH_ALIGN_BYTES // itemsize,) * (ndim - 1) + (1,),
                    base_addr_divisible_by=LAUNCH_ALIGN_BYTES,
                )
            params.append(
                ArrayConstraint(
                    ct_dtype[p[1]],
                    p[2],
                    index_dtype=ct.int32,
                    stride_lower_bound_incl=0,
                    alias_groups=(),
                    may_alias_internally=False,
                    **aligned,
                )
            )
        elif isinstance(p, tuple) and p[0] == "scalar":
            params.append(ScalarConstraint(ct.float32))
        else:
            params.append(p)
    return KernelSignature(params, CallingConvention.cutile_python_v1())


def cubin(v: Variant, arch: str, as_launched: bool = False) -> bytes:
    """One variant compiled for ``arch`` (raises on failure); ``as_launched``: see :func:`_signature`."""
    from cuda.tile.compilation import export_kernel

    from .cutile import kernels
    from .cutile.launch import with_hints

    buf = io.BytesIO()
    kernel = with_hints(getattr(kernels, v.kernel_name), v.hints)
    export_kernel(kernel, [_signature(v, as_launched)], buf, gpu_code=arch, output_format="cubin")
    if not buf.getvalue():
        raise RuntimeError("empty cubin")
    return buf.getvalue()


def compile_variant(v: Variant, arch: str) -> int:
    """Compiles one variant for ``arch``; returns the cubin size in bytes (raises on failure)."""
    return len(cubin(v, arch))


def _compile_timed(item: tuple[Variant, str]) -> tuple[int, str | None, float]:
    """``(cubin bytes, error or None, seconds)`` of one (variant, arch): the work of one pool task."""
    v, a = item
    t0 = time.perf_counter()
    try:
        return compile_variant(v, a), None, time.perf_counter() - t0
    except Exception as exc:  # report every failure, keep going
        return 0, f"{type(exc).__name__}: {exc}".splitlines()[0][:160], time.perf_counter() - t0


def run(archs=ARCHS, jobs: int = 2, out=sys.stdout, only: list[Variant] | None = None) -> int:
    """Compiles every variant (or those of ``only``) for every arch, prints a table; returns the number of
    failures. ``jobs`` > 1 compiles in that many processes: cuda.tile holds one process-wide lock over each
    whole compile (tileiras included), so threads would take turns."""
    todo = [(v, a) for a in archs for v in (variants(a) if only is None else only)]
    failures = 0
    print(f"{'variant':<72} {'arch':<7} {'cubin':>8} {'s':>5}  result", file=out)
    if jobs > 1:
        # spawn: a fresh interpreter per worker, never a fork of one that may hold torch's threads
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
    else:
        pool = ThreadPoolExecutor(max_workers=1)
    with pool:
        for (v, a), (size, err, secs) in zip(todo, pool.map(_compile_timed, todo, chunksize=4), strict=True):
            failures += err is not None
            print(f"{v.describe():<72} {a:<7} {size:>8} {secs:>5.1f}  {err or 'ok'}", file=out, flush=True)
    print(
        f"{len(todo) - failures} compiled, {failures} failed ({len(todo)} variant-arch pairs, {len(archs)} archs)",
        file=out,
    )
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tilegym-rms aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=ARCHS, help="target (repeatable); default: all four")
    parser.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    args = parser.parse_args(argv)
    # Without cuda.tile (the [cuda] extra) or its compiler every variant would fail alike: say so once.
    ok, why = _toolchain_status()
    if not ok:
        parser.exit(2, f"{parser.prog}: error: {why}\n")
    return 1 if run(tuple(args.arch or ARCHS), args.jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
