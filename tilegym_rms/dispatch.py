"""Backend registry and selection, and the contract every backend module satisfies.

A backend is a module satisfying :class:`Backend` (checked by ``tests/test_api.py``), plus, where it
has them, the optional capabilities :class:`FusedAddBackend`, :class:`FusedAddBackwardBackend`,
:class:`QKNormBackend`,
:class:`GatedBackend`, :class:`FP8Backend` and :class:`WorkspaceBackend`.

Selection (``backend=None``): ``TILEGYM_RMS_BACKEND`` if set; else by device: ``npu`` -> triton
(triton-ascend), ``cuda`` -> cutile where it can run, else triton, else torch; ``cpu`` -> torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Backend(Protocol):
    """What :mod:`tilegym_rms.ops` calls. Tensors arrive as 2-D ``(M, N)`` views with a dense last dim
    (any row stride), never empty; ``weight`` is None or a dense ``(N,)`` tensor of any floating
    dtype; ``rstd`` is ``(M,)`` in :func:`tilegym_rms.reference.compute_dtype` of ``x``."""

    SUPPORTED_DTYPES: tuple[torch.dtype, ...]
    FORWARD_KERNELS: tuple[str, ...]  # values ``kernel=`` may force; empty: one code path

    def available(self, device: torch.device) -> tuple[bool, str]:
        """Whether the backend can run on ``device``, and if not, why."""

    def forward(self, x, weight, eps: float, offset: float, casting_mode: str, *, store_rstd=True, kernel=None):
        """``(y, rstd)``: ``y`` contiguous in x's dtype; ``rstd`` None unless ``store_rstd``."""

    def backward(self, x, dy, weight, rstd, offset: float, casting_mode: str):
        """``(dx, dw)``: ``dx`` in x's dtype, ``dw`` in the weight's dtype, or None without a weight."""


@runtime_checkable
class FusedAddBackend(Protocol):
    """Optional: a fused residual add (else :mod:`tilegym_rms.ops` adds in torch, then normalizes)."""

    # Whether ``residual`` may have another dtype than ``x`` (else ops adds such pairs in torch).
    FUSED_ADD_MIXED_DTYPES: bool

    def fused_add_forward(self, x, residual, weight, eps: float, offset: float, casting_mode: str, *, mode: str,
                          store_rstd=True, residual_out=None, kernel=None):  # fmt: skip
        """``(y, residual_out, rstd)`` for ``s = x + residual`` (:func:`tilegym_rms.reference.fused_add_sum`:
        in residual's dtype); ``residual_out`` is ``s`` (mode "pre") or ``y`` (mode "post"). With a
        ``residual_out`` tensor (mode "pre"; residual's shape and dtype, contiguous rows) ``s`` is written
        there, also when it is ``residual`` itself (in place). ``kernel`` as in :meth:`Backend.forward`;
        ``rstd`` None unless ``store_rstd``."""


@runtime_checkable
class FusedAddBackwardBackend(Protocol):
    """Optional: the fused add's backward in one pass (else :mod:`tilegym_rms.ops` adds ``dres`` in torch)."""

    def fused_add_backward(self, s, dy, dres, weight, rstd, offset: float, casting_mode: str):
        """``(ds, dw)``: :meth:`Backend.backward` at the sum ``s`` plus ``dres``, the gradient of
        residual_out (mode "pre"), in ``s``'s dtype (``dy`` and ``dres`` have it too); ``ds`` is the
        gradient of ``x`` and of ``residual`` (up to a cast)."""


@runtime_checkable
class QKNormBackend(Protocol):
    """Optional: queries and keys normalized together, one launch each way (else :mod:`tilegym_rms.ops`
    runs the plain norm on each). ``q`` and ``k`` arrive as 4-D ``(A, G, H, D)`` views with a dense last dim
    and any strides in their first three dims (rows of one tensor never overlap), of one dtype and ``D``,
    never empty; rows are numbered ``(a * G + g) * H + h``. The views of one side (``q`` and ``dq_out``; ``k``
    and ``dk_out``) share one shape, each with its own strides: e.g. ``(1, 1, M, D)`` for dense tensors,
    ``(1, tokens, heads, D)`` for a fused qkv slice, ``(B, S, H, D)`` for a gradient whose memory order differs
    from q's. ``q`` and ``k`` have shapes of their own."""

    def qk_forward(self, q, k, q_weight, k_weight, eps: float, offset: float, casting_mode: str):
        """``(q_out, k_out, q_rstd, k_rstd)``: outputs contiguous ``(A, G, H, D)`` in the input dtype, rstd
        contiguous ``(A, G, H)`` in :func:`tilegym_rms.reference.compute_dtype`."""

    def qk_backward(self, q, k, dq_out, dk_out, q_weight, k_weight, q_rstd, k_rstd, offset: float, casting_mode: str):
        """``(dq, dk, dq_weight, dk_weight)``: contiguous ``(A, G, H, D)`` gradients in the input dtype (``dq_out``
        and ``dk_out`` are views of the shapes of ``q`` and ``k``, the rstd contiguous ``(A, G, H)``); each dw in
        its weight's dtype, or None without that weight."""


