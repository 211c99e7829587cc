"""The providers (tilegym_rms's backends and its peers), the inputs they run on, the call each op times, and
the check of its outputs against float64 math."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from bench.common import base, gated, traffic


@dataclass
class Provider:
    name: str
    forward: Callable  # (x, w) -> y, autograd-capable; for fused-add providers (x, r, w) -> (y, residual_out)
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


def _tilegym_rms_availability(names, device, tilegym_rms, tilegym_rms_error):
    """``(available_backends, module, error)``: the module becomes None when it cannot even be asked."""
    if not any(n.startswith("tilegym_rms-") for n in names) or tilegym_rms is None:
        return {}, tilegym_rms, tilegym_rms_error
    try:
        return tilegym_rms.available_backends(device), tilegym_rms, tilegym_rms_error
    except Exception as exc:  # noqa: BLE001
        return {}, None, f"available_backends failed: {base.short_error(exc)}"


def _unimportable(tilegym_rms_error: str) -> str:
    """The skip reason of every provider that needs the package when it does not import."""
    return f"tilegym_rms not importable ({tilegym_rms_error})"


def _backend_unavailable(backend: str, avail: dict, tilegym_rms, tilegym_rms_error: str) -> str | None:
    """Why our backend ``backend`` (of a ``tilegym_rms-<backend>`` provider) cannot run here; None when it can.
    ``avail``, ``tilegym_rms`` and ``tilegym_rms_error`` as :func:`_tilegym_rms_availability` returns them."""
    if tilegym_rms is None:
        return _unimportable(tilegym_rms_error)
    ok, why = avail.get(backend, (False, "not reported by available_backends"))
    return None if ok else (why or "not available")


def discover_providers(
    names: list[str], device: torch.device, eps: float, tilegym_rms=None, tilegym_rms_error: str = ""
) -> tuple[list[Provider], dict[str, str]]:
    """The requested providers that can run on ``device``, and a reason for each skipped one."""
    found: list[Provider] = []
    skipped: dict[str, str] = {}
    avail, tilegym_rms, tilegym_rms_error = _tilegym_rms_availability(names, device, tilegym_rms, tilegym_rms_error)
    for name in names:
        try:
            if name in base.OWN_MEASURE_ONLY:
                skipped[name] = f"a provider of --measure {base.OWN_MEASURE_ONLY[name]} only"
            elif name.startswith("tilegym_rms-"):
                backend = name.split("-", 1)[1]
                why = _backend_unavailable(backend, avail, tilegym_rms, tilegym_rms_error)
                if why:
                    skipped[name] = why
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
            elif name == "quack":
                from quack.rmsnorm import rmsnorm

                found.append(Provider(name, lambda x, w, f=rmsnorm: f(x, w, eps=eps)))
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


def discover_fused_add_providers(
    names: list[str], device: torch.device, eps: float, tilegym_rms=None, tilegym_rms_error: str = ""
) -> tuple[list[Provider], dict[str, str]]:
    """The requested providers of the residual add fused with RMSNorm (mode "pre") that can run on ``device``,
    and a reason for each skipped one. Each ``forward`` is (x, r, w) -> (y, residual_out), autograd-capable."""
    found: list[Provider] = []
    skipped: dict[str, str] = {}
    avail, tilegym_rms, tilegym_rms_error = _tilegym_rms_availability(names, device, tilegym_rms, tilegym_rms_error)
    for name in names:
        try:
            if name.startswith("tilegym_rms-"):
                backend = name.split("-", 1)[1]
                if tilegym_rms is None:
                    skipped[name] = _unimportable(tilegym_rms_error)
                    continue
                if backend == "unfused":  # x + r, then the default backend's rms_norm

                    def unfused(x, r, w, mod=tilegym_rms):
                        s = x + r
                        return mod.rms_norm(s, w, eps), s

                    found.append(Provider(name, unfused))
                    continue
                why = _backend_unavailable(backend, avail, tilegym_rms, tilegym_rms_error)
                if why:
                    skipped[name] = why
                    continue

                def fused(x, r, w, mod=tilegym_rms, backend=backend):
                    return mod.fused_add_rms_norm(x, r, w, eps, mode="pre", backend=backend)

                found.append(Provider(name, fused))
            elif name == "torch":
                found.append(Provider(name, eager_fused_add_rms_norm(eps)))
            elif name == "torch.compile":
                configure_compile()
                found.append(Provider(name, torch.compile(eager_fused_add_rms_norm(eps), dynamic=False)))
            elif name == "liger":
                from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

                def liger(x, r, w, f=LigerFusedAddRMSNormFunction):
                    return f.apply(x, r, w, eps, 0.0, "llama", False)

                found.append(Provider(name, liger))
            elif name == "quack":
                from quack.rmsnorm import rmsnorm

                def quack(x, r, w, f=rmsnorm):
                    return f(x, w, eps=eps, residual=r, prenorm=True)

                found.append(Provider(name, quack))
            elif name == "tilegym":
                skipped[name] = "no fused add + RMSNorm in tilegym"
            else:
                skipped[name] = "unknown provider"
        except Exception as exc:  # noqa: BLE001 - an absent or broken peer is skipped, not fatal
            skipped[name] = base.short_error(exc)
    return found, skipped


FP8_DTYPE = torch.float8_e4m3fn
FP8_STATIC_AMAX = 10.0


def discover_fp8_providers(
    names: list[str], device: torch.device, eps: float, tilegym_rms=None, tilegym_rms_error: str = ""
) -> tuple[list[Provider], dict[str, str]]:
    """The requested providers of RMSNorm with FP8 output that can run on ``device``, and a reason for each
    skipped one. Each ``forward`` is (x, r, w, **quant) -> (y_q, scales, s): ``r`` None, or the residual that x is
    added to first (``s`` the sum, None without ``r``); ``quant`` as :func:`fp8_quant`. Inference only."""
    found: list[Provider] = []
    skipped: dict[str, str] = {}
    avail, tilegym_rms, tilegym_rms_error = _tilegym_rms_availability(names, device, tilegym_rms, tilegym_rms_error)
    for name in names:
        try:
            if tilegym_rms is None and (name.startswith("tilegym_rms-") or name in ("torch", "torch.compile")):
                skipped[name] = _unimportable(tilegym_rms_error)
            elif name == "tilegym_rms-unfused":  # what a caller writes without the fused op: the norm, then quantize

                def unfused(x, r, w, mod=tilegym_rms, **quant):
                    y = mod.rms_norm(x, w, eps) if r is None else mod.fused_add_rms_norm_(x, r, w, eps)
                    return (*mod.reference.quantize_fp8(y, **quant), r)

                found.append(Provider(name, unfused))
            elif name.startswith("tilegym_rms-"):
                backend = name.split("-", 1)[1]
                why = _backend_unavailable(backend, avail, tilegym_rms, tilegym_rms_error)
                if why:
                    skipped[name] = why
                    continue

                def fused(x, r, w, mod=tilegym_rms, backend=backend, **quant):
                    if r is None:
                        return (*mod.rms_norm_fp8(x, w, eps, backend=backend, **quant), None)
                    return (*mod.fused_add_rms_norm_fp8(x, r, w, eps, backend=backend, **quant), r)

                found.append(Provider(name, fused))
            elif name in ("torch", "torch.compile"):  # the reference's norm and quantization, eager or compiled

                def ref(x, r, w, f=tilegym_rms.reference.rms_norm_fp8_reference, **quant):
                    return f(x, w, eps, residual=r, **quant)

                if name == "torch.compile":
                    configure_compile()
                    ref = torch.compile(ref, dynamic=False)
                found.append(Provider(name, ref))
            else:
                skipped[name] = f"no RMSNorm with FP8 output in {name}"
        except Exception as exc:  # noqa: BLE001 - an absent or broken peer is skipped, not fatal
            skipped[name] = base.short_error(exc)
    return found, skipped


def fp8_quant(op: str, device) -> dict:
    """The quantization arguments of an FP8 op (traffic.FP8_OPS), e4m3fn. The static scale stands for a calibrated
    one: the benchmark's normalized rows (randn x, weight 1 +- 0.1) stay below FP8_STATIC_AMAX, none saturates."""
    scales = traffic.FP8_OPS[op][0]
    quant = {"out_dtype": FP8_DTYPE}
    if scales == "static":
        quant["scale"] = torch.full((1,), FP8_STATIC_AMAX / torch.finfo(FP8_DTYPE).max, device=device)
    else:
        quant["group_size"] = traffic.FP8_GROUP_SIZE if scales == "group" else None
    return quant


