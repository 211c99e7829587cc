"""Public functional API and its PyTorch wiring, one module per operation.

:mod:`.norm` (``rms_norm`` and its standalone forward and backward), :mod:`.fused_add` (the residual add
fused with the norm, in place or not), :mod:`.qk` (QK-norm and its layouts), :mod:`.gated` (the gated norm of
hybrid models), :mod:`.fp8` (the norm and the fused add with FP8 output, for serving, inference only), on the
shared plumbing of :mod:`.common` (row views, backend lookup, the eager forward and backward, ``WIRING``).

Eager calls go through :class:`RMSNormFunction` / :class:`FusedAddRMSNormFunction` /
:class:`QKRMSNormFunction` (plain autograd Functions: the least host work per call). Under
``torch.compile`` the same computation is reached through the custom ops ``tilegym_rms::rms_norm_fwd``,
``tilegym_rms::rms_norm_bwd``, ``tilegym_rms::fused_add_rms_norm_fwd`` (and the others beside their
Functions), which have fake (meta) implementations and registered autograd, so a compiled model traces
without graph breaks, and ``torch.export`` records them. Called with ``backend=None``, an op chooses the
backend when it runs, so an exported program picks the best one of the machine that runs it. DTensor
inputs take the custom ops in eager mode too: DTensor runs them on the local shards by the sharding
rules declared beside each op (:func:`tilegym_rms.integrations.dtensor.sharding_rule`). With
``create_graph=True`` the eager Functions compute the backward with differentiable torch math (double
backward).
"""

from .common import WIRING
from .fp8 import fused_add_rms_norm_fp8, rms_norm_fp8
from .fused_add import FusedAddRMSNormFunction, fused_add_rms_norm, fused_add_rms_norm_
from .gated import GatedRMSNormFunction, gated_rms_norm
from .norm import RMSNormFunction, backward_workspace_bytes, rms_norm, rms_norm_backward, rms_norm_forward
from .qk import QKRMSNormFunction, qk_rms_norm

__all__ = [
    "WIRING",
    "FusedAddRMSNormFunction",
    "GatedRMSNormFunction",
    "QKRMSNormFunction",
    "RMSNormFunction",
    "backward_workspace_bytes",
    "fused_add_rms_norm",
    "fused_add_rms_norm_",
    "gated_rms_norm",
    "fused_add_rms_norm_fp8",
    "qk_rms_norm",
    "rms_norm",
    "rms_norm_fp8",
    "rms_norm_backward",
    "rms_norm_forward",
]
