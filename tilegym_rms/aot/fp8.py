"""The FP8-output variants: rms_norm_fp8_fwd over its quantization modes, the fused add and both fp8 dtypes."""

from __future__ import annotations

import torch

from ..cutile import fp8_cc_supported
from ..cutile.host import forward as fwd
from ..cutile.host import fp8 as fp8_host
from ..cutile.host.common import Target
from ..reference import CASTING_MODES, DEFAULT_CASTING_MODE
from .variant import DTYPES, REFERENCE_SMS, REPRESENTATIVE_M, Variant, collector, meta, setting_targets

FP8_KERNEL = "rms_norm_fp8_fwd"


def fp8_arch(arch: str) -> bool:
    """Whether ``arch`` (``sm_90``) has the fp8 types the FP8 kernel stores."""
    digits = arch.removeprefix("sm_")
    return fp8_cc_supported((int(digits[:-1]), int(digits[-1])))


# Widths that reach the kernel's tile classes: a row narrower than a group (the tile is the group), a row that is
# not whole int64 words (y_q stored value by value) whose last group is partial, the common LLM widths (5120 as a
# tile and a tail in tiles of one row, the decode sizes), a tile and a tail in the walk (10240), and the widest
# tile (FP8_MAX_N).
FP8_N = (32, 1001, 4096, 5120, 10240, 16384)
# The width at which every switch is compiled (the others take the default call of each quantization mode).
FP8_FULL_N = 5120
# (static, group_size) of each quantization mode: static, per row, per group of 64 and of 128. Every width gets
# the per-row and the 128-group mode (the tile shapes); the others, and every switch, go at FP8_FULL_N.
FP8_MODES = ((True, None), (False, None), (False, 64), (False, 128))
FP8_WIDTH_MODES = ((False, None), (False, 128))


def fp8_variants_for(m: int, n: int, dtype, every_path: bool, num_sms: int = REFERENCE_SMS,
                     invariant: bool = False, table=None) -> list[Variant]:  # fmt: skip
    """The FP8 kernel's variants for ``(m, n)`` of ``dtype``: the :data:`FP8_WIDTH_MODES` with a weight, the
    default casting, no add, e4m3; with ``every_path`` every mode, each also with the fused add and with e5m2,
    the dynamic ones with ``use_ue8m0``, and per row an fp32 residual, ``scale_ub``, no weight and every casting
    mode."""
    target = Target(num_sms, table, invariant)
    found, record = collector()
    x, w, one = meta(dtype, m, n), meta(dtype, n), meta(torch.float32, 1)
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
        quant = fp8_host.quant_mode(static, group)
        launch = fp8_host.fp8_launch(target, m, n, dtype, casting_mode, has_w, add, quant, group, has_ub, ue8m0,
                                     out_dtype)  # fmt: skip
        residual = None if residual_dtype is None else meta(residual_dtype, m, n)
        fp8_host.start(launch, x, residual, w if has_w else None, one if static else None, one if has_ub else None,
                  out_dtype, group, 0.0, 0.0, -1, record)  # fmt: skip
    return list(found)


def fp8_variants() -> list[Variant]:
    """The distinct FP8 variants over :data:`FP8_N`, the dtypes (bf16 at every width, every switch at
    :data:`FP8_FULL_N`; the others there, in the default call), decode and prefill row counts (one row and several
    per tile), in the default and the batch-invariant mode, on the reference target and with each shipped table's
    settings (:func:`.variant.setting_targets`)."""
    found: dict[Variant, None] = {}
    for sms, table in setting_targets():
        for invariant in (False, True):
            for dtype in DTYPES:
                for n in FP8_N if dtype == torch.bfloat16 else (FP8_FULL_N,):
                    for m in REPRESENTATIVE_M:
                        every_path = dtype == torch.bfloat16 and n == FP8_FULL_N and not invariant
                        more = fp8_variants_for(m, n, dtype, every_path, sms, invariant, table)
                        found.update(dict.fromkeys(more))
    return list(found)
