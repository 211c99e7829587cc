"""The gated RMSNorm measure (``bench_rmsnorm.py --measure gated``): its ops, providers, bytes and check.

An op names its direction, the order of norm and gate and the gate's dtype: ``gated_fwd_before_bf16gate`` is
the forward of ``y = rms_norm(x) * w * silu(z)`` (Qwen3-Next, FalconH1) with a bf16 gate; ``after`` is
``y = rms_norm(x * silu(z)) * w`` (Mamba2, Bamba, NemotronH). Rows of at least :data:`GROUPED_MIN_N` columns are
normalized in :data:`GROUPS` groups (Mamba2's layout), narrower ones as one group (a head of Qwen3-Next's linear
attention); ``--gated-groups`` sets another count for the run (1: whole rows, one group each, as Mamba2 models of one
group lay them out). Every provider's ``forward`` is ``(x, z, w, norm_before_gate) -> y``.
"""

from __future__ import annotations

import functools
import types

import torch

from bench.common import base

DIRECTIONS = ("fwd", "bwd")
ORDERS = {"before": True, "after": False}  # norm before the gate, or after it
GATES = {"bf16gate": torch.bfloat16, "fp32gate": torch.float32}
OPS = tuple(f"gated_{d}_{o}_{g}" for o in ORDERS for g in GATES for d in DIRECTIONS)
# The run's groups per row (bench_rmsnorm.py --gated-groups sets it for the process); records of another count than
# GROUPS_DEFAULT carry it in their config ("groups": 1).
GROUPS_DEFAULT = 8
GROUPS = GROUPS_DEFAULT
GROUPED_MIN_N = 1024
PROVIDERS_DEFAULT = ("tilegym_rms-cutile", "tilegym_rms-triton", "tilegym_rms-unfused", "torch.compile", "mamba-torch")


def parse(op: str) -> tuple[str, bool, torch.dtype]:
    """``(direction, norm_before_gate, gate dtype)`` of a gated op."""
    _, direction, order, gate = op.split("_")
    return direction, ORDERS[order], GATES[gate]


def group_size(n: int) -> int | None:
    """The group width of a row of ``n`` columns in this run's layout; None: the row is one group."""
    return n // GROUPS if GROUPS > 1 and n >= GROUPED_MIN_N and n % GROUPS == 0 else None


def title(op: str) -> str:
    direction, norm_before_gate, gate = parse(op)
    order = "norm before gate" if norm_before_gate else "gate before norm, in groups"
    kind = "forward" if direction == "fwd" else "backward (autograd)"
    return f"{kind}, {order}, {str(gate).replace('torch.', '')} gate"


# --------------------------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------------------------


