"""The batch-invariant mode: a row's results do not depend on how many rows share the call.

Off by default: the tuned launches follow M's power-of-two bucket (another kernel, other tiles or compiler
hints at another M), and a row's sums may then be taken in another order, so a row can differ by an ulp
between batch sizes (PERFORMANCE.md, "Batch invariance"). On, every backend launches for a given
``(N, dtype)`` the same kernels with the same tiles and hints at every M, and no kernel computes a row in a
loop whose trip count follows M: a row's forward ``y`` and ``rstd``, backward ``dx``, the fused add's
outputs and gradients and QK-norm's outputs and gradients are the same bits whatever the batch (README,
"Batch invariance"). ``dw``, a sum over the rows, stays only deterministic.

Process-wide, as serving stacks need it: :func:`set_batch_invariant`, the :func:`batch_invariant` context
manager, or ``TILEGYM_RMS_BATCH_INVARIANT=1`` (read once, at the first call that asks). The host reads the
mode at every call, also under ``torch.compile`` (the kernels run inside custom ops); captured CUDA graphs
replay the launches they captured, so set it before capturing.
"""

from __future__ import annotations

import contextlib
import os

ENV = "TILEGYM_RMS_BATCH_INVARIANT"
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")

_enabled: bool | None = None  # None until the first call reads the environment


class BatchInvarianceWarning(UserWarning):
    """A call in the batch-invariant mode that runs code whose results may follow M (named in the message)."""


def _from_env() -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENV} must be 1 or 0 (or true/false, on/off, yes/no), got {os.environ[ENV]!r}")


def is_batch_invariant() -> bool:
    """Whether the batch-invariant mode is on."""
    global _enabled
    if _enabled is None:
        _enabled = _from_env()
    return _enabled


def set_batch_invariant(enabled: bool) -> None:
    """Turns the batch-invariant mode on or off for the whole process (overrides the environment)."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_batch_invariant takes True or False, got {enabled!r}")
    _enabled = enabled


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """``with batch_invariant(): ...`` runs its body in the batch-invariant mode (or out of it, with
    ``False``), then restores the mode it found. Process-wide: other threads see the change too."""
    previous = is_batch_invariant()
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(previous)
