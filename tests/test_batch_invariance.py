"""Batch invariance: a row's results do not depend on the other rows of the call, nor on how many there are.

:func:`assert_rows_invariant` embeds a few probe rows among other rows in batches of several sizes M and
asserts that each probe row's outputs are, bit for bit, those of the row alone (M = 1); whole-batch outputs
(``dw``, a sum over the rows) must only be deterministic. The ops below (:func:`forward_op`, ...) call the
public functions. This module runs them on the torch backend (CPU); test_batch_invariance_gpu.py on the
kernel backends at every M bucket their launch configurations and tuning tables tell apart;
test_triton_interpreter.py on the Triton kernels under the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import tilegym_rms
from tilegym_rms import reference

PROBES = 16  # probe rows per check: a sum taken in another order changes only some rows' bits
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class RowOp:
    """A call under test: ``run(batch)`` takes the ``inputs`` (dim 0: the batch's rows) and returns
    ``(rows, totals)``: outputs whose dim 0 indexes the rows, and whole-batch outputs such as ``dw``."""

    inputs: tuple[str, ...]
    run: Callable


def probe_slots(m: int) -> list[int]:
    """The rows of a batch of ``m`` that hold probes 0, 1, ...: spread from the first row to the last (a
    partial last row tile included); the first ``m`` probes where the batch has fewer rows than probes."""
    if m < PROBES:
        return list(range(m))
    return [i * (m - 1) // (PROBES - 1) for i in range(PROBES)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bits as integers: -0.0 and 0.0 differ there, and a NaN equals itself."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None where ``got`` has ``want``'s bits, else how they differ."""
    changed = _bits(got) != _bits(want)
    if not changed.any():
        return None
    largest = (got.double() - want.double()).abs().max().item()
    return f"{int(changed.sum())} of {want.numel()} values differ (largest by {largest:.3g})"


def assert_rows_invariant(op: RowOp, probes: dict[str, torch.Tensor], ms, *, describe=None, seed: int = 0) -> None:
    """Asserts that each probe row's outputs are the same bits in a batch of every M of ``ms`` as alone,
    and that ``op``'s whole-batch outputs are the same bits when it runs twice on one batch.

    ``probes`` maps each of ``op.inputs`` to a tensor whose dim 0 holds the :data:`PROBES` probe rows. The
    other rows of a batch are random, drawn once for the largest M: each batch is a prefix of them with the
    probes copied into :func:`probe_slots`. ``describe(m)`` names the launch at M in the failure message."""
    device = probes[op.inputs[0]].device
    gen = torch.Generator(device=device).manual_seed(seed)
    others = {}
    for name in op.inputs:
        p = probes[name]
        others[name] = torch.randn((max(ms), *p.shape[1:]), generator=gen, device=device, dtype=p.dtype)

    def batch(m, slots):
        views = {name: t[:m] for name, t in others.items()}
        for name, t in views.items():
            t[slots] = probes[name][: len(slots)]
        return views

    alone = {}
    for probe in range(PROBES):  # each probe as a batch of one row
        views = {name: t[:1] for name, t in others.items()}
        for name, t in views.items():
            t[0] = probes[name][probe]
        for name, out in op.run(views)[0].items():
            alone.setdefault(name, []).append(out[0].clone())
    alone = {name: torch.stack(rows) for name, rows in alone.items()}
    failures = []
    for m in sorted(set(ms)):
        slots = probe_slots(m)
        rows, totals = op.run(batch(m, slots))
        for name, out in rows.items():
            got, want = out[slots], alone[name][: len(slots)]
            if _difference(got, want) is None:
                continue
            found = [(p, r, _difference(got[p], want[p])) for p, r in enumerate(slots)]
            where = f"; launch at M={m}: {describe(m)}; alone: {describe(1)}" if describe else ""
            failures.append(
                f"{name} at M={m}: " + ", ".join(f"probe {p} (row {r}): {d}" for p, r, d in found if d) + where
            )
        del rows
        if totals:
            _, again = op.run(batch(m, slots))
            for name, total in totals.items():
                d = _difference(again[name], total)
                if d:
                    failures.append(f"{name} at M={m} is not deterministic: a second call gave {d}")
    if failures:
        pytest.fail("a row's result depends on its batch:\n" + "\n".join(failures), pytrace=False)


# ------------------------------------------------------------------------------------------------
# The calls under test and their probe rows
# ------------------------------------------------------------------------------------------------


def _leaf(t):
    return None if t is None else t.detach().requires_grad_()


def forward_op(weight, **kw) -> RowOp:
    """``y`` and ``rstd`` of ``rms_norm_forward``, and ``y`` of ``rms_norm`` without autograd (inference)."""

    def run(b):
        y, rstd = tilegym_rms.rms_norm_forward(b["x"], weight, **kw)
        with torch.no_grad():
            y_inference = tilegym_rms.rms_norm(b["x"], weight, **kw)
        return {"y": y, "rstd": rstd, "y (inference)": y_inference}, {}

    return RowOp(("x",), run)


def backward_op(weight, **kw) -> RowOp:
    """``dx`` of ``rms_norm_backward`` (given each row's rstd); ``dw`` must be deterministic."""

    def run(b):
        dx, dw = tilegym_rms.rms_norm_backward(b["x"], b["dy"], weight, b["rstd"], **kw)
        return {"dx": dx}, ({} if dw is None else {"dw": dw})

    return RowOp(("x", "dy", "rstd"), run)


def fused_add_op(weight, mode="pre", **kw) -> RowOp:
    """``fused_add_rms_norm``'s outputs and, through autograd, the gradients of ``x`` and ``residual``."""

    def run(b):
        x, residual, w = _leaf(b["x"]), _leaf(b["residual"]), _leaf(weight)
        y, res_out = tilegym_rms.fused_add_rms_norm(x, residual, w, mode=mode, **kw)
        outs, grads = ((y, res_out), (b["dy"], b["dres"])) if mode == "pre" else ((y,), (b["dy"],))
        leaves = (x, residual) if w is None else (x, residual, w)
        g = torch.autograd.grad(outs, leaves, grads)
        rows = {"y": y.detach(), "dx": g[0], "dresidual": g[1]}
        if mode == "pre":
            rows["residual_out"] = res_out.detach()
        return rows, ({} if w is None else {"dw": g[2]})

    return RowOp(("x", "residual", "dy", "dres") if mode == "pre" else ("x", "residual", "dy"), run)


def in_place_op(weight, **kw) -> RowOp:
    """``fused_add_rms_norm_``: ``y`` and the sum it writes over ``residual``."""

    def run(b):
        with torch.no_grad():
            y = tilegym_rms.fused_add_rms_norm_(b["x"], b["residual"], weight, **kw)
        return {"y": y, "residual (in place)": b["residual"]}, {}

    return RowOp(("x", "residual"), run)


def qk_op(q_weight, k_weight, heads: tuple[int, int], layout: str = "qkv_slice", **kw) -> RowOp:
    """``qk_rms_norm`` with its gradients on ``(B, S, H, D)`` tensors, B x S = M tokens (B 2 for even M, else
    1): a row of the batch is one token, its heads of q and k (``heads``). ``layout`` "qkv_slice": q and k are
    slices of one qkv projection output (each a ``(tokens, heads, D)`` view, tiled along the heads where there
    are fewer tokens than heads), "contiguous": copies of them. ``dw`` of each weight must be deterministic."""
    hq, hk = heads

    def run(b):
        m = b["qkv"].shape[0]
        lead = (2, m // 2) if m % 2 == 0 else (1, m)
        qkv = b["qkv"].view(*lead, *b["qkv"].shape[1:])
        q, k = qkv[:, :, :hq], qkv[:, :, hq : hq + hk]
        if layout == "contiguous":
            q, k = q.contiguous(), k.contiguous()
        q, k = _leaf(q), _leaf(k)
        ws = [_leaf(w) for w in (q_weight, k_weight)]
        yq, yk = tilegym_rms.qk_rms_norm(q, k, *ws, **kw)
        leaves = [q, k] + [w for w in ws if w is not None]
        g = torch.autograd.grad((yq, yk), leaves, (b["dq_out"].view(yq.shape), b["dk_out"].view(yk.shape)))
        rows = {"q_out": yq.detach(), "k_out": yk.detach(), "dq": g[0], "dk": g[1]}
        names = [n for n, w in (("dq_weight", q_weight), ("dk_weight", k_weight)) if w is not None]
        return {n: t.flatten(0, 1) for n, t in rows.items()}, dict(zip(names, g[2:], strict=True))

    return RowOp(("qkv", "dq_out", "dk_out"), run)


def row_probes(n: int, dtype, device="cpu", seed: int = 1) -> dict[str, torch.Tensor]:
    """Probe rows of width ``n`` for every input of the plain and fused ops; ``rstd`` is each x row's."""
    gen = torch.Generator(device=device).manual_seed(seed)
    probes = {k: torch.randn(PROBES, n, generator=gen, device=device, dtype=dtype) for k in ("x", "residual", "dy")}
    probes["dres"] = torch.randn(PROBES, n, generator=gen, device=device, dtype=dtype)
    probes["rstd"] = reference.rms_norm_forward(probes["x"], None)[1]  # fp32, fp64 for fp64
    return probes


def qk_probes(heads: tuple[int, int], d: int, dtype, device="cpu", seed: int = 1) -> dict[str, torch.Tensor]:
    """Probe tokens: a qkv projection output (q's heads, k's, as many for v) of head dim ``d``, and the
    gradients of q's and k's outputs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {"qkv": heads[0] + 2 * heads[1], "dq_out": heads[0], "dk_out": heads[1]}
    return {k: torch.randn(PROBES, h, d, generator=gen, device=device, dtype=dtype) for k, h in shapes.items()}


def weight_of(n: int, dtype, device="cpu", seed: int = 2) -> torch.Tensor:
    """A weight far from ones, so that it takes part in every product."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, generator=gen, device=device, dtype=dtype)


def plain_ops(weight, **kw) -> dict[str, RowOp]:
    """Every row op of the plain and fused norm, by name."""
    return {
        "forward": forward_op(weight, **kw),
        "backward": backward_op(weight, **kw),
        "fused_add": fused_add_op(weight, **kw),
        "fused_add_post": fused_add_op(weight, mode="post", **kw),
        "in_place": in_place_op(weight, **kw),
    }


# ------------------------------------------------------------------------------------------------
# The torch backend
# ------------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# torch reduces a batch of fewer than 32768 elements in one loop, a larger one with its rows shared among its
# threads: both occur from N = 1000 on. Rows of 32768 or more elements are left out: torch may then split a
# row's sums among its threads, which the mode does not prevent (README, "Batch invariance").
MS = [1, 2, 3, 5, 8, 17, 64]
WIDTHS = [1, 7, 123, 1000, 4096]


@pytest.mark.parametrize("op_name", ["forward", "backward", "fused_add", "fused_add_post", "in_place"])
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_backend_rows_are_batch_invariant(dtype, n, weight, op_name):
    w = weight_of(n, dtype) if weight else None
    with tilegym_rms.batch_invariant():
        assert_rows_invariant(plain_ops(w, backend="torch")[op_name], row_probes(n, dtype), MS)


@pytest.mark.parametrize("layout", ["qkv_slice", "contiguous"])
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_backend_qk_norm_tokens_are_batch_invariant(dtype, d, weight, layout):
    ws = (weight_of(d, dtype), weight_of(d, dtype, seed=3)) if weight else (None, None)
    heads = (4, 2)
    with tilegym_rms.batch_invariant():
        assert_rows_invariant(qk_op(*ws, heads, layout, backend="torch"), qk_probes(heads, d, dtype), MS)
