"""The gated norm's variants: the gated kernels on (M, G, S) views and the dw reduction of their partial buffer."""

from __future__ import annotations

import torch

from ..cutile import config
from ..cutile.host import gated as gated_host
from ..cutile.host.common import Target
from ..reference import CASTING_MODES, DEFAULT_CASTING_MODE
from .variant import REFERENCE_SMS, REPRESENTATIVE_M, Variant, collector, meta, setting_targets

# (N, group size) that reach each tile class: one head-dim group (Qwen3-Next), a row as one group padded to
# a wide tile, three groups in a tile of four, many groups of a size that is not a power of two, and a wide row
# of power-of-two groups (Mamba2); the arithmetic-only axes at the last one (GATED_FULL).
GATED_SHAPES = ((128, 128), (5120, 5120), (1536, 512), (3072, 96), (8192, 1024))
GATED_FULL = (8192, 1024)
# (x dtype, gate dtype) pairs beyond bf16 with a bf16 gate, at GATED_FULL only: an fp32 gate beside 16-bit x.
GATED_MORE_DTYPES = ((torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float32))


def gated_variants_for(
    m: int, n: int, group_size: int, dtype, gate_dtype, num_sms: int = REFERENCE_SMS, every_path: bool = True,
    invariant: bool = False, activation: str = "silu", table=None,
) -> list[Variant]:  # fmt: skip
    """The gated kernel variants for ``(m, n)`` rows in groups of ``group_size`` gated by ``activation``: forward,
    backward and the dw reduction, for both orders of norm and gate; with ``every_path``, every casting mode, the
    no-weight and the no-rstd variants too (a training call's: the default casting, a weight of x's dtype, rstd
    stored)."""
    target = Target(num_sms, table, invariant)
    found, record = collector()
    x, z, w = meta(dtype, m, n), meta(gate_dtype, m, n), meta(dtype, n)
    first = (DEFAULT_CASTING_MODE, True, True)
    combos = (first, *((mode, True, True) for mode in CASTING_MODES if mode != first[0]),
              (DEFAULT_CASTING_MODE, False, True), (DEFAULT_CASTING_MODE, True, False))  # fmt: skip
    for norm_before_gate in (True, False):
        for casting_mode, has_w, store in combos if every_path else combos[:1]:
            weight = w if has_w else None
            fl = gated_host.forward_launch(
                target, m, n, group_size, dtype, casting_mode, has_w, norm_before_gate, store, activation
            )
            _, rstd = gated_host.start_forward(fl, x, z, weight, 0.0, 0.0, group_size, store, -1, record)
            if store:
                bl = gated_host.backward_launches(
                    target, m, n, group_size, dtype, gate_dtype, has_w, norm_before_gate, activation
                )
                gated_host.start_backward(bl, x, z, x, weight, rstd, 0.0, group_size, -1, record)
    return list(found)


def gated_variants() -> list[Variant]:
    """The distinct gated variants over :data:`GATED_SHAPES` at both representative M (the casting, weight and
    rstd axes, the sigmoid gate and the other dtype pairs at :data:`GATED_FULL` and the large M only: they add no
    tile shape), and a training call's in the batch-invariant mode; on the reference target and with each shipped
    table's settings (:func:`.variant.setting_targets`)."""
    found: dict[Variant, None] = {}
    for sms, table in setting_targets():
        found.update(dict.fromkeys(_gated_variants_on(sms, table)))
    return list(found)


def _gated_variants_on(sms: int, table) -> list[Variant]:
    """:func:`gated_variants` on one target: ``sms`` SMs and ``table``'s settings (None: the reference's)."""
    found: dict[Variant, None] = {}
    bf16 = torch.bfloat16
    for n, group_size in GATED_SHAPES:
        for m in REPRESENTATIVE_M:
            full = (n, group_size) == GATED_FULL and m == REPRESENTATIVE_M[-1]
            more = gated_variants_for(m, n, group_size, bf16, bf16, sms, full, table=table)
            found.update(dict.fromkeys(more))
            for dtype, gate_dtype in GATED_MORE_DTYPES if full else ():
                more = gated_variants_for(m, n, group_size, dtype, gate_dtype, sms, False, table=table)
                found.update(dict.fromkeys(more))
            if full:  # the sigmoid gate on every path; its arithmetic differs from silu's, its tiles do not
                more = gated_variants_for(m, n, group_size, bf16, bf16, sms, activation="sigmoid", table=table)
                found.update(dict.fromkeys(more))
        more = gated_variants_for(REPRESENTATIVE_M[0], n, group_size, bf16, bf16, sms, False, True, table=table)
        found.update(dict.fromkeys(more))
    with config.override(gated_narrow_fwd_walk=True):  # the one-head forward walked, the switch's other side
        more = gated_variants_for(REPRESENTATIVE_M[-1], 128, 128, bf16, bf16, sms, False, table=table)
        found.update(dict.fromkeys(more))
    return list(found)
