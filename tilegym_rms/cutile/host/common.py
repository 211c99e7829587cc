"""What the host modules share: the :class:`Target` a launch is configured for, the :class:`Launch` record, the
kernel module and the launcher (imported on first use: they need ``cuda.tile``), and the tensor stand-ins.

A call's kernel launches are :class:`Launch` es (kernel, grid, compile-time constants, compiler hints: all but
the tensors and run-time scalars), which each host module builds for a :class:`Target` and caches per device
and call signature, so that a call does one lookup (host time is the latency at small M). Each module's
``start`` functions allocate a call's outputs, build its kernels' argument tuples from its tensors and launch
them through the launcher they are given, ``launch(kernel, grid, args, device_index, hints, built)``: the
host passes :func:`launcher`, the compile check (:mod:`tilegym_rms.aot`) one that records each launch of the
same functions run on meta tensors, so that it compiles the signatures the host launches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import config, tuning


@dataclass(frozen=True)
class Target:
    """What a launch configuration depends on besides the shapes: the SM count, the tuning table (None:
    the analytic heuristics) and whether the batch-invariant mode is on (:mod:`tilegym_rms.batch_invariance`:
    launches that depend on N and dtype only, by kernels without a row loop)."""

    sms: int
    table: tuning.Table | None = None
    invariant: bool = False

    def params(self) -> config.Heuristics:
        """The analytic settings on this target: those in force, with its table's ``heuristics`` over them (the
        launch settings of the kernels a table has no entries for, measured on that card; :mod:`.tuning`)."""
        return config.for_device(self.table.heuristics) if self.table is not None else config.current()


def target(device_index: int, invariant: bool = False) -> Target:
    """The target of a CUDA device: its SM count and the table the host uses there (:func:`.tuning.table_for`),
    in the batch-invariant mode or not."""
    from ..launch import num_sms

    return Target(num_sms(device_index), tuning.table_for(device_index), invariant)


@dataclass(frozen=True)
class Launch:
    """One kernel launch but its tensors and run-time scalars. Build it with :func:`make_launch`."""

    kernel: object
    grid: tuple[int, ...]
    constants: tuple  # the kernel's ct.Constant arguments, in order: they follow its arrays and scalars
    hints: config.Hints
    built: object  # ``kernel`` built with ``hints`` (launch.with_hints), looked up once here


def make_launch(kernel, grid: tuple[int, ...], constants: tuple, hints: config.Hints = (), cls=Launch, **more):
    """A :class:`Launch` (or ``cls``, a subclass with the fields ``more``), its build looked up."""
    # Through the module attribute: bench/tools/tune_cutile.py swaps launch.with_hints (and clears the caches).
    from .. import launch

    return cls(kernel, grid, constants, hints, launch.with_hints(kernel, hints), **more)


@functools.cache
def kernels():
    """The kernel module, imported on first use (it needs ``cuda.tile``)."""
    from .. import kernels

    return kernels


@functools.cache
def launcher():
    """:func:`..launch.launch`, imported on first use (it needs ``cuda.tile``)."""
    from ..launch import launch

    return launch


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def plain(t: torch.Tensor) -> torch.Tensor:
    # cuTile reads tensors through DLPack, which refuses tensors that require grad (a slow fallback then);
    # detaching is free of copies.
    return t.detach() if t.requires_grad else t


def weight_arg(weight, x):
    # Kernels without affine never read the weight; any 1-D tensor of the right kind stands in.
    return plain(weight) if weight is not None else x.new_empty((1,))