def discover_qk_providers(
    names: list[str], device: torch.device, eps: float, tilegym_rms=None, tilegym_rms_error: str = ""
) -> tuple[list[Provider], dict[str, str]]:
    """The requested QK-norm providers that can run on ``device``, and a reason for each skipped one. Each
    ``forward`` is (q, k, wq, wk) -> (q_out, k_out), autograd-capable: ours in one call (``qk_rms_norm``), the
    peers' RMSNorm and ours (tilegym_rms-unfused: ``rms_norm``) called on each tensor."""
    plain, skipped = discover_providers(
        [n for n in names if not n.startswith("tilegym_rms-")], device, eps, tilegym_rms, tilegym_rms_error
    )
    found = [Provider(p.name, _on_q_and_k(p)) for p in plain]
    avail, tilegym_rms, tilegym_rms_error = _tilegym_rms_availability(names, device, tilegym_rms, tilegym_rms_error)
    for name in (n for n in names if n.startswith("tilegym_rms-")):
        backend = name.split("-", 1)[1]
        if backend == "unfused":  # the default backend's rms_norm on q, then on k: the plain kernels, twice
            if tilegym_rms is None:
                skipped[name] = _unimportable(tilegym_rms_error)
            else:
                found.append(Provider(name, _on_q_and_k(_tilegym_rms_provider(name, tilegym_rms, None, eps))))
            continue
        why = _backend_unavailable(backend, avail, tilegym_rms, tilegym_rms_error)
        if why:
            skipped[name] = why
            continue

        def qk(q, k, wq, wk, mod=tilegym_rms, backend=backend):
            return mod.qk_rms_norm(q, k, wq, wk, eps, backend=backend)

        found.insert(0, Provider(name, qk))
    return found, skipped


