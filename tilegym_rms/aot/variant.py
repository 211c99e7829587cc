"""A kernel variant as the compile check sees it, and the launcher that records the variants the host launches."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..experimental import kernel_name

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Large and small M reach both forward kernels; SM count of an H100 (the heuristics scale with it).
REPRESENTATIVE_M = (128, 65536)
REFERENCE_SMS = 132


def setting_targets() -> list[tuple[int, object]]:
    """``(SM count, table)`` of the reference target (no table) and of each shipped table that sets analytic
    settings (``heuristics``, :mod:`tilegym_rms.cutile.tuning`): the FP8 and gated launches on those cards differ,
    and the compile check builds them too."""
    from ..cutile import tuning

    tables = [tuning.packaged(key) for key in tuning.packaged_keys()]
    return [(REFERENCE_SMS, None)] + [(t.doc["device"]["sms"], t) for t in tables if t.heuristics]


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
        from ..cutile import kernels

        names = inspect.signature(getattr(kernels, self.kernel_name)._pyfunc).parameters
        return {name: p for name, p in zip(names, self.params, strict=True) if not isinstance(p, tuple)}


def params_of(args: tuple) -> tuple:
    """:attr:`Variant.params` of a launch's arguments: arrays by dtype and rank, float scalars, constants."""
    return tuple(
        ("array", a.dtype, a.ndim) if isinstance(a, torch.Tensor) else ("scalar",) if isinstance(a, float) else a
        for a in args
    )


def collector(grids: dict | None = None):
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


def meta(dtype, *shape) -> torch.Tensor:
    # The host allocates and views tensors as for a launch; on the meta device that costs nothing.
    return torch.empty(shape, dtype=dtype, device="meta")
