"""Where the host time of one eager call goes (GPU machine): per-step microseconds and a cProfile.

Latency at small M is host time: the kernels take a few microseconds, the Python around them more.
This script times, per call and back to back (one sync per batch), the pieces of an eager call, from a
bare ``ct.launch`` with prepared arguments up to a full forward + ``torch.autograd.grad``, next to torch,
then prints the top functions of a cProfile of the forward+backward loop.

    python -m bench.tools.host_profile --m 64 --n 4096 --dtype bf16
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from bench.common import base, cli_args, timing, traffic


def per_call_us(fn, device: torch.device, calls: int, reps: int = 5) -> float:
    """Median over ``reps`` batches of wall microseconds per call (``calls`` calls, then one sync)."""
    for _ in range(20):
        fn()
    return traffic.summarize(timing.wall_latency_us(fn, device, calls, reps))[0]


class _Inputs:
    """x, w and dy of one (M, N) call, and grad-requiring copies of x and w for forward + grad timings."""

    def __init__(self, m: int, n: int, dtype: torch.dtype, device: torch.device):
        self.x = torch.randn(m, n, dtype=dtype, device=device)
        self.w = torch.randn(n, dtype=dtype, device=device)
        self.dy = torch.randn_like(self.x)
        self.xg, self.wg = self.x.clone().requires_grad_(), self.w.clone().requires_grad_()

    def fwd_bwd(self, fn):
        """A call of ``fn(xg, wg)`` followed by ``torch.autograd.grad`` of its output."""
        return lambda: torch.autograd.grad(fn(self.xg, self.wg), (self.xg, self.wg), self.dy)


def steps(m: int, n: int, dtype: torch.dtype, device: torch.device):
    """``(name, zero-argument callable)`` for each piece of an eager call, cheapest first."""
    import cuda.tile as ct
    import torch.nn.functional as F

    import tilegym_rms

    inputs = _Inputs(m, n, dtype, device)
    x, w, dy, xg, fwd_bwd = inputs.x, inputs.w, inputs.dy, inputs.xg, inputs.fwd_bwd
    y, rstd = tilegym_rms.rms_norm_forward(x, w)
    stream_obj = torch.cuda.current_stream(device)
    stream, grid, kernel, args, _, _ = _prepared_forward(x, w)
    detached_grad_args = (xg.detach(),) + args[1:]

    return [
        ("torch.empty (M, N)", lambda: torch.empty((m, n), dtype=dtype, device=device)),
        ("x.new_empty((M, N))", lambda: x.new_empty((m, n))),
        ("torch.empty_like(x)", lambda: torch.empty_like(x)),
        ("x.new_empty((M,), dtype=float32)", lambda: x.new_empty((m,), dtype=torch.float32)),
        ("torch.empty((M,), float32, device)", lambda: torch.empty((m,), dtype=torch.float32, device=device)),
        ("torch.empty(M, float32, device): size as an int", lambda: torch.empty(m, dtype=torch.float32, device=device)),
        ("raw stream lookup", lambda: torch._C._cuda_getCurrentRawStream(device.index)),
        ("ct.launch fwd, raw stream, prepared args", lambda: ct.launch(stream, grid, kernel, args)),
        ("ct.launch fwd, stream object", lambda: ct.launch(stream_obj, grid, kernel, args)),
        ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(device)),
        ("ct.launch fwd, x = a detached leaf", lambda: ct.launch(stream, grid, kernel, detached_grad_args)),
        ("x.detach()", lambda: xg.detach()),
        ("tilegym_rms.cutile.forward (host module)", lambda: _cutile().forward(x, w, 1e-6, 0.0, "llama")),
        ("rms_norm, no grad", lambda: _no_grad(tilegym_rms.rms_norm, x, w)),
        ("F.rms_norm, no grad", lambda: _no_grad(F.rms_norm, x, (n,), w, 1e-6)),
        ("rms_norm_backward (standalone)", lambda: tilegym_rms.rms_norm_backward(x, dy, w, rstd)),
        ("tilegym_rms.cutile.backward (host module)", lambda: _cutile().backward(x, dy, w, rstd, 0.0, "llama")),
        ("F.rms_norm forward + autograd.grad", fwd_bwd(lambda a, b: F.rms_norm(a, (n,), b, 1e-6))),
        ("floor: Python Function (empty_like only) + grad", fwd_bwd(_EmptyFunction.apply)),
        ("custom-op path (torch.library autograd) + grad", fwd_bwd(_custom_op_forward)),
        ("floor + the host module's forward", fwd_bwd(_host_function(rstd, real_forward=True).apply)),
        ("floor + the host module's backward", fwd_bwd(_host_function(rstd, real_backward=True).apply)),
        ("floor + both (the work of rms_norm, without ops)", fwd_bwd(_host_function(rstd, True, True).apply)),
        ("rms_norm forward + autograd.grad", fwd_bwd(lambda a, b: tilegym_rms.rms_norm(a, b))),
    ]


def _prepared_forward(x, w):
    """``(raw stream, grid, hinted kernel, arguments, y, rstd)`` of the forward launch the host module makes
    for ``x`` (training forward: llama casting, rstd stored, no residual add), its arguments built by the host
    (``y`` and ``rstd`` the outputs among them), for timing ``ct.launch`` bare."""
    from tilegym_rms.cutile.host import forward

    m, n = x.shape
    dev = x.get_device()
    fl = forward.cached_launch(dev, m, n, x.dtype, None, "llama", True, True, forward.ADD_NONE)
    recorded = []  # the host's launch, recorded instead of made
    y, rstd = forward.start(fl, x, None, None, w, 1e-6, 0.0, dev, lambda *launch_args: recorded.append(launch_args))
    _, grid, args, _, _, built = recorded[0]
    return torch._C._cuda_getCurrentRawStream(dev), grid, built, args, y, rstd


class _EmptyFunction(torch.autograd.Function):
    """The least a Python autograd Function can do: allocate its outputs. Its forward + backward time is
    the floor of any kernel library that wires its kernels in through ``torch.autograd.Function``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