def _on_q_and_k(p: Provider) -> Callable:
    """(q, k, wq, wk) -> (q_out, k_out): a peer's RMSNorm on each tensor. quack takes 2-D rows: q and k are
    reshaped to them (a copy where their layout has no such view, as a caller would make) and back."""
    if p.name == "quack":

        def norm(t, w, f=p.forward):
            return f(t.reshape(-1, t.shape[-1]), w).view(t.shape)

    else:
        norm = p.forward
    return lambda q, k, wq, wk: (norm(q, wq), norm(k, wk))


def eager_fused_add_rms_norm(eps: float) -> Callable:
    """(x, r, w) -> (y, s): ``s = x + r; y = F.rms_norm(s, (N,), w, eps)`` (eps a closure constant, so that a
    compiled graph specializes on it)."""

    def fused_add(x, r, w):
        s = x + r
        return torch.nn.functional.rms_norm(s, (s.shape[-1],), w, eps), s

    return fused_add


def _tilegym_rms_provider(name: str, mod, backend: str, eps: float) -> Provider:
    def forward(x, w):
        return mod.rms_norm(x, w, eps, backend=backend)

    def standalone(x, dy, w, rstd):
        return mod.rms_norm_backward(x, dy, w, rstd, backend=backend)

    return Provider(name, forward, standalone)


# --------------------------------------------------------------------------------------------------------------
# Inputs, calls, correctness
# --------------------------------------------------------------------------------------------------------------


