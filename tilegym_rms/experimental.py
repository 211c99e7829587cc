"""``@experimental_kernel``: marks kernels not yet validated on every target GPU or NPU.

Marking registers the kernel object and returns it unchanged. Every launch in the package goes
through a launch helper (``tilegym_rms.cutile.launch``, ``tilegym_rms.triton.launch``) that calls
:func:`notify_launch`; the first launch of each marked kernel in a process emits one
:class:`ExperimentalKernelWarning` naming it. ``TILEGYM_RMS_SILENCE_EXPERIMENTAL=1`` silences it.
"""

from __future__ import annotations

import os
import threading
import warnings

SILENCE_ENV = "TILEGYM_RMS_SILENCE_EXPERIMENTAL"


class ExperimentalKernelWarning(UserWarning):
    """A kernel launched here has not been validated on every target device yet."""


_marked: dict[int, tuple[str, tuple[str, ...] | None]] = {}
_warned: set[int] = set()  # ids of kernels that have warned
_lock = threading.Lock()


def kernel_name(kernel) -> str:
    """A readable name for a cuTile kernel, a Triton JIT function or a Python function."""
    for candidate in (kernel, getattr(kernel, "fn", None), getattr(kernel, "_pyfunc", None)):
        name = getattr(candidate, "__name__", None)
        if name:
            return name
    return repr(kernel)


def experimental_kernel(kernel=None, *, on: tuple[str, ...] | None = None):
    """Mark ``kernel`` experimental, on every device type or only on the device types in ``on``.

    Usable bare (``@experimental_kernel``) or with arguments (``@experimental_kernel(on=("npu",))``).
    """

    def mark(obj):
        _marked[id(obj)] = (kernel_name(obj), tuple(on) if on is not None else None)
        return obj

    return mark(kernel) if kernel is not None else mark


def is_experimental(kernel, device_type: str | None = None) -> bool:
    entry = _marked.get(id(kernel))
    if entry is None:
        return False
    devices = entry[1]
    return devices is None or device_type is None or device_type in devices


def notify_launch(kernel, device_type: str | None = None) -> None:
    """Called by the launch helpers before each launch: warns once per marked kernel."""
    if not is_experimental(kernel, device_type):
        return
    key = id(kernel)
    if key in _warned:
        return
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    name = _marked[key][0]
    if os.environ.get(SILENCE_ENV, "") not in ("", "0"):
        return
    where = f" on {device_type}" if device_type else ""
    warnings.warn(
        f"tilegym_rms kernel '{name}' is experimental{where}: it has not been validated on every "
        f"target device yet. Set {SILENCE_ENV}=1 to silence this warning.",
        ExperimentalKernelWarning,
        stacklevel=3,
    )


def _reset_warnings() -> None:
    """Forget which kernels have warned (for tests)."""
    with _lock:
        _warned.clear()
