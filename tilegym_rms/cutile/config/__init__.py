"""Launch heuristics for the cuTile kernels: which kernel, which tile shape, which grid, which
compiler hints.

Kept apart from the kernels so that tuning never touches kernel code. A choice is a *candidate*
(:class:`ForwardCandidate`, :class:`BackwardCandidate`: kernel or strategy, tiles, blocks per SM, hints),
turned into a launch configuration for one ``(M, N)`` by :func:`build_forward` / :func:`build_backward`.
The candidate comes from the device's tuning table (:mod:`tilegym_rms.cutile.tuning`) where it has an entry,
else from the analytic heuristics, pure functions of ``(M, N, dtype, num_sms)`` whose parameters are the fields of
:class:`Heuristics` (fitted on H100/H200 with ``bench/tools/tune_cutile.py``; ``PERFORMANCE.md`` has the
measurements). Tiles and hints come from M's power-of-two bucket (the host passes the bucket and caches the
result per device, M, N, dtype and kernel), so a new M compiles nothing new. Tile shapes are powers of two.

The modules: :mod:`.heuristics` (the parameters and :func:`override`), :mod:`.rows` (the plain norm's forward,
backward and dw reduction), :mod:`.qk`, :mod:`.gated` and :mod:`.fp8` (one op each). ``config.HEURISTICS`` reads
the parameters in force (:func:`current`).
"""

from __future__ import annotations

from ..._tiling import cdiv, next_pow2, prev_pow2
from .fp8 import FP8_MAX_TILE_N, FP8Config, fp8_config
from .gated import GatedConfig, GatedLaunch, gated_config
from .heuristics import Heuristics, Hints, current, for_device, m_bucket, make_hints, override
from .qk import QKCandidate, QKConfig, QKTiles, qk_candidate, qk_config, qk_head_tiles, qk_tile_split
from .rows import (
    BACKWARD_STRATEGIES,
    FORWARD_KERNELS,
    BackwardCandidate,
    BackwardConfig,
    ForwardCandidate,
    ForwardConfig,
    ReduceConfig,
    backward_candidate,
    backward_config,
    build_backward,
    build_forward,
    forward_candidate,
    forward_config,
    invariant_backward_candidate,
    reduce_config,
    split_row,
)

__all__ = [
    "cdiv",
    "next_pow2",
    "prev_pow2",
    "FP8_MAX_TILE_N",
    "FP8Config",
    "fp8_config",
    "GatedConfig",
    "GatedLaunch",
    "gated_config",
    "Heuristics",
    "Hints",
    "current",
    "for_device",
    "m_bucket",
    "make_hints",
    "override",
    "QKCandidate",
    "QKConfig",
    "QKTiles",
    "qk_candidate",
    "qk_config",
    "qk_head_tiles",
    "qk_tile_split",
    "BACKWARD_STRATEGIES",
    "FORWARD_KERNELS",
    "BackwardCandidate",
    "BackwardConfig",
    "ForwardCandidate",
    "ForwardConfig",
    "ReduceConfig",
    "backward_candidate",
    "backward_config",
    "build_backward",
    "build_forward",
    "forward_candidate",
    "forward_config",
    "invariant_backward_candidate",
    "reduce_config",
    "split_row",
    "HEURISTICS",
]


def __getattr__(name: str):
    # HEURISTICS follows override(), which rebinds the parameters in force: read at each access.
    if name == "HEURISTICS":
        return current()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
