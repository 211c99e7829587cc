"""DTensor (``torch.distributed.tensor``) support: sharding rules for the tilegym_rms custom ops.

RMSNorm normalizes each row over the last dim on its own, so a DTensor ``x`` sharded on any other
dim (data, sequence or batch parallel) runs the kernels on its local shard as is: ``y`` and ``rstd``
keep the sharding of ``x``, the weight is replicated, and in the backward ``dx`` keeps it too while
``dw`` is the sum over rows of every rank, a ``Partial(sum)`` that DTensor reduces where the weight's
placement asks for it (an all-reduce for a replicated weight). ``x`` is never gathered.

Placements with no such rule (``x`` sharded on the last dim, a sharded weight, a ``Partial`` ``x``)
are not errors: ``register_sharding`` lets DTensor redistribute the inputs to the cheapest
placement the rules list, and the result is exact. ``x`` sharded on the last dim is all-gathered
(``y`` comes out replicated), a sharded weight is all-gathered: one collective per call, what
sharding the normalized dim costs anyway.

:func:`register` adds the rules with ``torch.distributed.tensor.experimental.register_sharding``
(public since torch 2.5; checked with 2.11 and 2.13). :mod:`tilegym_rms.ops` calls it on the first
DTensor it sees and whenever ``torch.compile`` traces a call, and sends eager DTensor calls through
the custom ops too: DTensor runs their registered autograd like any other op's, and the kernels see
local shards only.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["is_dtensor", "register"]

_registered: bool | None = None  # None: not tried yet


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (registering the sharding rules the first time one is seen).

    Looks in ``sys.modules`` rather than importing DTensor: without the module there is no DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(t, module.DTensor):
        return False
    return register()


def register() -> bool:
    """Registers DTensor sharding rules for the ``tilegym_rms::`` custom ops; idempotent.

    Returns False (and registers nothing) where torch has no ``torch.distributed`` or no public
    DTensor API (before 2.5 it lived in ``torch.distributed._tensor``)."""
    global _registered
    if _registered is not None:
        return _registered
    if not torch.distributed.is_available():
        _registered = False
        return False
    try:
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:
        _registered = False
        return False

    from .. import ops  # noqa: F401  (defines torch.ops.tilegym_rms.*)

    lib = torch.ops.tilegym_rms

    def row_dims(x):
        # Every dim but the normalized last one holds independent rows.
        return range(x.ndim - 1)

    def weight_placement(weight):
        # No weight: its slot holds no tensor, so it gets no placement.
        return None if weight is None else Replicate()

    @register_sharding(lib.rms_norm_fwd.default)
    def _rms_norm_fwd(x, weight, eps, offset, casting_mode, backend, kernel, wiring):
        w = weight_placement(weight)
        # (output placements [y, rstd], input placements [x, weight]) per acceptable strategy.
        rules = [([Replicate(), Replicate()], [Replicate(), w])]
        rules += [([Shard(d), Shard(d)], [Shard(d), w]) for d in row_dims(x)]
        return rules

    @register_sharding(lib.rms_norm_bwd.default)
    def _rms_norm_bwd(x, dy, weight, rstd, offset, casting_mode, backend):
        w = weight_placement(weight)
        # dw sums over all rows: each shard's sum is a partial one. Without a weight, dw is an empty
        # placeholder every rank holds alike.
        dw = Partial() if weight is not None else Replicate()
        rules = [([Replicate(), Replicate()], [Replicate(), Replicate(), w, Replicate()])]
        rules += [([Shard(d), dw], [Shard(d), Shard(d), w, Shard(d)]) for d in row_dims(x)]
        return rules

    @register_sharding(lib.fused_add_rms_norm_bwd.default)
    def _fused_add_bwd(s, dy, dres, weight, rstd, offset, casting_mode, backend):
        # As rms_norm_bwd, dres sharded like s.
        w = weight_placement(weight)
        dw = Partial() if weight is not None else Replicate()
        rules = [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), w, Replicate()])]
        rules += [([Shard(d), dw], [Shard(d), Shard(d), Shard(d), w, Shard(d)]) for d in row_dims(s)]
        return rules

    @register_sharding(lib.fused_add_rms_norm_fwd.default)
    def _fused_add_fwd(x, residual, weight, eps, mode, offset, casting_mode, backend, wiring):
        w = weight_placement(weight)

        def outputs(p):
            # mode "post" returns an empty placeholder for residual_out (the caller returns y twice).
            return [p, p if mode == "pre" else Replicate(), p]

        rules = [(outputs(Replicate()), [Replicate(), Replicate(), w])]
        rules += [(outputs(Shard(d)), [Shard(d), Shard(d), w]) for d in row_dims(x)]
        return rules

    _hash_scalar_args(lib)
    _registered = True
    return True


# A constant of the trace under torch.compile: Dynamo calls it while tracing (before the custom op
# meets a DTensor) instead of tracing into DTensor's registration tables. The mark that
# torch.compiler.assume_constant_result sets, set by hand as in tilegym_rms.dispatch: the decorator
# would import torch._dynamo (and triton) when tilegym_rms is imported.
register._dynamo_marked_constant = True


def _hash_scalar_args(lib) -> None:
    """Makes DTensor's sharding cache key on the ops' non-tensor arguments.

    ``register_sharding`` keys the cache on the int arguments alone and these ops have none, so a
    ``mode="post"`` call would reuse the output shapes cached for ``mode="pre"`` (whose
    ``residual_out`` is a full tensor, not an empty one). Hashing every argument after ``x`` fixes
    that (tensor arguments hash by placement and shape either way). The table is private to DTensor
    (the same in torch 2.11 and 2.13); without it only that discarded placeholder's shape is wrong."""
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    except ImportError:
        return
    table = getattr(DTensor._op_dispatcher.sharding_propagator, "op_to_schema_info", None)
    if table is None:
        return
    ops = (lib.rms_norm_fwd, lib.rms_norm_bwd, lib.fused_add_rms_norm_fwd, lib.fused_add_rms_norm_bwd)
    for op in (o.default for o in ops):
        table[op] = RuntimeSchemaInfo(static_argnum=1, needs_pytree=True)
