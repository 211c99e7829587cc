"""The providers (tilegym_rms's backends and its peers), the inputs they run on, the call each op times, and
the check of its outputs against float64 math."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

try:  # imported as part of the bench package / namespace
    from . import base
except ImportError:  # run as a script: bench/ is on sys.path
    import base


@dataclass
class Provider:
    name: str
    forward: Callable  # (x, w) -> y, autograd-capable
    standalone_backward: Callable | None = None  # (x, dy, w, rstd) -> (dx, dw)


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm: fp32 math, rounded to the input dtype before the weight product."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def configure_compile() -> None:
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 4096)
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 65536)
    try:
        import torch._functorch.config as fconfig

        fconfig.donated_buffer = False  # backward is replayed with retain_graph
    except (ImportError, AttributeError):
        pass


def import_tilegym_rms():
    """(module or None, version string, error string)."""
    try:
        import tilegym_rms
    except Exception as exc:  # noqa: BLE001 - the package may be mid-edit; report and go on
        return None, "unavailable", base.short_error(exc)
    return tilegym_rms, str(getattr(tilegym_rms, "__version__", "unknown")), ""


def discover_providers(
    names: list[str], device: torch.device, eps: float, tilegym_rms=None, tilegym_rms_error: str = ""
) -> tuple[list[Provider], dict[str, str]]:
    """The requested providers that can run on ``device``, and a reason for each skipped one."""
    found: list[Provider] = []
    skipped: dict[str, str] = {}
    avail: dict = {}
    if any(n.startswith("tilegym_rms-") for n in names) and tilegym_rms is not None:
        try:
            avail = tilegym_rms.available_backends(device)
        except Exception as exc:  # noqa: BLE001
            tilegym_rms_error = f"available_backends failed: {base.short_error(exc)}"
            tilegym_rms = None
    for name in names:
        try:
            if name.startswith("tilegym_rms-"):
                backend = name.split("-", 1)[1]
                if tilegym_rms is None:
                    skipped[name] = f"tilegym_rms not importable ({tilegym_rms_error})"
                    continue
                ok, why = avail.get(backend, (False, "not reported by available_backends"))
                if not ok:
                    skipped[name] = why or "not available"
                    continue
                found.append(_tilegym_rms_provider(name, tilegym_rms, backend, eps))
            elif name == "torch":
                n_fn = torch.nn.functional.rms_norm
                found.append(Provider(name, lambda x, w, f=n_fn: f(x, (x.shape[-1],), w, eps)))
            elif name == "torch.compile":
                configure_compile()

                def llama_fixed_eps(x, w):  # eps a closure constant, so the graph specializes on it
                    return llama_rms_norm(x, w, eps)

                compiled = torch.compile(llama_fixed_eps, dynamic=False)
                found.append(Provider(name, compiled))
            elif name == "liger":
                from liger_kernel.ops.rms_norm import LigerRMSNormFunction

                found.append(
                    Provider(name, lambda x, w, f=LigerRMSNormFunction: f.apply(x, w, eps, 0.0, "llama", False))
                )
            elif name == "tilegym":
                # by module path: the package attribute tilegym.ops.cutile.rms_norm is the function, not the module
                tg = importlib.import_module("tilegym.ops.cutile.rms_norm")

                found.append(
                    Provider(
                        name,
                        lambda x, w, f=tg.rms_norm: f(x, (x.shape[-1],), w, eps),
                        standalone_backward=getattr(tg, "rms_norm_backward", None),
                    )
                )
            else:
                skipped[name] = "unknown provider"
        except Exception as exc:  # noqa: BLE001 - an absent or broken peer is skipped, not fatal
            skipped[name] = base.short_error(exc)
    return found, skipped


def _tilegym_rms_provider(name: str, mod, backend: str, eps: float) -> Provider:
    def forward(x, w):
        return mod.rms_norm(x, w, eps, backend=backend)

    def standalone(x, dy, w, rstd):
        return mod.rms_norm_backward(x, dy, w, rstd, backend=backend)

    return Provider(name, forward, standalone)


# --------------------------------------------------------------------------------------------------------------
# Inputs, calls, correctness
# --------------------------------------------------------------------------------------------------------------


class InputSets:
    """``n`` independent (x, w, dy, rstd) sets of one shape; ``xg``/``wg`` are grad-requiring leaves that share
    the storage of ``x``/``w``."""

    def __init__(self, m: int, n_cols: int, dtype, device, n: int, seed: int, eps: float, need_dy: bool = True):
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        self.n = n
        self.x = [torch.randn(m, n_cols, dtype=dtype, device=device, generator=g) for _ in range(n)]
        self.w = [
            (1.0 + 0.1 * torch.randn(n_cols, dtype=torch.float32, device=device, generator=g)).to(dtype)
            for _ in range(n)
        ]
        self.dy = [torch.randn(m, n_cols, dtype=dtype, device=device, generator=g) for _ in range(n)] if need_dy else []
        self.eps = eps

    # Built on first use only: forward-only runs never need rstd or grad-requiring leaves.
    @cached_property
    def rstd(self) -> list[torch.Tensor]:
        return [torch.rsqrt(x.float().square().mean(-1) + self.eps) for x in self.x]

    @cached_property
    def xg(self) -> list[torch.Tensor]:
        return [x.detach().requires_grad_(True) for x in self.x]

    @cached_property
    def wg(self) -> list[torch.Tensor]:
        return [w.detach().requires_grad_(True) for w in self.w]


def build_call(op: str, provider: Provider, sets: InputSets) -> tuple[Callable[[int], dict], str]:
    """``call(i)`` running ``op`` on set ``i`` and returning its outputs by name, and a note on how.

    forward: under no_grad. backward/autograd: the forward graphs of all sets are built here (outside any timed
    region) and ``call`` replays ``torch.autograd.grad(y, (x, w), dy, retain_graph=True)``. standalone: the
    provider's standalone backward, or the autograd backward when it has none. full: forward + autograd.grad.
    """
    if op == "forward":

        def call_fwd(i):
            with torch.no_grad():
                return {"y": provider.forward(sets.x[i], sets.w[i])}

        return call_fwd, ""
    if op == "standalone" and provider.standalone_backward is not None:
        bwd = provider.standalone_backward

        def call_standalone(i):
            dx, dw = bwd(sets.x[i], sets.dy[i], sets.w[i], sets.rstd[i])
            return {"dx": dx, "dw": dw}

        return call_standalone, ""
    if op in ("backward", "autograd", "standalone"):
        ys = [provider.forward(sets.xg[i], sets.wg[i]) for i in range(sets.n)]

        def call_bwd(i):
            dx, dw = torch.autograd.grad(ys[i], (sets.xg[i], sets.wg[i]), sets.dy[i], retain_graph=True)
            return {"dx": dx, "dw": dw}

        return call_bwd, ("autograd backward" if op == "standalone" else "")
    if op == "full":

        def call_full(i):
            y = provider.forward(sets.xg[i], sets.wg[i])
            dx, dw = torch.autograd.grad(y, (sets.xg[i], sets.wg[i]), sets.dy[i])
            return {"y": y, "dx": dx, "dw": dw}

        return call_full, ""
    raise ValueError(f"unknown op {op!r}")


def relative_errors(
    x: torch.Tensor, w: torch.Tensor, eps: float, outputs: dict, dy: torch.Tensor | None = None
) -> dict[str, float]:
    """Relative errors of y, dx, dw (those present in ``outputs``) against float64 math, computed in
    row chunks to bound memory (``tilegym_rms.testing.chunked_errors``)."""
    from tilegym_rms.testing import chunked_errors

    return chunked_errors(x, w, dy, outputs, eps=eps, chunk_elems=1 << 25)


def check_ok(errs: dict[str, float], dtype_name: str) -> bool:
    tol = base.TOLERANCE[dtype_name]
    return all(math.isfinite(e) and e <= tol for e in errs.values())
