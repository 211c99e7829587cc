"""DTensor inputs on the CPU: two gloo ranks, eager and torch.compile, against the unsharded result.

One ``torchrun`` launch (this file run as a script) executes every case on both ranks and writes one
JSON record per rank; each pytest test below checks its case's record. One launch keeps the suite
fast (starting two processes that import torch costs several seconds), and a subprocess keeps the
process group, Dynamo's caches and a possible hang (bounded by a timeout) out of the pytest process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback

import pytest
import torch

EPS = 1e-6
WORLD = 2
LAUNCH_TIMEOUT_S = 240

# ------------------------------------------------------------------------------------------------
# The cases (run on each rank by the worker below)
# ------------------------------------------------------------------------------------------------

CASES: dict[str, object] = {}


def case(name):
    def add(fn):
        CASES[name] = fn
        return fn

    return add


def _data(shape, dtype=torch.float32, seed=0):
    """The same global tensors on every rank: x, weight, upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, dy


def _unsharded(fn, x, w, dy):
    """``(y, dx, dw)`` of ``fn`` on plain tensors: the result the sharded run must reproduce."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_() if w is not None else None
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, (w.grad if w is not None else None)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")


def _check_rms_norm(mesh, shape, placement, fn, *, weight=True, dtype=torch.float32, compiled=False):
    """Forward and backward of ``fn(x, weight)`` with ``x`` placed by ``placement`` and the weight
    replicated: y and dx keep x's sharding, dw is Partial(sum) until reduced; all match unsharded."""
    from torch.distributed.tensor import Partial, Replicate, distribute_tensor

    x, w, dy = _data(shape, dtype)
    w = w if weight else None
    ref_y, ref_dx, ref_dw = _unsharded(lambda a, b: _rms_norm(a, b), x, w, dy)

    xd = distribute_tensor(x, mesh, [placement]).requires_grad_()
    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_() if weight else None
    y = fn(xd, wd)
    y.backward(distribute_tensor(dy, mesh, list(y.placements)))
    assert tuple(y.placements) == (placement,), f"y placements {y.placements}, expected {placement}"
    dx_placements = {(placement,)}
    if compiled and _torch_older_than(2, 13):
        # torch 2.11's compiled backward, once recompiled with dynamic shapes for an unevenly sharded
        # dim, hands dx back replicated (one all-gather; values exact): F.rms_norm does the same there.
        dx_placements.add((Replicate(),))
    assert tuple(xd.grad.placements) in dx_placements, f"dx placements {xd.grad.placements}"
    _close(y.full_tensor(), ref_y, "y")
    _close(xd.grad.full_tensor(), ref_dx, "dx")
    if weight:
        # A replicated weight's gradient sums every rank's rows: DTensor keeps it Partial(sum) (as
        # for torch's own norms) until something reduces it, an all-reduce to Replicate here.
        assert tuple(wd.grad.placements) == (Partial(),), f"dw placements {wd.grad.placements}"
        dw = wd.grad.redistribute(placements=[Replicate()])
        assert tuple(dw.placements) == (Replicate(),)
        if dtype == torch.float32:
            _close(dw.to_local(), ref_dw, "dw")
        else:
            # Each rank rounds its partial sum to the weight's dtype and the all-reduce adds those
            # roundings (one rounding unsharded): allow a couple of ulps of the largest partial.
            atol = 2 * torch.finfo(dtype).eps * ref_dw.abs().max().item()
            torch.testing.assert_close(dw.to_local(), ref_dw, atol=atol, rtol=0, msg=lambda m: f"dw: {m}")


def _torch_older_than(major, minor) -> bool:
    return tuple(int(v) for v in torch.__version__.split(".")[:2]) < (major, minor)


def _rms_norm(x, w):
    import tilegym_rms

    return tilegym_rms.rms_norm(x, w, EPS)


def _compiled(fn, backend):
    return torch.compile(fn, fullgraph=True, backend=backend)


