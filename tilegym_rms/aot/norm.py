"""The plain norm's variants: the forward kernels, the backward, the dw reduction and the fused residual add."""

from __future__ import annotations

import torch

from ..cutile import config
from ..cutile.host import backward as bwd
from ..cutile.host import forward as fwd
from ..cutile.host.common import Target
from ..reference import CASTING_MODES, DEFAULT_CASTING_MODE
from .variant import DTYPES, REFERENCE_SMS, REPRESENTATIVE_M, Variant, collector, meta

# Hidden sizes that reach every tile shape class: tiny, a head dim (the short-row hints), non-power-of-two,
# the common LLM widths, rows split into a tile and a tail tile (5120, 12288), the widest single tile
# (32768), and rows wider than one tile (chunked kernels).
REPRESENTATIVE_N = (64, 128, 1000, 4096, 5120, 8192, 12288, 16384, 32768, 65536)
# One width per tile class: a narrow single tile, a tile plus a tail tile at two widths, column chunks.
# The axes that change a kernel's arithmetic but not its tiles are compiled at these widths only: the
# casting-mode, no-weight and no-rstd switches, and the dtypes other than bf16 (the dtype LLMs train and
# serve in gets every width). That keeps the check within CI's time: four archs on two cores.
TILE_CLASS_N = (64, 5120, 12288, 65536)


def available(target: Target, m: int, n: int, dtype, kernels, op: str = "forward") -> list:
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
    found, record = collector(grids)
    x, w, rstd = meta(dtype, m, n), meta(dtype, n), meta(torch.float32, m)
    for kernel in available(target, m, n, dtype, kernels):
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
    every_mode: bool = False,
) -> list[Variant]:
    """The variants a fused add of ``(m, n)`` launches: the forward in each of ``kernels`` (None: the
    dispatcher's choice), and the backward adding the gradient of residual_out (``HAS_DRES``), which runs on the
    sum (``residual_dtype``, as its weight). The default casting with a weight of x's dtype. The forward in modes
    "pre" and "post", with and without the rstd store, where x and the residual are bf16 or ``every_mode`` (a
    table's winner, which no heuristic variant covers); otherwise "pre" with the store alone. ``table``: a tuning
    table whose winners the configs follow along the host's fallback chain (``tuning.fallback_chain``: the
    ``fused_forward`` entry, else the other 16-bit dtype's, then the ``forward`` one); ``invariant``: in the
    batch-invariant mode."""
    target = Target(num_sms, table, invariant)
    found, record = collector()
    full = every_mode or dtype == residual_dtype == torch.bfloat16
    x, w, residual = meta(dtype, m, n), meta(dtype, n), meta(residual_dtype, m, n)
    for kernel in available(target, m, n, dtype, kernels, "fused_forward"):
        for mode in fwd.ADD_MODES if full else ("pre",):
            for store in (True, False) if full else (True,):
                add_mode = fwd.ADD_MODES[mode]
                launch = fwd.forward_launch(target, m, n, dtype, kernel, DEFAULT_CASTING_MODE, True, store, add_mode)
                res_out = torch.empty_like(residual) if mode == "pre" else None  # as the host's fused_add_forward
                fwd.start(launch, x, residual, res_out, w, 0.0, 0.0, -1, record)
    launches = bwd.backward_launches(target, m, n, residual_dtype, True, True)
    s, rstd = residual, meta(torch.float32, m)
    bwd.start(launches, s, s, s, meta(residual_dtype, n), rstd, 0.0, -1, record)
    return list(found)


def norm_variants() -> list[Variant]:
    """What the heuristics (``config.HEURISTICS``, as overridden at the call) launch for the plain norm and the
    fused add over the representative grid, in the default and in the batch-invariant mode (the gather forward and
    the direct backward at every width)."""
    found: dict[Variant, None] = {}
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
    return list(found)


def reduction_variants() -> list[Variant]:
    """The dw reduction: its strip width depends on N alone; every width the heuristic can pick is compiled, in
    every dw dtype, and in bf16 without the occupancy hint (reduce_occupancy 0, which an override may ask for)."""
    reductions, record = collector()
    tile_n = config.HEURISTICS.reduce_min_tile_n
    while tile_n <= config.HEURISTICS.reduce_max_tile_n:
        n = tile_n * REFERENCE_SMS
        assert config.reduce_config(n, REFERENCE_SMS).tile_n == tile_n
        launch = bwd.reduce_launch(Target(REFERENCE_SMS), n)
        for dtype in DTYPES:
            bwd.reduce(launch, meta(torch.float32, REFERENCE_SMS, n), meta(dtype, n), -1, record)
        with config.override(reduce_occupancy=0):
            launch = bwd.reduce_launch(Target(REFERENCE_SMS), n)
        bwd.reduce(launch, meta(torch.float32, REFERENCE_SMS, n), meta(torch.bfloat16, n), -1, record)
        tile_n *= 2
    return list(reductions)
