"""Bytes and statistics: the minimal traffic of each op, how many input sets push it out of L2, percentiles
and GB/s. Plain arithmetic, no device."""

from __future__ import annotations

import math

from bench.common import base, gated


def forward_bytes(m: int, n: int, elt: int, w_elt: int | None = None) -> int:
    """Minimal forward traffic: read x and w, write y."""
    w_elt = elt if w_elt is None else w_elt
    return 2 * m * n * elt + n * w_elt


def backward_bytes(m: int, n: int, elt: int, w_elt: int | None = None) -> int:
    """Minimal backward traffic: read x, dy (M*N), w (N), rstd (M fp32); write dx (M*N), dw (N)."""
    w_elt = elt if w_elt is None else w_elt
    return 3 * m * n * elt + 2 * n * w_elt + 4 * m


def full_bytes(m: int, n: int, elt: int, w_elt: int | None = None) -> int:
    """Forward (plus writing rstd, M fp32) followed by backward."""
    return forward_bytes(m, n, elt, w_elt) + 4 * m + backward_bytes(m, n, elt, w_elt)


def fused_add_forward_bytes(m: int, n: int, elt: int, w_elt: int | None = None) -> int:
    """Minimal fused residual-add + RMSNorm forward traffic (mode "pre"): read x, residual (M*N each) and w (N);
    write y, residual_out = x + residual (M*N each) and rstd (M fp32)."""
    w_elt = elt if w_elt is None else w_elt
    return (2 + 2) * m * n * elt + n * w_elt + 4 * m


def fused_add_backward_bytes(m: int, n: int, elt: int, w_elt: int | None = None) -> int:
    """Minimal fused residual-add + RMSNorm backward traffic (mode "pre"): read dy, d_residual_out, the saved sum s
    (M*N each), w (N), rstd (M fp32); write ds (M*N; dx and dresidual are both ds) and dw (N)."""
    w_elt = elt if w_elt is None else w_elt
    return (3 + 1) * m * n * elt + 2 * n * w_elt + 4 * m


FUSED_ADD_OPS = ("fused_add_fwd", "fused_add_bwd")
# QK-norm ops: each direction on three layouts of q and k (op suffix -> layout; providers.InputSets builds them):
# separate q_proj / k_proj outputs viewed (tokens, heads, D); their .transpose(1, 2) to (B, H, S, D), whose
# gradient is a contiguous (B, H, S, D) tensor; the q and k slices of one fused qkv projection viewed (B, S, H,
# D), whose gradient is what autograd hands back from a .transpose(1, 2) consumer (a (B, H, S, D) tensor
# transposed). The minimal traffic is the same in every layout.
QK_LAYOUTS = {"": "separate", "_transposed": "transposed", "_qkv": "qkv"}
QK_OPS = tuple(f"qk_{direction}{suffix}" for suffix in QK_LAYOUTS for direction in ("fwd", "bwd"))


def qk_op_parts(op: str) -> tuple[str, str]:
    """``(direction, layout)`` of a QK-norm op: ``"fwd"`` or ``"bwd"``, and a value of :data:`QK_LAYOUTS`."""
    direction, suffix = op[3:6], op[6:]
    return direction, QK_LAYOUTS[suffix]


def qk_rows(m: int) -> tuple[int, int]:
    """Rows of q and of k when q has ``m`` rows (k has fewer heads: GQA)."""
    hq, hk = base.QK_HEADS
    return m, m // hq * hk


def qk_forward_bytes(m: int, n: int, elt: int) -> int:
    """Minimal QK-norm forward traffic: the forward of q and of k, each with its weight."""
    return sum(forward_bytes(rows, n, elt) for rows in qk_rows(m))


def qk_backward_bytes(m: int, n: int, elt: int) -> int:
    """Minimal QK-norm backward traffic: the backward of q and of k (x, dy, w, rstd read; dx, dw written)."""
    return sum(backward_bytes(rows, n, elt) for rows in qk_rows(m))


