"""DTensor (``torch.distributed.tensor``) support: how the tilegym_rms custom ops declare sharding rules.

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

Each op module declares its ops' rules beside them with :func:`sharding_rule`. A rule takes the op's
arguments by name and names the placement of each tensor argument; the positions that
``register_sharding`` wants come from the op's own schema, so a signature change cannot shift a
placement onto another argument, and a tensor argument the rule does not place raises.
:func:`register` hands the rules to ``torch.distributed.tensor.experimental.register_sharding``
(public since torch 2.5; checked with 2.11 and 2.13). :mod:`tilegym_rms.ops` calls it on the first
DTensor it sees and whenever ``torch.compile`` traces a call, and sends eager DTensor calls through
the custom ops too: DTensor runs their registered autograd like any other op's, and the kernels see
local shards only.
"""

from __future__ import annotations

import sys

import torch

__all__ = [
    "is_dtensor",
    "placeholder",
    "register",
    "row_rules",
    "sharding_rule",
    "weight_grad_placement",
    "weight_placement",
]

_registered: bool | None = None  # None: not tried yet
_RULES: list = []  # (custom op, rule) in the order the op modules declare them


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (registering the sharding rules the first time one is seen).

    Looks in ``sys.modules`` rather than importing DTensor: without the module there is no DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(t, module.DTensor):
        return False
    return register()


def sharding_rule(op):
    """Declares ``rule`` the sharding rule of the custom op ``op`` (a ``torch.library.custom_op``).

    ``rule(**arguments)`` gets the op's arguments by their schema names (tensors as DTensor's
    tensor-like specs) and returns the acceptable strategies, each ``(output placements in return
    order, {tensor argument name: placement})``; a missing optional tensor's placement is None."""

    def add(rule):
        _RULES.append((op, rule))
        if _registered:  # declared after register() ran: hand it over now
            _register_sharding(op, rule)
        return rule

    return add


def register() -> bool:
    """Registers the declared sharding rules with DTensor; idempotent.

    Returns False (and registers nothing) where torch has no ``torch.distributed`` or no public
    DTensor API (before 2.5 it lived in ``torch.distributed._tensor``)."""
    global _registered
    if _registered is not None:
        return _registered
    if not torch.distributed.is_available():
        _registered = False
        return False
    try:
        from torch.distributed.tensor.experimental import register_sharding  # noqa: F401
    except ImportError:
        _registered = False
        return False
    for op, rule in _RULES:
        _register_sharding(op, rule)
    _registered = True
    return True


# A constant of the trace under torch.compile: Dynamo calls it while tracing (before the custom op
# meets a DTensor) instead of tracing into DTensor's registration tables. The mark that
# torch.compiler.assume_constant_result sets, set by hand as in tilegym_rms.dispatch: the decorator
# would import torch._dynamo (and triton) when tilegym_rms is imported.
register._dynamo_marked_constant = True


def _register_sharding(op, rule) -> None:
    from torch.distributed.tensor.experimental import register_sharding

    overload = op._opoverload
    register_sharding(overload)(by_position(overload._schema, rule))
    _hash_scalar_args(overload)


def _is_tensor(arg_type) -> bool:
    if isinstance(arg_type, torch.OptionalType):
        arg_type = arg_type.getElementType()
    return isinstance(arg_type, torch.TensorType)


def by_position(schema, rule):
    """``rule`` as ``register_sharding`` calls it: the op's arguments by position in, and input
    placements by position out (None for the non-tensor arguments, which DTensor skips), both read
    from ``schema``. Raises ValueError where the rule and the schema disagree."""
    names = [a.name for a in schema.arguments]
    tensors = {a.name for a in schema.arguments if _is_tensor(a.type)}
    n_returns = len(schema.returns)

    def positional_rule(*args, **kwargs):
        order = names[: len(args)] + list(kwargs)
        strategies = []
        for outputs, inputs in rule(**dict(zip(names, args, strict=False)), **kwargs):
            if inputs.keys() != tensors or len(outputs) != n_returns:
                raise ValueError(
                    f"the sharding rule of {schema.name} gives {len(outputs)} output placements and places "
                    f"{sorted(inputs)}; the op returns {n_returns} tensors and takes the tensors {sorted(tensors)}"
                )
            strategies.append((list(outputs), [inputs.get(name) for name in order]))
        return strategies

    return positional_rule


def weight_placement(weight):
    """The weight is replicated; no weight: its slot holds no tensor, so it gets no placement."""
    return None if weight is None else _placements().Replicate()


def weight_grad_placement(rows, weight):
    """dw sums over all rows: where the rows are sharded (``rows`` a Shard) each rank's sum is a partial
    one. Without a weight dw is a :func:`placeholder`."""
    return _placements().Partial() if weight is not None and rows.is_shard() else placeholder()


def placeholder():
    """The placement of an empty placeholder output (a custom op cannot return None): every rank holds it alike."""
    return _placements().Replicate()


def row_rules(x, outputs, inputs):
    """The strategies of an op on independent rows: every tensor replicated, or sharded on one of
    ``x``'s row dims (all but the normalized last one); ``outputs(p)`` and ``inputs(p)`` give the
    placements for rows placed by ``p``."""
    p = _placements()
    return [(outputs(rows), inputs(rows)) for rows in (p.Replicate(), *(p.Shard(d) for d in range(x.ndim - 1)))]


def _placements():
    import torch.distributed.tensor as placements  # loaded by then: the rules run on DTensors only

    return placements


def _hash_scalar_args(overload) -> None:
    """Makes DTensor's sharding cache key on the op's non-tensor arguments.

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
    table[overload] = RuntimeSchemaInfo(static_argnum=1, needs_pytree=True)
