"""Backend registry and selection.

A backend is a module with this contract (``x``/``dy``: 2-D ``(M, N)``, last dim dense, any row
stride; ``weight``: None or dense ``(N,)``; ``rstd``: fp32 ``(M,)``):

* ``available(device) -> (ok, reason)``
* ``forward(x, weight, eps, offset, casting_mode, *, store_rstd=True, [mode=None]) -> (y, rstd)``
* ``backward(dy, x, weight, rstd, offset, casting_mode) -> (dx, dw or None)``
* ``SUPPORTED_DTYPES``; optionally ``fused_add_forward(...)`` and ``backward_workspace_bytes(...)``

Selection (``backend=None``): ``TILEGYM_RMS_BACKEND`` if set; else by device: ``npu`` -> triton
(triton-ascend), ``cuda`` -> cutile where it can run, else triton, else torch; ``cpu`` -> torch.
"""

from __future__ import annotations

import importlib
import os

import torch

BACKENDS = ("cutile", "triton", "torch")
BACKEND_ENV = "TILEGYM_RMS_BACKEND"
_MODULES = {"cutile": "tilegym_rms.cutile", "triton": "tilegym_rms.ascend", "torch": "tilegym_rms._torch_backend"}
_AUTO_ORDER = {"cuda": ("cutile", "triton", "torch"), "npu": ("triton",), "cpu": ("torch",)}

_resolved: dict[tuple, str] = {}
_modules: dict[str, object] = {}


def backend_module(name: str):
    """The module implementing backend ``name`` (imported on first use)."""
    module = _modules.get(name)
    if module is None:
        check_backend_name(name)
        module = _modules[name] = importlib.import_module(_MODULES[name])
    return module


def check_backend_name(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(map(repr, BACKENDS))} or None")


def available_backends(device=None) -> dict[str, tuple[bool, str]]:
    """For each backend: whether it can run on ``device`` (default: the current CUDA device, else
    the CPU), and if not, why."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    status = {}
    for name in BACKENDS:
        try:
            status[name] = backend_module(name).available(device)
        except Exception as exc:  # a backend that cannot even be asked cannot run
            status[name] = (False, f"{type(exc).__name__}: {exc}")
    return status


def resolve_backend(device: torch.device, requested: str | None = None) -> str:
    """The backend name to use on ``device``. Raises ValueError for an unknown name and
    RuntimeError (saying why) for a backend that cannot run there.

    Cached per (device, requested): ``TILEGYM_RMS_BACKEND`` is read when a device is first seen,
    which keeps it off the per-call path (call ``_clear_cache()`` after changing it)."""
    key = (device, requested)
    name = _resolved.get(key)
    if name is not None:
        return name
    if requested is None:
        requested = os.environ.get(BACKEND_ENV) or None
    if requested is not None:
        check_backend_name(requested)
        ok, why = backend_module(requested).available(device)
        if not ok:
            raise RuntimeError(f"backend {requested!r} cannot run on {device}: {why}")
        name = requested
    else:
        reasons = []
        for candidate in _AUTO_ORDER.get(device.type, ("torch",)):
            ok, why = backend_module(candidate).available(device)
            if ok:
                name = candidate
                break
            reasons.append(f"{candidate}: {why}")
        if name is None:
            raise RuntimeError(f"no tilegym_rms backend can run on {device} ({'; '.join(reasons)})")
    _resolved[key] = name
    return name


# torch.compile treats the choice as a constant of the trace: Dynamo cannot trace the first-use import
# of a backend module, and the answer never changes within a process. This is the mark that
# torch.compiler.assume_constant_result sets; that function would import torch._dynamo, and with it
# triton, at our import time (before a test or user sets TRITON_INTERPRET).
resolve_backend._dynamo_marked_constant = True


def _clear_cache() -> None:
    """Forget resolved backends (tests change the environment)."""
    _resolved.clear()