@case("compile-first-call-registers-rules")  # the worker's first case: nothing registered before it
def _(mesh):
    """A compiled call that is the first to meet a DTensor registers the sharding rules while Dynamo
    traces it (without them the trace fails on the custom op)."""
    from torch.distributed.tensor import Shard

    from tilegym_rms.integrations import dtensor

    assert dtensor._registered is None, "the rules were registered before the first call"
    _check_rms_norm(mesh, (4, 6, 32), Shard(0), _compiled(lambda a, b: _rms_norm(a, b), "aot_eager"), compiled=True)
    assert dtensor._registered is True


# Shapes: 2-D (tokens, hidden) and 3-D (batch, sequence, hidden); uneven row counts across ranks too.
ROW_SHARDINGS = {
    "2d-shard0": ((6, 32), 0),
    "2d-shard0-uneven": ((5, 32), 0),
    "3d-shard0": ((4, 6, 32), 0),
    "3d-shard1": ((2, 7, 32), 1),
}


def _have_cxx() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def _add_rms_norm_cases():
    for label, (shape, dim) in ROW_SHARDINGS.items():

        def run(mesh, shape=shape, dim=dim):
            from torch.distributed.tensor import Shard

            _check_rms_norm(mesh, shape, Shard(dim), _rms_norm)

        CASES[f"eager-{label}"] = run

    for backend in ("aot_eager", "inductor"):
        for label in ("2d-shard0", "3d-shard1"):
            shape, dim = ROW_SHARDINGS[label]

            def run(mesh, shape=shape, dim=dim, backend=backend):
                from torch.distributed.tensor import Shard

                if backend == "inductor" and not _have_cxx():
                    return "skip: Inductor on the CPU needs a C++ compiler"
                _check_rms_norm(mesh, shape, Shard(dim), _compiled(_rms_norm, backend), compiled=True)

            CASES[f"compile-{backend}-{label}"] = run


_add_rms_norm_cases()


@case("eager-no-weight")
def _(mesh):
    from torch.distributed.tensor import Shard

    _check_rms_norm(mesh, (4, 6, 32), Shard(1), _rms_norm, weight=False)


@case("eager-bf16")
def _(mesh):
    from torch.distributed.tensor import Shard

    _check_rms_norm(mesh, (4, 6, 32), Shard(0), _rms_norm, dtype=torch.bfloat16)


@case("no-gather-of-x")
def _(mesh):
    """Forward and backward with row-sharded x run no collective at all: x is never gathered and
    dw leaves as Partial(sum); reducing that dw is one all-reduce (of N values, not of x)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    x, w, dy = _data((4, 6, 32))
    xd = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    dyd = distribute_tensor(dy, mesh, [Shard(1)])
    with CommDebugMode() as comm:
        _rms_norm(xd, wd).backward(dyd)
    assert comm.get_total_counts() == 0, f"collectives in forward/backward: {comm.get_comm_counts()}"
    with CommDebugMode() as comm:
        wd.grad.redistribute(placements=[Replicate()])
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert comm.get_total_counts() == 1 and any("all_reduce" in op for op in counts), counts


@case("last-dim-sharded-redistributes")
def _(mesh):
    """x sharded on the normalized dim has no local rule: DTensor redistributes it (an all-gather)
    before the op, and the result is exact and replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    x, w, dy = _data((4, 6, 32))
    ref_y, ref_dx, ref_dw = _unsharded(_rms_norm, x, w, dy)
    xd = distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    with CommDebugMode() as comm:
        y = _rms_norm(xd, wd)
    assert any("all_gather" in str(op) for op in comm.get_comm_counts()), comm.get_comm_counts()
    assert tuple(y.placements) == (Replicate(),), y.placements
    y.backward(distribute_tensor(dy, mesh, [Replicate()]))
    _close(y.full_tensor(), ref_y, "y")
    _close(xd.grad.full_tensor(), ref_dx, "dx")
    _close(wd.grad.full_tensor(), ref_dw, "dw")