def _leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Leaves that require grad, sharing storage with ``tensors`` (the backward measures' inputs)."""
    return [t.detach().requires_grad_(True) for t in tensors]


def _qk_tensors(layout: str, m: int, d: int, dtype, device, n: int, g, need_dy: bool):
    """``(q, k, dyq, dyk)`` lists of ``n`` sets in ``layout`` (traffic.QK_LAYOUTS): q of ``m`` rows in
    base.QK_HEADS[0] heads, k of base.QK_HEADS[1], head dim ``d``; two sequences of ``m / heads / 2`` tokens."""
    hq, hk = base.QK_HEADS
    tokens = m // hq
    b, s = (2, tokens // 2) if tokens % 2 == 0 else (1, tokens)

    def randn(*shape):
        return torch.randn(shape, dtype=dtype, device=device, generator=g)

    qs, ks, dqs, dks = [], [], [], []
    for _ in range(n):
        if layout == "separate":  # q_proj(x).view(tokens, heads, D): contiguous, gradients too
            q, k = randn(tokens, hq, d), randn(tokens, hk, d)
            dyq, dyk = (randn(*t.shape) for t in (q, k))
        elif layout == "transposed":  # .view(B, S, H, D).transpose(1, 2); the consumer's gradient (B, H, S, D)
            q, k = randn(b, s, hq, d).transpose(1, 2), randn(b, s, hk, d).transpose(1, 2)
            dyq, dyk = (randn(*t.shape) for t in (q, k))
        else:  # qkv slices; the gradient handed back through .transpose(1, 2) from (B, H, S, D) math
            qkv = randn(b, s, (hq + 2 * hk) * d)
            q, k = qkv[..., : hq * d].view(b, s, hq, d), qkv[..., hq * d : (hq + hk) * d].view(b, s, hk, d)
            dyq, dyk = (randn(b, t.shape[2], s, d).transpose(1, 2) for t in (q, k))
        qs.append(q)
        ks.append(k)
        dqs.append(dyq)
        dks.append(dyk)
    return qs, ks, (dqs if need_dy else []), (dks if need_dy else [])


class InputSets:
    """``n`` independent (x, w, dy, rstd) sets of one shape; ``xg``/``wg`` are grad-requiring leaves that share
    the storage of ``x``/``w``."""

    def __init__(
        self,
        m: int,
        n_cols: int,
        dtype,
        device,
        n: int,
        seed: int,
        eps: float,
        need_dy: bool = True,
        need_residual: bool = False,
        qk: str = "",
        gate_dtype: torch.dtype | None = None,
    ):
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        self.n = n
        # QK-norm (``qk``: a layout of traffic.QK_LAYOUTS): x holds q, k, wk and dyk the keys' tensors
        if qk:
            self.x, self.k, self.dy, self.dyk = _qk_tensors(qk, m, n_cols, dtype, device, n, g, need_dy)
        else:
            self.x = [torch.randn(m, n_cols, dtype=dtype, device=device, generator=g) for _ in range(n)]
            self.dy = (
                [torch.randn(m, n_cols, dtype=dtype, device=device, generator=g) for _ in range(n)] if need_dy else []
            )
            self.k, self.dyk = [], []
        self.w = [
            (1.0 + 0.1 * torch.randn(n_cols, dtype=torch.float32, device=device, generator=g)).to(dtype)
            for _ in range(n)
        ]
        self.wk = [(1.0 + 0.1 * torch.randn(n_cols, device=device, generator=g)).to(dtype) for _ in self.k]
        # fused add: the residual r and, for the backward, the gradient of residual_out
        self.r = (
            [torch.randn(m, n_cols, dtype=dtype, device=device, generator=g) for _ in range(n)] if need_residual else []
        )
        self.dres = (
            [torch.randn(m, n_cols, dtype=dtype, device=device, generator=g) for _ in range(n)]
            if need_residual and need_dy
            else []
        )
        # gated RMSNorm: the gate z, in its own dtype
        self.z = (
            [torch.randn(m, n_cols, device=device, generator=g).to(gate_dtype) for _ in range(n)] if gate_dtype else []
        )
        self.eps = eps

    # Built on first use only: forward-only runs never need rstd or grad-requiring leaves.
    @cached_property
    def rstd(self) -> list[torch.Tensor]:
        return [torch.rsqrt(x.float().square().mean(-1) + self.eps) for x in self.x]

    @cached_property
    def r_initial(self) -> torch.Tensor:
        """Set 0's residual as built (read before any call): an op that adds into it in place restores it."""
        return self.r[0].clone()

    @cached_property
    def xg(self) -> list[torch.Tensor]:
        return _leaves(self.x)

    @cached_property
    def wg(self) -> list[torch.Tensor]:
        return _leaves(self.w)

    @cached_property
    def kg(self) -> list[torch.Tensor]:
        return _leaves(self.k)

    @cached_property
    def wkg(self) -> list[torch.Tensor]:
        return _leaves(self.wk)

    @cached_property
    def rg(self) -> list[torch.Tensor]:
        return _leaves(self.r)

    @cached_property
    def zg(self) -> list[torch.Tensor]:
        return _leaves(self.z)


def build_call(op: str, provider: Provider, sets: InputSets) -> tuple[Callable[[int], dict], str]:
    """``call(i)`` running ``op`` on set ``i`` and returning its outputs by name, and a note on how.

    forward: under no_grad. backward/autograd: the forward graphs of all sets are built here (outside any timed
    region) and ``call`` replays ``torch.autograd.grad(y, (x, w), dy, retain_graph=True)``. standalone: the
    provider's standalone backward, or the autograd backward when it has none. full: forward + autograd.grad.
    fused_add_fwd: ``(y, residual_out) = provider(x, r, w)`` under no_grad. fused_add_bwd: the forward graphs are
    built here and ``call`` replays ``torch.autograd.grad((y, residual_out), (x, r, w), (dy, dres),
    retain_graph=True)``.
    """
    if op in traffic.FP8_OPS:
        quant, add = fp8_quant(op, sets.x[0].device), traffic.FP8_OPS[op][1]
        if add:  # each call adds x into r in place: set 0's first call here is checked against r as built
            sets.r[0].copy_(sets.r_initial)

        def call_fp8(i):
            with torch.no_grad():
                y_q, scales, s = provider.forward(sets.x[i], sets.r[i] if add else None, sets.w[i], **quant)
            return {"y_q": y_q, "scales": scales} | ({"res": s} if add else {})

        return call_fp8, ""
    if op in gated.OPS:
        return _gated_call(op, provider, sets), ""
    if op in traffic.QK_OPS and traffic.qk_op_parts(op)[0] == "fwd":

        def call_qk_fwd(i):
            with torch.no_grad():
                yq, yk = provider.forward(sets.x[i], sets.k[i], sets.w[i], sets.wk[i])
            return {"y": yq, "y_k": yk}

        return call_qk_fwd, ""
    if op in traffic.QK_OPS:
        outs = [provider.forward(sets.xg[i], sets.kg[i], sets.wg[i], sets.wkg[i]) for i in range(sets.n)]

        def call_qk_bwd(i):
            leaves = (sets.xg[i], sets.kg[i], sets.wg[i], sets.wkg[i])
            dq, dk, dwq, dwk = torch.autograd.grad(outs[i], leaves, (sets.dy[i], sets.dyk[i]), retain_graph=True)
            return {"dx": dq, "dw": dwq, "dx_k": dk, "dw_k": dwk}

        return call_qk_bwd, ""
    if op == "fused_add_fwd":

        def call_fused_fwd(i):
            with torch.no_grad():
                y, res = provider.forward(sets.x[i], sets.r[i], sets.w[i])
            return {"y": y, "res": res}

        return call_fused_fwd, ""
    if op == "fused_add_bwd":
        outs = [provider.forward(sets.xg[i], sets.rg[i], sets.wg[i]) for i in range(sets.n)]

        def call_fused_bwd(i):
            dx, dr, dw = torch.autograd.grad(
                outs[i], (sets.xg[i], sets.rg[i], sets.wg[i]), (sets.dy[i], sets.dres[i]), retain_graph=True
            )
            return {"dx": dx, "dr": dr, "dw": dw}

        return call_fused_bwd, ""
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


def _gated_call(op: str, provider: Provider, sets: InputSets) -> Callable[[int], dict]:
    """The gated ops' calls, as the plain forward's and backward's: (x, z, w) under no_grad, or the forward graphs
    built here and ``torch.autograd.grad(y, (x, z, w), dy, retain_graph=True)`` replayed."""
    direction, norm_before_gate, _ = gated.parse(op)
    if direction == "fwd":

        def call_fwd(i):
            with torch.no_grad():
                return {"y": provider.forward(sets.x[i], sets.z[i], sets.w[i], norm_before_gate)}

        return call_fwd
    ys = [provider.forward(sets.xg[i], sets.zg[i], sets.wg[i], norm_before_gate) for i in range(sets.n)]

    def call_bwd(i):
        dx, dz, dw = torch.autograd.grad(ys[i], (sets.xg[i], sets.zg[i], sets.wg[i]), sets.dy[i], retain_graph=True)
        return {"dx": dx, "dz": dz, "dw": dw}

    return call_bwd


def relative_errors(
    x: torch.Tensor, w: torch.Tensor, eps: float, outputs: dict, dy: torch.Tensor | None = None
) -> dict[str, float]:
    """Relative errors of y, dx, dw (those present in ``outputs``) against float64 math, computed in
    row chunks to bound memory (``tilegym_rms.testing.chunked_errors``)."""
    from tilegym_rms.testing import chunked_errors

    return chunked_errors(x, w, dy, outputs, eps=eps, chunk_elems=1 << 25)


def output_errors(op: str, sets: InputSets, eps: float, outputs: dict) -> dict[str, float]:
    """Relative errors of ``outputs`` (of ``op`` on set 0) against float64 math; an FP8 output dequantized, as
    ``y_q``."""
    if op in traffic.FP8_OPS:
        from tilegym_rms.testing import fp8_dequantize, fused_add_errors

        scales, add = traffic.FP8_OPS[op]
        group_size = traffic.FP8_GROUP_SIZE if scales == "group" else None
        y = fp8_dequantize(outputs["y_q"], outputs["scales"], group_size)
        if add:
            errs = fused_add_errors(sets.x[0], sets.r_initial, sets.w[0], eps, {"y": y, "res": outputs["res"]},
                                    chunk_elems=1 << 25)  # fmt: skip
        else:
            errs = relative_errors(sets.x[0], sets.w[0], eps, {"y": y})
        return {"y_q": errs.pop("y"), **errs}
    if op in gated.OPS:
        dy = sets.dy[0] if sets.dy else None
        return gated.errors(sets.x[0], sets.z[0], sets.w[0], dy, outputs, gated.parse(op)[1], eps)
    if op in traffic.QK_OPS:  # q's outputs by their plain names, k's with the suffix _k
        k_outs = {name[:-2]: v for name, v in outputs.items() if name.endswith("_k")}
        errs = relative_errors(sets.k[0], sets.wk[0], eps, k_outs, sets.dyk[0] if sets.dyk else None)
        q_outs = {name: v for name, v in outputs.items() if not name.endswith("_k")}
        q_errs = relative_errors(sets.x[0], sets.w[0], eps, q_outs, sets.dy[0] if sets.dy else None)
        return q_errs | {f"{name}_k": e for name, e in errs.items()}
    if op in ("fused_add_fwd", "fused_add_bwd"):
        dy = sets.dy[0] if sets.dy else None
        dres = sets.dres[0] if sets.dres else None
        from tilegym_rms.testing import fused_add_errors

        return fused_add_errors(sets.x[0], sets.r[0], sets.w[0], eps, outputs, dy, dres, chunk_elems=1 << 25)
    return relative_errors(sets.x[0], sets.w[0], eps, outputs, sets.dy[0] if sets.dy else None)


def check_ok(errs: dict[str, float], dtype_name: str) -> bool:
    return all(math.isfinite(e) and e <= base.tolerance(name, dtype_name) for name, e in errs.items())