def _host_function(rstd, real_forward=False, real_backward=False):
    """The floor Function with the cuTile host module's forward and/or backward in place of its
    allocations: how much of the gap to the floor each half of the work adds, without ops' wiring."""

    class HostFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return (
                _cutile().forward(x.detach(), w.detach(), 1e-6, 0.0, "llama")[0]
                if real_forward
                else torch.empty_like(x)
            )

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.saved_tensors
            if real_backward:
                return _cutile().backward(x.detach(), dy, w.detach(), rstd, 0.0, "llama")
            return torch.empty_like(x), torch.empty_like(w)

    return HostFunction


def _custom_op_forward(x, w):
    """The eager call through the torch.compile path's custom op and its registered autograd."""
    from tilegym_rms.ops import WIRING, norm

    return norm._rms_norm_fwd_op(x, w, 1e-6, 0.0, "llama", "cutile", None, WIRING)[0]


class _TimedBackward(torch.autograd.Function):
    """A Function whose backward times ``work()`` where autograd runs it (the engine's device thread)."""

    work = staticmethod(lambda: None)
    seconds: list = []

    @staticmethod
    def forward(ctx, x, w):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        t0 = time.perf_counter()
        _TimedBackward.work()
        _TimedBackward.seconds.append(time.perf_counter() - t0)
        return None, None