@runtime_checkable
class GatedBackend(Protocol):
    """Optional: the gated norm (:func:`tilegym_rms.reference.gated_rms_norm_forward`) in one pass each way
    (else :mod:`tilegym_rms.ops` runs the reference's torch math on the device). ``x``, ``z`` and ``dy`` arrive
    as 2-D ``(M, N)`` views as in :class:`Backend`, ``z`` in any of ``SUPPORTED_DTYPES``; ``group_size``
    divides ``N`` (``N`` itself for one group); ``rstd`` is ``(M, N // group_size)``; ``activation`` is one of
    :data:`tilegym_rms.reference.GATE_ACTIVATIONS`."""

    def gated_forward(self, x, z, weight, eps: float, offset: float, casting_mode: str, *, group_size: int,
                      norm_before_gate: bool, activation: str = "silu", store_rstd=True):  # fmt: skip
        """``(y, rstd)``: ``y`` contiguous in x's dtype; ``rstd`` contiguous, None unless ``store_rstd``."""

    def gated_backward(self, x, z, dy, weight, rstd, offset: float, casting_mode: str, *, group_size: int,
                       norm_before_gate: bool, activation: str = "silu"):  # fmt: skip
        """``(dx, dz, dw)``: contiguous, in x's, z's and the weight's dtype (``dw`` None without a weight)."""


@runtime_checkable
class WorkspaceBackend(Protocol):
    """Optional: the bytes of temporary memory the backward allocates (0 when absent)."""

    def backward_workspace_bytes(self, m: int, n: int, dtype: torch.dtype, device: torch.device) -> int:
        """Bytes the backward of an ``(m, n)`` input allocates besides its outputs."""


@runtime_checkable
class FP8Backend(Protocol):
    """Optional: the norm, or the fused add, with its output quantized to fp8 in one pass (else
    :mod:`tilegym_rms.ops` runs the norm, then :func:`tilegym_rms.reference.quantize_fp8`). Inference only."""

    FP8_MAX_N: int  # the widest row it takes; wider rows take the unfused path

    def fp8_runs_on(self, device) -> bool:
        """Whether the one-pass kernel runs on ``device`` (else the unfused path)."""

    def fp8_forward(self, x, residual, weight, eps: float, offset: float, casting_mode: str, *, out_dtype, scale,
                    group_size, scale_ub, use_ue8m0):  # fmt: skip
        """``(y_q, scales)`` of :func:`tilegym_rms.reference.rms_norm_fp8_reference` for a 2-D ``x`` (and ``residual``
        of its shape, or None) with a dense last dim: ``y_q`` contiguous in ``out_dtype``; ``scales`` None for a
        static ``scale``, else fp32 ``(M, 1)`` per row or ``(M, cdiv(N, group_size))`` per group. With ``residual``
        the sum is written over it (its rows dense). ``scale`` and ``scale_ub`` are None or one-element fp32
        tensors on x's device."""


BACKENDS = ("cutile", "triton", "torch")
BACKEND_ENV = "TILEGYM_RMS_BACKEND"
_MODULES = {"cutile": "tilegym_rms.cutile", "triton": "tilegym_rms.triton", "torch": "tilegym_rms._torch_backend"}
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


def check_backend_name(name: str, source: str = "") -> None:
    """``source``: where the name came from, for the message (`` (TILEGYM_RMS_BACKEND=...)``)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}{source}; choose one of {', '.join(map(repr, BACKENDS))} or None")


# Device types that only a torch extension defines, and how to install it.
_EXTENSION_DEVICES = {"npu": "torch_npu is not installed (pip install 'tilegym_rms[ascend]')"}


def default_device() -> torch.device:
    """The current CUDA device where CUDA is available, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def available_backends(device=None) -> dict[str, tuple[bool, str]]:
    """For each backend: whether it can run on ``device`` (default: :func:`default_device`), and if not,
    why."""
    if device is None:
        device = default_device()
    try:
        device = torch.device(device)
    except RuntimeError:
        kind = str(device).split(":")[0]
        if kind not in _EXTENSION_DEVICES:
            raise
        # "npu" without torch_npu: no backend can reach such a device, for one reason
        return dict.fromkeys(BACKENDS, (False, f"torch has no device type {kind!r}: {_EXTENSION_DEVICES[kind]}"))
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
    source = ""
    if requested is None:
        requested = os.environ.get(BACKEND_ENV) or None
        source = f" ({BACKEND_ENV}={requested})"  # the errors name the variable: no call named a backend
    if requested is not None:
        check_backend_name(requested, source)
        ok, why = backend_module(requested).available(device)
        if not ok:
            raise RuntimeError(f"backend {requested!r}{source} cannot run on {device}: {why}")
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