@case("sharded-weight-redistributes")
def _(mesh):
    """A sharded weight is gathered by DTensor (it is N values); the result is exact."""
    from torch.distributed.tensor import Shard, distribute_tensor

    x, w, dy = _data((4, 6, 32))
    ref_y, ref_dx, ref_dw = _unsharded(_rms_norm, x, w, dy)
    xd = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    y = _rms_norm(xd, wd)
    y.backward(distribute_tensor(dy, mesh, list(y.placements)))
    _close(y.full_tensor(), ref_y, "y")
    _close(xd.grad.full_tensor(), ref_dx, "dx")
    _close(wd.grad.full_tensor(), ref_dw, "dw")


@case("forward-backward-functions")
def _(mesh):
    """The standalone rms_norm_forward / rms_norm_backward take DTensors too (local shards)."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import tilegym_rms

    x, w, dy = _data((4, 6, 32))
    ref_y, ref_rstd = tilegym_rms.rms_norm_forward(x, w, EPS)
    ref_dx, ref_dw = tilegym_rms.rms_norm_backward(x, dy, w, ref_rstd)
    xd, wd = distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(w, mesh, [Replicate()])
    y, rstd = tilegym_rms.rms_norm_forward(xd, wd, EPS)
    assert tuple(y.placements) == (Shard(1),) and tuple(rstd.placements) == (Shard(1),)
    dx, dw = tilegym_rms.rms_norm_backward(xd, distribute_tensor(dy, mesh, [Shard(1)]), wd, rstd)
    assert tuple(dx.placements) == (Shard(1),) and tuple(dw.placements) == (Partial(),)
    _close(y.full_tensor(), ref_y, "y")
    _close(rstd.full_tensor(), ref_rstd, "rstd")
    _close(dx.full_tensor(), ref_dx, "dx")
    _close(dw.full_tensor(), ref_dw, "dw")
    dx, dw = tilegym_rms.rms_norm_backward(xd, distribute_tensor(dy, mesh, [Shard(1)]), None, rstd)
    assert dw is None


def _check_fused(mesh, mode, compile_backend=None):
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import tilegym_rms

    x, w, dy = _data((4, 6, 32))
    res = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    dres = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))

    def fn(a, r, weight):
        return tilegym_rms.fused_add_rms_norm(a, r, weight, EPS, mode=mode)

    def run(a, r, weight, wrap):
        y, r_out = (_compiled(fn, compile_backend) if compile_backend else fn)(a, r, weight)
        # "post": residual_out is y itself; its gradient is the only one taken, to keep y's single.
        grads = (wrap(dy), wrap(dres)) if mode == "pre" else (wrap(dy),)
        torch.autograd.backward((y, r_out) if mode == "pre" else (y,), grads)
        return y, r_out

    leaves = [t.clone().requires_grad_() for t in (x, res, w)]
    ref_y, ref_r = run(*leaves, lambda t: t)
    ref_grads = [t.grad for t in leaves]

    dleaves = [
        distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in ((x, Shard(1)), (res, Shard(1)), (w, Replicate()))
    ]
    y, r_out = run(*dleaves, lambda t: distribute_tensor(t, mesh, [Shard(1)]))
    assert tuple(y.placements) == (Shard(1),) and tuple(r_out.placements) == (Shard(1),)
    _close(y.full_tensor(), ref_y, "y")
    _close(r_out.full_tensor(), ref_r, "residual_out")
    for name, t, ref in zip(("dx", "dresidual", "dw"), dleaves, ref_grads, strict=True):
        expected = (Partial(),) if name == "dw" else (Shard(1),)
        assert tuple(t.grad.placements) == expected, f"{name} placements {t.grad.placements}"
        _close(t.grad.full_tensor(), ref, name)


@case("fused-eager-pre")
def _(mesh):
    _check_fused(mesh, "pre")


@case("fused-eager-post")
def _(mesh):
    _check_fused(mesh, "post")


@case("fused-compile-aot_eager-pre")
def _(mesh):
    _check_fused(mesh, "pre", "aot_eager")


@case("fused-compile-aot_eager-post")
def _(mesh):
    _check_fused(mesh, "post", "aot_eager")


def _check_gated(mesh, compile_backend=None, activation="silu"):
    """gated_rms_norm on x and a gate sharded on the sequence dim: y, dx and dz keep the sharding, dw is
    Partial(sum); all match the unsharded call."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import tilegym_rms

    x, w, dy = _data((4, 6, 32))
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))

    def fn(a, g, weight):
        return tilegym_rms.gated_rms_norm(
            a, g, weight, EPS, group_size=8, norm_before_gate=False, activation=activation
        )

    run = _compiled(fn, compile_backend) if compile_backend else fn
    leaves = [t.clone().requires_grad_() for t in (x, z, w)]
    fn(*leaves).backward(dy)
    ref_y = fn(*leaves).detach()
    dleaves = [
        distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in ((x, Shard(1)), (z, Shard(1)), (w, Replicate()))
    ]
    y = run(*dleaves)
    y.backward(distribute_tensor(dy, mesh, [Shard(1)]))
    assert tuple(y.placements) == (Shard(1),)
    _close(y.full_tensor(), ref_y, "y")
    for name, t, ref in zip(("dx", "dz", "dw"), dleaves, leaves, strict=True):
        expected = (Partial(),) if name == "dw" else (Shard(1),)
        assert tuple(t.grad.placements) == expected, f"{name} placements {t.grad.placements}"
        _close(t.grad.full_tensor(), ref.grad, name)