def engine_thread_split(m, n, dtype, device, calls: int) -> list[tuple[str, float, float]]:
    """``(name, us on the calling thread, us inside a backward on autograd's thread)`` for pieces of the
    backward: whether the same Python and launches cost more where autograd runs them."""
    import cuda.tile as ct

    import tilegym_rms
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile.host import backward

    inputs = _Inputs(m, n, dtype, device)
    x, w, dy, xg = inputs.x, inputs.w, inputs.dy, inputs.xg
    _, rstd = tilegym_rms.rms_norm_forward(x, w)
    launches = backward.cached_launches(device.index, m, n, dtype, True, False)
    recorded = []  # the host's launches, recorded instead of made
    backward.start(launches, x, dy, None, w, rstd, 0.0, device.index, lambda *launch_args: recorded.append(launch_args))
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    pieces = [("torch.empty_like(x)", lambda: torch.empty_like(x))]
    if len(recorded) == 1:  # one launch (few rows): timed bare too
        _, grid, args, _, _, built = recorded[0]
        pieces.append(("ct.launch backward, prepared args", lambda: ct.launch(stream, grid, built, args)))
    pieces.append(("tilegym_rms.cutile.backward (host module)", lambda: cutile.backward(x, dy, w, rstd, 0.0, "llama")))
    rows = []
    for name, work in pieces:
        main = per_call_us(work, device, calls)
        _TimedBackward.work, _TimedBackward.seconds = staticmethod(work), []
        for _ in range(20 + calls):
            _TimedBackward.apply(xg, w).backward(dy)
        torch.cuda.synchronize(device)
        inside = sorted(_TimedBackward.seconds[20:])
        rows.append((name, main, inside[len(inside) // 2] * 1e6))
    return rows


def launch_then_grad(m, n, dtype, device, calls: int) -> list[tuple[str, float]]:
    """Whether a launch before ``autograd.grad`` makes the grad dearer than the launch itself: the floor
    Function's forward + grad after nothing, after a torch kernel and after a bare cuTile launch (the
    ablations above suggested a cuTile forward costs more inside autograd than alone)."""
    import threading

    import cuda.tile as ct

    inputs = _Inputs(m, n, dtype, device)
    x, w = inputs.x, inputs.w
    stream, grid, kernel, args, y, _ = _prepared_forward(x, w)
    floor = inputs.fwd_bwd(_EmptyFunction.apply)

    def cutile_launch():
        ct.launch(stream, grid, kernel, args)

    def torch_kernel():
        y.copy_(x)

    rows = [("floor + grad", per_call_us(floor, device, calls))]
    for name, before in (("a torch kernel (copy_)", torch_kernel), ("a bare ct.launch", cutile_launch)):
        rows.append((name + " alone", per_call_us(before, device, calls)))
        rows.append((name + ", then floor + grad", per_call_us(lambda b=before: (b(), floor()), device, calls)))
    names = sorted(t.name for t in threading.enumerate())
    rows.append((f"python threads after the launches: {len(names)} ({', '.join(names)})", 0.0))
    return rows


def graph_replay(m, n, dtype, device, calls: int) -> list[tuple[str, float]]:
    """The pieces of a launch replayed from a CUDA graph captured once per set of tensor addresses
    (PERFORMANCE.md, "Host path": tried, not shipped), beside the bare ``ct.launch`` it would
    replace: the graph launch through torch and through the driver, and the per-call key and capture check."""
    import cuda.tile as ct

    x, w = torch.randn(m, n, dtype=dtype, device=device), torch.randn(n, dtype=dtype, device=device)
    stream, grid, kernel, args, y, rstd = _prepared_forward(x, w)
    ct.launch(stream, grid, kernel, args)  # compiled before the capture
    torch.cuda.synchronize(device)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        ct.launch(side.cuda_stream, grid, kernel, args)
        graph.capture_end()
    graph.replay()
    torch.cuda.synchronize(device)
    expect = y.clone()
    y.zero_()
    graph.replay()
    torch.cuda.synchronize(device)
    rows = [(f"graph replay writes the launch's output: {torch.equal(y, expect)}", 0.0)]
    cache = {(x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr(), m, n): graph}

    def key_and_lookup():
        return cache.get((x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr(), m, n))

    pieces = [
        ("ct.launch fwd, raw stream, prepared args", lambda: ct.launch(stream, grid, kernel, args)),
        ("torch CUDAGraph.replay() of that launch", graph.replay),
        ("key: 4 data_ptr + shape, dict lookup", key_and_lookup),
        ("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing),
    ]
    try:
        from cuda.bindings import driver

        exec_handle = driver.CUgraphExec(graph.raw_cuda_graph_exec())
        raw = driver.CUstream(stream)
        pieces.append(("driver cuGraphLaunch, prepared handles", lambda: driver.cuGraphLaunch(exec_handle, raw)))
    except (ImportError, AttributeError, RuntimeError) as exc:
        rows.append((f"driver cuGraphLaunch not timed: {exc!r}", 0.0))
    for name, fn in pieces:
        rows.append((name, per_call_us(fn, device, calls)))
    return rows


def _arg_kernels():
    """Kernels that differ only in how many array parameters they take (1, 2, 4, 6); each touches the
    first alone, so their launches differ only in the argument packing."""
    import cuda.tile as ct

    def body(a):
        ct.store(a, (0,), ct.load(a, (0,), (16,)))

    @ct.kernel
    def one(a):
        body(a)

    @ct.kernel
    def two(a, b):
        body(a)

    @ct.kernel
    def four(a, b, c, d):
        body(a)

    @ct.kernel
    def six(a, b, c, d, e, f):
        body(a)

    return {1: one, 2: two, 4: four, 6: six}


def launch_args(m, n, dtype, device, calls: int) -> list[tuple[str, float]]:
    """What each tensor argument adds to a ``ct.launch``: the product's forward launch (six tensors: x, w,
    y, rstd, and x and y again for the fused add's residual arguments), and one small kernel with 1-6
    distinct tensors, or six of which two repeat. ``ct.launch`` exports each torch tensor through DLPack."""
    import cuda.tile as ct

    x, w = torch.randn(m, n, dtype=dtype, device=device), torch.randn(n, dtype=dtype, device=device)
    y, rstd = torch.empty_like(x), torch.empty(m, dtype=torch.float32, device=device)
    dy, y2 = torch.randn_like(x), torch.empty_like(x)
    stream, grid, kernel, args = _prepared_forward(x, w, y, rstd)
    kernels = _arg_kernels()
    tensors = (rstd, x, w, y, dy, y2)
    pieces = [("ct.launch fwd, prepared args (6 tensors)", lambda: ct.launch(stream, grid, kernel, args))]
    for k, kern in kernels.items():
        pieces.append(
            (
                f"ct.launch small kernel, {k} distinct tensors",
                lambda k=k, kern=kern: ct.launch(stream, (1,), kern, tensors[:k]),
            )
        )
    repeated = (rstd, x, w, y, x, y)
    pieces.append(
        ("ct.launch small kernel, 6 tensors, 2 repeated", lambda: ct.launch(stream, (1,), kernels[6], repeated))
    )
    pieces.append(("torch._C._to_dlpack(x)", lambda: torch._C._to_dlpack(x)))
    return [(name, per_call_us(fn, device, calls)) for name, fn in pieces]


def _cutile():
    import tilegym_rms.cutile

    return tilegym_rms.cutile


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def headline(m: int, n: int, dtype: torch.dtype, device: torch.device, calls: int, rounds: int):
    """``(name, min us, median us)`` of the calls the host targets name, timed in turns (one batch of each per
    round) so that a busy stretch of a shared host slows all of them alike; uses only the public API, so
    the same script times an older checkout of the package (PYTHONPATH) for a before/after comparison."""
    import torch.nn.functional as F

    import tilegym_rms

    inputs = _Inputs(m, n, dtype, device)
    x, w, fwd_bwd = inputs.x, inputs.w, inputs.fwd_bwd
    pieces = [
        ("F.rms_norm, no grad", lambda: _no_grad(F.rms_norm, x, (n,), w, 1e-6)),
        ("rms_norm, no grad", lambda: _no_grad(tilegym_rms.rms_norm, x, w)),
        ("floor: Python Function + grad", fwd_bwd(_EmptyFunction.apply)),
        ("F.rms_norm forward + autograd.grad", fwd_bwd(lambda a, b: F.rms_norm(a, (n,), b, 1e-6))),
        ("rms_norm forward + autograd.grad", fwd_bwd(tilegym_rms.rms_norm)),
    ]
    samples = {name: [] for name, _ in pieces}
    for _, fn in pieces:
        for _ in range(20):
            fn()
    for _ in range(rounds):
        for name, fn in pieces:
            samples[name] += timing.wall_latency_us(fn, device, calls, 1)
    return [(name, min(samples[name]), traffic.summarize(samples[name])[0]) for name, _ in pieces]


def profile_top(fn, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def torch_profile_top(fn, calls: int, top: int) -> str:
    """torch.profiler's CPU view of the same loop: which aten ops, autograd nodes and CUDA runtime calls
    take the host time (the Python backward node shows up as ``...Backward``)."""

    def loop():
        for _ in range(calls):
            fn()

    return timing.profiled(loop).key_averages().table(sort_by="cpu_time_total", row_limit=top)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.host_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--dtype", type=cli_args.parse_dtype, default="bf16")
    parser.add_argument("--calls", type=int, default=500, help="calls per timed batch")
    parser.add_argument("--top", type=int, default=25, help="cProfile rows to print")
    parser.add_argument(
        "--headline", type=int, metavar="ROUNDS", help="only the target calls, in turns over ROUNDS rounds"
    )
    parser.add_argument("--graph", action="store_true", help="only the pieces of a CUDA-graph replayed launch")
    parser.add_argument("--launch-args", action="store_true", help="only what each tensor argument adds to a launch")
    args = parser.parse_args(argv)
    device = timing.cuda_device(parser.prog)
    if device is None:
        return 2
    if args.headline:
        import tilegym_rms

        print(f"{torch.cuda.get_device_name(device)}; M={args.m} N={args.n} {args.dtype}; {tilegym_rms.__file__}")
        rows = headline(args.m, args.n, base.DTYPES[args.dtype], device, args.calls, args.headline)
        for name, low, mid in rows:
            print(f"  {name:<48} min {low:8.1f}  median {mid:8.1f}")
        return 0
    print(f"{torch.cuda.get_device_name(device)}; M={args.m} N={args.n} {args.dtype}; us per call (median)")
    if args.graph or args.launch_args:
        measure = graph_replay if args.graph else launch_args
        for name, us in measure(args.m, args.n, base.DTYPES[args.dtype], device, args.calls):
            print(f"  {name:<48} {us:8.1f}")
        return 0
    table = steps(args.m, args.n, base.DTYPES[args.dtype], device)
    for name, fn in table:
        print(f"  {name:<48} {per_call_us(fn, device, args.calls):8.1f}")
    print("\nthe same work on the calling thread and inside a backward (autograd's device thread), us (median):")
    for name, main, inside in engine_thread_split(args.m, args.n, base.DTYPES[args.dtype], device, args.calls):
        print(f"  {name:<48} {main:8.1f} {inside:8.1f}")
    print("\na launch before autograd.grad, us per call (median):")
    for name, us in launch_then_grad(args.m, args.n, base.DTYPES[args.dtype], device, args.calls):
        print(f"  {name:<48} {us:8.1f}")
    print("\ncProfile of rms_norm forward + autograd.grad (sorted by own time):")
    print(profile_top(table[-1][1], args.calls, args.top))
    print("\ntorch.profiler of the same loop (sorted by total CPU time):")
    print(torch_profile_top(table[-1][1], min(args.calls, 100), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