def _rstd_bytes(m: int, n: int, group: int | None) -> int:
    """The fp32 rstd: one per group of ``group`` columns (None: the layout of :func:`group_size`)."""
    return 4 * m * (n // (group or group_size(n) or n))


def op_bytes(op: str, m: int, n: int, elt: int, group: int | None = None) -> int:
    """Minimal traffic. Forward (no grad): read x, z, w, write y. Backward: read x, z, dy, w and the fp32 rstd
    (one per group of ``group`` columns; None: the layout of :func:`group_size`), write dx, dz and dw."""
    direction, _, gate = parse(op)
    zelt = gate.itemsize
    if direction == "fwd":
        return m * n * (2 * elt + zelt) + n * elt
    return m * n * (3 * elt + 2 * zelt) + 2 * n * elt + _rstd_bytes(m, n, group)


def read_bytes(op: str, m: int, n: int, elt: int, group: int | None = None) -> int:
    """Bytes one call reads (what the input rotation pushes out of L2)."""
    direction, _, gate = parse(op)
    rows = m * n * ((1 if direction == "fwd" else 2) * elt + gate.itemsize)
    return rows + n * elt + (_rstd_bytes(m, n, group) if direction == "bwd" else 0)


# --------------------------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------------------------


def mamba_torch(x, z, w, norm_before_gate, eps):
    """mamba_ssm's gated RMSNorm semantics (layernorm_gated) in plain torch: fp32 throughout, the gate
    ``silu(z)`` before the per-group norm or after it, one rounding at the end."""
    n, g = x.shape[-1], group_size(x.shape[-1]) or x.shape[-1]
    h, s = x.float(), torch.nn.functional.silu(z.float())
    if not norm_before_gate:
        h = h * s
    hg = h.view(*h.shape[:-1], n // g, g)
    y = (hg * torch.rsqrt(hg.square().mean(-1, keepdim=True) + eps)).view(h.shape) * w.float()
    return (y * s if norm_before_gate else y).to(x.dtype)


def _hf_classes():
    """Hugging Face's gated classes: one group before the gate, groups before the gate, groups after it."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    return Qwen3NextRMSNormGated, FalconH1RMSNormGated, MambaRMSNormGated


def hf_forward(x, z, w, norm_before_gate, eps, classes):
    """The forward of the HF class of this layout, on ``w`` (its methods read their fields from ``self``)."""
    qwen3_next, falcon_h1, mamba2 = classes
    n = x.shape[-1]
    g = group_size(n)
    fields = types.SimpleNamespace(weight=w, variance_epsilon=eps, activation="silu", group_size=g or n,
                                   n_groups=n // (g or n), norm_before_gate=norm_before_gate)  # fmt: skip
    if g is None:  # one group: Qwen3-Next's norm before the gate, Mamba2's after it
        return (qwen3_next if norm_before_gate else mamba2).forward(fields, x, z)
    # In groups, FalconH1's class in either order: Mamba2's normalizes whole rows in older transformers releases
    return falcon_h1.forward(fields, x, z)


def discover(names, device, eps, tilegym_rms=None, tilegym_rms_error=""):
    """The requested gated providers that can run on ``device``, and a reason for each skipped one."""
    from bench.common.providers import Provider, _backend_unavailable, _tilegym_rms_availability, configure_compile

    found, skipped = [], {}
    avail, tilegym_rms, tilegym_rms_error = _tilegym_rms_availability(names, device, tilegym_rms, tilegym_rms_error)
    for name in names:
        try:
            if name.startswith("tilegym_rms-"):
                backend = name.split("-", 1)[1]
                why = _backend_unavailable(backend, avail, tilegym_rms, tilegym_rms_error)
                if backend == "unfused" and tilegym_rms is not None:  # the package's default backend
                    found.append(Provider(name, functools.partial(unfused, tilegym_rms, eps=eps)))
                elif why:
                    skipped[name] = why
                else:
                    found.append(Provider(name, functools.partial(ours, tilegym_rms, backend=backend, eps=eps)))
            elif name == "torch.compile":
                configure_compile()
                classes = _hf_classes()

                def hf(x, z, w, norm_before_gate, classes=classes):
                    return hf_forward(x, z, w, norm_before_gate, eps, classes)

                compiled = torch.compile(hf, dynamic=False)
                found.append(Provider(name, compiled))
            elif name == "mamba-torch":
                found.append(Provider(name, functools.partial(mamba_torch, eps=eps)))
            else:
                skipped[name] = "no gated RMSNorm in this provider"
        except Exception as exc:  # noqa: BLE001 - an absent or broken peer is skipped, not fatal
            skipped[name] = base.short_error(exc)
    return found, skipped


def ours(mod, x, z, w, norm_before_gate, *, backend, eps):
    return mod.gated_rms_norm(x, z, w, eps, group_size=group_size(x.shape[-1]), norm_before_gate=norm_before_gate,
                              casting_mode="llama", backend=backend)  # fmt: skip


def unfused(mod, x, z, w, norm_before_gate, *, eps):
    """Our plain rms_norm and torch's silu and products, as a model without a gated kernel writes it: groups
    as a ``(..., G, S)`` view normalized without a weight, then the weight."""
    g = group_size(x.shape[-1])
    s = torch.nn.functional.silu(z)
    h = x if norm_before_gate else (x * s).to(x.dtype)
    if g is None:
        y = mod.rms_norm(h, w, eps, casting_mode="llama")
    else:
        y = mod.rms_norm(h.unflatten(-1, (-1, g)), None, eps, casting_mode="llama").flatten(-2) * w
    return (y * s).to(x.dtype) if norm_before_gate else y


# --------------------------------------------------------------------------------------------------------------
# Check against float64
# --------------------------------------------------------------------------------------------------------------


def errors(x, z, w, dy, outputs: dict, norm_before_gate: bool, eps: float, chunk_elems: int = 1 << 25) -> dict:
    """Relative errors of y, dx, dz, dw (those in ``outputs``) against the float64 math, in row chunks."""
    from tilegym_rms import reference

    g = group_size(x.shape[-1])
    rows = max(1, chunk_elems // max(x.shape[-1], 1))
    sums = {name: [0.0, 0.0] for name in outputs}  # squared error, squared reference
    dw = torch.zeros(x.shape[-1], dtype=torch.float64, device=x.device)
    for start in range(0, x.shape[0], rows):
        part = slice(start, start + rows)
        xd, zd, wd = x[part].double(), z[part].double(), w.double()
        y, rstd = reference.gated_rms_norm_forward(xd, zd, wd, eps, g, norm_before_gate, 0.0, "gemma")
        want = {"y": y}
        if dy is not None:
            dx, dz, dw_part = reference.gated_rms_norm_backward(xd, zd, dy[part].double(), wd, rstd, g,
                                                                norm_before_gate)  # fmt: skip
            want |= {"dx": dx, "dz": dz}
            dw += dw_part
        for name in sums.keys() - {"dw"}:
            sums[name][0] += (outputs[name][part].double() - want[name]).square().sum().item()
            sums[name][1] += want[name].square().sum().item()
    if "dw" in outputs:
        sums["dw"] = [(outputs["dw"].double() - dw).square().sum().item(), dw.square().sum().item()]
    return {name: (err / ref) ** 0.5 if ref > 0 else err**0.5 for name, (err, ref) in sums.items()}
