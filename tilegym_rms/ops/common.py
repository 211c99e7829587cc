"""What every operation shares: the 2-D row views the backends take, backend lookup, the eager forward
and backward of the norm on those views (empty inputs included), and the fingerprint of this package
that the custom ops take (``WIRING``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from .. import _checks, reference
from ..dispatch import backend_module

# ----------------------------------------------------------------------------------------------
# Shape plumbing shared by every path: N-D tensors <-> the 2-D row views the backends take
# ----------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """A 2-D ``(M, N)`` view with a dense last dim; copies only when no such view exists."""
    if t.is_contiguous():  # the common cases, kept cheap: this runs on every call
        return t if t.dim() == 2 else t.view(-1, n)
    t2 = t.reshape(-1, n)
    if (n > 1 and t2.stride(1) != 1) or (t2.shape[0] > 1 and t2.stride(0) < n):
        t2 = t2.contiguous()  # a gather along the row, or rows that overlap (broadcast grads)
    return t2


_peek_func_transform = getattr(torch._C._functorch, "peek_interpreter_stack", lambda: None)


def under_func_transform() -> bool:
    """Whether a torch.func transform (``vmap``, ``grad``, ``jacrev``, ``jvp``, ...) runs this call. The kernels
    and the eager autograd Functions are opaque to those transforms; the reference's torch math, which defines
    what the kernels compute, is not: the public functions run it there."""
    return _peek_func_transform() is not None


def _backend(x: torch.Tensor, name: str):
    module = backend_module(name)
    _checks.check_dtype_for_backend(x, name, module.SUPPORTED_DTYPES)
    return module


def _dense_weight(weight):
    # is_contiguous() first: contiguous() is a dispatcher call even when it returns its input.
    return weight if weight is None or weight.is_contiguous() else weight.contiguous()


def _empty_forward(x, eps, casting_mode, store_rstd):
    """Empty input: no kernel runs. A last dim of 0 still has rows, whose rstd the reference defines."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, (reference.rms_norm_forward(x, None, eps, 0.0, casting_mode)[1] if store_rstd else None)


def _check_kernel(module, name: str, kernel) -> None:
    if kernel not in module.FORWARD_KERNELS:
        if not module.FORWARD_KERNELS:
            raise ValueError(f"backend {name!r} has one forward kernel: kernel must be None, got {kernel!r}")
        choices = ", ".join(map(repr, module.FORWARD_KERNELS))
        raise ValueError(f"backend {name!r} has the forward kernels {choices}: got kernel={kernel!r}")


def _forward(x, weight, eps, offset, casting_mode, backend, kernel=None, store_rstd=True):
    """``(y, rstd)`` with ``y`` shaped like ``x`` and ``rstd`` shaped ``x.shape[:-1]`` (or None
    when not ``store_rstd``: no backward will follow)."""
    module = _backend(x, backend)
    if kernel is not None:
        _check_kernel(module, backend, kernel)
    if x.numel() == 0:
        return _empty_forward(x, eps, casting_mode, store_rstd)
    x2, w = _rows(x, x.shape[-1]), _dense_weight(weight)
    if kernel is None:  # the common call, without the keyword
        y, rstd = module.forward(x2, w, eps, offset, casting_mode, store_rstd=store_rstd)
    else:
        y, rstd = module.forward(x2, w, eps, offset, casting_mode, store_rstd=store_rstd, kernel=kernel)
    if x2 is x:
        return y, rstd
    return y.view(x.shape), (rstd.view(x.shape[:-1]) if rstd is not None else None)


def _backward(x, dy, weight, rstd, offset, casting_mode, backend, dres=None):
    """``(dx, dw)``; with ``dres`` (the gradient of a fused add's residual_out, like ``x``) ``dx + dres``
    from the backend's one-pass :meth:`~tilegym_rms.dispatch.FusedAddBackwardBackend.fused_add_backward`."""
    module = _backend(x, backend)
    if x.numel() == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format), (
            torch.zeros_like(weight) if weight is not None else None
        )
    n = x.shape[-1]
    rows = rstd if rstd.dim() == 1 else rstd.reshape(-1)
    x2, dy2, w = _rows(x, n), _rows(dy, n), _dense_weight(weight)
    if dres is None:
        dx, dw = module.backward(x2, dy2, w, rows, offset, casting_mode)
    else:
        dx, dw = module.fused_add_backward(x2, dy2, _rows(dres, n), w, rows, offset, casting_mode)
    return (dx if x.dim() == 2 else dx.view(x.shape)), dw


def _wiring_fingerprint(package: Path) -> str:
    """A hash of every module of ``package``: the backward wiring of the custom ops lives in all of them."""
    try:
        digest = hashlib.sha1()
        for path in sorted(package.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()[:16]
    except OSError:  # no source files (a frozen or zipped install): the version stands in
        from .. import __version__

        return __version__


# torch's AOTAutograd cache keys a compiled graph on the Dynamo graph, which names the forward ops, but not
# on the backward registered for them: a cached backward of an older version of this package was reused
# with a newer op signature and gave wrong gradients (PERFORMANCE.md, "Host path"). The forward ops take
# this fingerprint of the package as an argument, so that the graph, and the cache key, change with it.
WIRING = _wiring_fingerprint(Path(__file__).parent)
