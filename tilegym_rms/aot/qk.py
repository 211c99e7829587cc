"""QK-norm's variants: the qk kernels on 4-D (A, G, H, D) views and the dw reduction of their partial buffer."""

from __future__ import annotations

import torch

from ..cutile import config
from ..cutile.host import qk as qk_host
from ..cutile.host.common import Target
from ..reference import CASTING_MODES, DEFAULT_CASTING_MODE
from .variant import DTYPES, REFERENCE_SMS, REPRESENTATIVE_M, Variant, collector, meta

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
    :func:`~tilegym_rms.aot.norm.variants_for`). ``table``: a tuning table whose qk winners the configs follow
    (None: the heuristics). The weights have q's dtype."""
    target = Target(num_sms, table)
    found, record = collector()
    tokens = m if layout != "dense" else m // heads[1]
    shapes = tuple(qk_view_shape(layout, tokens, h) for h in heads)
    q, k = (meta(dtype, *shape, d) for shape in shapes)
    w = meta(dtype, d)
    first = DEFAULT_CASTING_MODE
    modes = (first, *(mode for mode in CASTING_MODES if mode != first))  # a training call's first
    combos = (*((mode, True, True) for mode in modes), (first, False, False), (first, True, False))
    for casting_mode, has_wq, has_wk in combos if dtype == torch.bfloat16 and every_path else combos[:1]:
        wq, wk = (w if has else None for has in (has_wq, has_wk))
        launch = qk_host.forward_launch(target, *shapes, d, dtype, casting_mode, has_wq, has_wk)
        *_, rq, rk = qk_host.start_forward(launch, q, k, wq, wk, 0.0, 0.0, -1, record)
        launches = qk_host.backward_launches(target, *shapes, d, dtype, has_wq, has_wk, has_wq and has_wk)
        qk_host.start_backward(launches, q, k, q, k, wq, wk, rq, rk, 0.0, -1, record)
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