# FP8-output ops (tilegym_rms.rms_norm_fp8, fused_add_rms_norm_fp8), e4m3fn: op -> (scales, fused add); scales
# "token" (one fp32 per row), "group" (one per FP8_GROUP_SIZE columns of a row) or "static" (one, read).
FP8_GROUP_SIZE = 128
FP8_OPS = {
    "fp8_token": ("token", False),
    "fp8_group": ("group", False),
    "fp8_static": ("static", False),
    "fp8_add_token": ("token", True),
}


def fp8_scale_count(op: str, m: int, n: int) -> int:
    """fp32 scales one call of an FP8 op moves: written per row or per group, or the static one read."""
    scales = FP8_OPS[op][0]
    if scales == "static":
        return 1
    return m * (1 if scales == "token" else -(-n // FP8_GROUP_SIZE))


def fp8_bytes(op: str, m: int, n: int, elt: int) -> int:
    """Minimal FP8-output traffic: read x (and the residual) and w; write y_q (1 byte per element), the scales
    and, with the fused add, the sum over the residual."""
    add = FP8_OPS[op][1]
    return (1 + 2 * add) * m * n * elt + m * n + n * elt + 4 * fp8_scale_count(op, m, n)


def op_bytes(op: str, m: int, n: int, elt: int) -> int:
    if op in FP8_OPS:
        return fp8_bytes(op, m, n, elt)
    if op in gated.OPS:
        return gated.op_bytes(op, m, n, elt)
    if op in QK_OPS:
        return (qk_forward_bytes if qk_op_parts(op)[0] == "fwd" else qk_backward_bytes)(m, n, elt)
    if op == "fused_add_fwd":
        return fused_add_forward_bytes(m, n, elt)
    if op == "fused_add_bwd":
        return fused_add_backward_bytes(m, n, elt)
    if op == "forward":
        return forward_bytes(m, n, elt)
    if op in ("backward", "standalone", "autograd"):
        return backward_bytes(m, n, elt)
    if op == "full":
        return full_bytes(m, n, elt)
    raise ValueError(op)


def read_bytes(op: str, m: int, n: int, elt: int) -> int:
    """Bytes one call reads from its input set (what the rotation has to push out of L2)."""
    if op in FP8_OPS:
        return (1 + FP8_OPS[op][1]) * m * n * elt + n * elt
    if op in gated.OPS:
        return gated.read_bytes(op, m, n, elt)
    if op in QK_OPS:
        plain = "forward" if qk_op_parts(op)[0] == "fwd" else "backward"
        return sum(read_bytes(plain, rows, n, elt) for rows in qk_rows(m))
    if op == "fused_add_fwd":
        return 2 * m * n * elt + n * elt
    if op == "fused_add_bwd":
        return 3 * m * n * elt + n * elt + 4 * m
    if op == "forward":
        return m * n * elt + n * elt
    if op in ("backward", "standalone", "autograd"):
        return 2 * m * n * elt + n * elt + 4 * m
    if op == "full":
        return 2 * m * n * elt + n * elt
    raise ValueError(op)


def workspace_share(minimal: int, workspace: int) -> float:
    """Share of the traffic that the dw partial buffer adds: it is written once and read once."""
    extra = 2 * workspace
    total = minimal + extra
    return extra / total if total else 0.0


def rotation_sets(
    set_bytes: int, l2_bytes: int, factor: int = base.L2_FACTOR, cap: int = base.MAX_SETS
) -> tuple[int, bool]:
    """Number of input sets so that their total exceeds factor x L2; and whether ``cap`` cut it short."""
    need = factor * l2_bytes // max(1, set_bytes) + 1
    return (min(need, cap), need > cap)


def calls_per_pass(n_sets: int, minimum: int = base.MIN_CALLS_PER_PASS) -> int:
    """Calls in one repetition: whole passes over the sets, at least ``minimum`` calls."""
    return n_sets * max(1, math.ceil(minimum / n_sets))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values: list[float]) -> tuple[float, float, float]:
    """(median, 20th percentile, 80th percentile)."""
    return percentile(values, 50), percentile(values, 20), percentile(values, 80)


def gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9 if us > 0 else float("nan")