@case("gated-eager")
def _(mesh):
    _check_gated(mesh)


@case("gated-compile-aot_eager")
def _(mesh):
    _check_gated(mesh, "aot_eager")


@case("gated-sigmoid-compile-aot_eager")
def _(mesh):
    _check_gated(mesh, "aot_eager", "sigmoid")


@case("module-sequence-parallel")
def _(mesh):
    """tilegym_rms.RMSNorm under parallelize_module(SequenceParallel()), as torchtitan wires norms."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    import tilegym_rms

    x, w, dy = _data((2, 8, 32))
    ref = tilegym_rms.RMSNorm(32, eps=EPS)
    with torch.no_grad():
        ref.weight.copy_(w)
    ref_y, ref_dx, ref_dw = _unsharded(lambda a, _: ref(a), x, None, dy)
    ref_dw = ref.weight.grad

    norm = tilegym_rms.RMSNorm(32, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(w)  # before parallelize_module, which makes the weight a replicated DTensor
    norm = parallelize_module(norm, mesh, SequenceParallel())
    rank, rows = torch.distributed.get_rank(), x.shape[1] // WORLD
    local = x[:, rank * rows : (rank + 1) * rows].clone().requires_grad_()
    y = norm(local)  # SequenceParallel reads a local shard of the sequence dim
    assert tuple(y.placements) == (Shard(1),), y.placements
    y.to_local().backward(dy[:, rank * rows : (rank + 1) * rows])
    _close(y.full_tensor(), ref_y, "y")
    _close(local.grad, ref_dx[:, rank * rows : (rank + 1) * rows], "dx")
    _close(norm.weight.grad.redistribute(placements=[Replicate()]).to_local(), ref_dw, "dw")


# ------------------------------------------------------------------------------------------------
# The worker (this file under torchrun) and the launch
# ------------------------------------------------------------------------------------------------


def _worker(out_dir: str, names: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            outcome = CASES[name](mesh) or "ok"
        except Exception:
            outcome = "FAIL\n" + traceback.format_exc()
        results[name] = {"outcome": outcome, "seconds": round(time.perf_counter() - start, 3)}
        # Keep the ranks in step: a case that failed on one rank must not leave the other in a collective.
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _launch(out_dir, names):
    """Runs the worker on ``WORLD`` gloo ranks; returns (per-rank results, log, seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TILEGYM_RMS_BACKEND", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a rendezvous on a free local port: no fixed port to collide on
        f"--nproc_per_node={WORLD}",
        __file__,
        out_dir,
        *names,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    results = []
    for rank in range(WORLD):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
    return proc.returncode, results, log, time.perf_counter() - start


def _distributed_ok() -> tuple[bool, str]:
    if not torch.distributed.is_available():
        return False, "this torch build has no torch.distributed"
    if not torch.distributed.is_gloo_available():
        return False, "this torch build has no gloo backend"
    return True, ""


@pytest.fixture(scope="module")
def dtensor_results(tmp_path_factory):
    ok, why = _distributed_ok()
    if not ok:
        pytest.skip(why)
    out_dir = str(tmp_path_factory.mktemp("dtensor"))
    rc, results, log, seconds = _launch(out_dir, list(CASES))
    if rc != 0 or len(results) != WORLD:
        pytest.fail(f"torchrun exited {rc} after {seconds:.1f}s with {len(results)} rank results:\n{log[-6000:]}")
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_dtensor(dtensor_results, name):
    for rank, results in enumerate(dtensor_results):
        outcome = results[name]["outcome"]
        if outcome.startswith("skip"):
            pytest.skip(outcome)
        assert outcome == "ok", f"rank {rank}: {outcome}"


def test_register_is_idempotent_without_a_process_group():
    """register() needs no process group and may run any number of times."""
    from tilegym_rms.integrations import dtensor

    ok, why = _distributed_ok()
    if not ok:
        pytest.skip(why)
    assert dtensor.register() is True
    assert dtensor.register() is True
    assert not dtensor.is_dtensor(torch.ones(2))


# ------------------------------------------------------------------------------------------------
# Each op's sharding rule against the op's signature (no process group)
# ------------------------------------------------------------------------------------------------


def _declared_rules():
    import tilegym_rms  # noqa: F401  (the op modules declare their rules on import)
    from tilegym_rms.integrations import dtensor

    return {op._opoverload._schema.name: (op._opoverload._schema, rule) for op, rule in dtensor._RULES}


def _arguments(schema):
    """Arguments for ``schema``: 3-D tensors, one string for every str (a mode of "pre"), zeros, None."""
    x = torch.empty(2, 3, 8, device="meta")
    kinds = {"Tensor": x, "Optional[Tensor]": x, "str": "pre", "float": 0.0, "Optional[str]": None,
             "Optional[int]": None, "bool": True}  # fmt: skip
    return [kinds[str(a.type)] for a in schema.arguments]


def _with_argument(schema, declaration):
    """A copy of ``schema`` with ``declaration`` (``"Tensor bias"``) as its first argument."""
    text = str(schema)
    return torch._C.parse_schema(text.replace("(", f"({declaration}, ", 1))


@pytest.mark.parametrize(
    "op",
    ["rms_norm_fwd", "rms_norm_bwd", "fused_add_rms_norm_fwd", "fused_add_rms_norm_bwd", "gated_rms_norm_fwd",
     "gated_rms_norm_bwd"],
)  # fmt: skip
def test_sharding_rule_places_its_ops_arguments_by_the_ops_schema(op):
    """DTensor reads a rule's input placements by argument position: each must land on a tensor argument,
    follow the schema when an argument is added, and raise when the rule misses a tensor argument."""
    ok, why = _distributed_ok()
    if not ok:
        pytest.skip(why)
    from torch.distributed.tensor import Replicate, Shard

    from tilegym_rms.integrations import dtensor

    schema, rule = _declared_rules()[f"tilegym_rms::{op}"]
    args = _arguments(schema)
    strategies = dtensor.by_position(schema, rule)(*args)
    tensor_positions = [i for i, a in enumerate(schema.arguments) if "Tensor" in str(a.type)]
    # Replicated, or sharded on each of the two row dims of the 3-D x, never on the normalized dim.
    assert [inputs[0] for _, inputs in strategies] == [Replicate(), Shard(0), Shard(1)]
    for outputs, inputs in strategies:
        assert len(outputs) == len(schema.returns)
        assert [i for i, p in enumerate(inputs) if p is not None] == tensor_positions

    # A new non-tensor argument ahead of the others: every placement moves with its argument.
    scaled = _with_argument(schema, "float scale")
    moved = dtensor.by_position(scaled, rule)(0.5, *args)
    assert moved == [(outputs, [None, *inputs]) for outputs, inputs in strategies]

    # A new tensor argument the rule does not place: an error, never a placement on the wrong tensor.
    biased = _with_argument(schema, "Tensor bias")
    with pytest.raises(ValueError, match=r"takes the tensors \['bias'"):
        dtensor.by_position(biased, rule)(args[0], *args)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
