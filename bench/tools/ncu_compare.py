"""One call of each provider per shape, for Nsight Compute to profile side by side (PERFORMANCE.md, "Forward").

Every provider is first run twice outside the profiled range (compiles, autotuning, torch.compile's graph), its
outputs checked against float64 math, and then called once between ``cudaProfilerStart`` and
``cudaProfilerStop``. Run it under ``ncu --profile-from-start off`` so that only those calls are profiled; the
script prints, per shape, the order in which the providers ran, which is the order of their kernels in the
report::

    ncu --profile-from-start off --set full -o /tmp/fwd python -m bench.tools.ncu_compare \\
        --shapes 8000x896,6000x2304 --dtype bf16 --op forward --providers tilegym_rms-cutile,quack,torch.compile

Ops are the benchmark's (``providers.build_call``): ``forward`` under no_grad, ``backward`` as
``torch.autograd.grad`` of a built forward graph, ``full`` as both. Without ``ncu`` the script just runs and checks
every call once, which is how to see that the providers import before spending a profile on them.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import base, providers, timing
from bench.tools import tune_cutile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.tools.ncu_compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shapes", required=True, help="MxN[,MxN...]")
    ap.add_argument("--dtype", default="bf16", choices=sorted(base.DTYPES))
    ap.add_argument("--op", default="forward", choices=("forward", "backward", "full"))
    ap.add_argument("--providers", default="tilegym_rms-cutile,quack,torch.compile,liger")
    args = ap.parse_args(argv)

    device = timing.cuda_device(ap.prog)
    if device is None:
        return 2
    tilegym_rms, _, err = providers.import_tilegym_rms()
    found, skipped = providers.discover_providers(
        args.providers.split(","), device, base.EPS, tilegym_rms=tilegym_rms, tilegym_rms_error=err
    )
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    cudart = torch.cuda.cudart()
    shapes = tune_cutile.parse_shapes(args.shapes)
    failed = 0
    for line, wrong in profile_calls(
        found, args.op, shapes, args.dtype, device, cudart.cudaProfilerStart, cudart.cudaProfilerStop
    ):
        print(line, flush=True)  # as each shape ends, so the log sits beside ncu's lines for its kernels
        failed += wrong
    return 1 if failed else 0


def profile_calls(found, op, shapes, dtype_name, device, start, stop):
    """Per shape, each provider's ``op`` run twice unprofiled and checked against float64, then once between
    ``start()`` and ``stop()``. Yields, per shape, a line naming the providers in the order they ran (the order of
    their kernels in the profile) and the number of them whose outputs were wrong."""
    for m, n in shapes:
        sets = providers.InputSets(m, n, base.DTYPES[dtype_name], device, 1, seed=0, eps=base.EPS)
        order, wrong = [], 0
        for prov in found:
            call, _ = providers.build_call(op, prov, sets)
            for _ in range(2):
                outputs = call(0)
            errs = providers.output_errors(op, sets, base.EPS, outputs)
            ok = providers.check_ok(errs, dtype_name)
            wrong += not ok
            timing.sync(device)
            start()
            call(0)
            timing.sync(device)
            stop()
            errs_text = " ".join(f"{k}={v:.1e}" for k, v in errs.items())
            order.append(f"{prov.name} ({'ok' if ok else 'WRONG'}: {errs_text})")
        yield f"{m}x{n} {dtype_name} {op}: " + ", ".join(order), wrong


if __name__ == "__main__":
    sys.exit(main())
