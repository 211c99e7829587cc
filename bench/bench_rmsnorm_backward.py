"""Standalone RMSNorm backward benchmark of tilegym_rms against its peers.

Run from the repository root: ``python -m bench.bench_rmsnorm_backward [--quick] ...``; ``--help`` lists the flags.
"""

from __future__ import annotations

import argparse
import sys

from bench.common import base, cli_args, records, report, traffic
from bench.common.session import Session, grid_configs, grid_label, start_session

KERNEL_NAME = "rms_norm_backward"
JSON_NAME = "rms_norm_backward.json"
MEASURES = ("standalone", "autograd")

DESCRIPTION = """\
Times the RMSNorm backward (dx and dw from x, dy, w, rstd) over M x N x dtype.

measures:
  standalone  tilegym_rms.rms_norm_backward(x, dy, w, rstd) called directly (and TileGym's standalone
              rms_norm_backward). Peers without a standalone backward (torch = F.rms_norm, liger) are
              timed through autograd as in the 'autograd' measurement, which the table notes. torch.compile runs in
              the standalone measurement only when named in --providers.
  autograd    y = provider(x, w) is computed once per input set OUTSIDE the timed region; the timed call is
              torch.autograd.grad(y, (x, w), dy, retain_graph=True), so only backward kernels are counted.

metric: GB/s of the minimal traffic = read x, dy (M*N each), w (N), rstd (M fp32) + write dx (M*N), dw (N),
over the median GPU time per call, also as % of a device-to-device copy measured in the same run.
Workspace: tilegym_rms.backward_workspace_bytes (the fp32 dw partial buffer) per backend and its share of
the traffic, 2*ws / (minimal + 2*ws) (written once, read once); TileGym's equivalent where importable.
"""

EPILOG = """\
timing: sum of device kernel/memcpy/memset durations from torch.profiler per call (see bench/common/timing.py);
median of --reps repetitions with 20th/80th percentiles, each repetition one pass over input sets that
total > 4x L2. The first call of each provider and shape is checked against float64 math (rel. error limit
1e-2 bf16/fp16, 1e-4 fp32); failures are marked '!' in the tables.

output: tables on stdout, a progress line per configuration on stderr, Liger-format JSON merged into
<out>/rms_norm_backward.json and PNGs <out>/rms_norm_backward_<measure>.png.

examples:
  python -m bench.bench_rmsnorm_backward --quick
  python -m bench.bench_rmsnorm_backward
  python -m bench.bench_rmsnorm_backward --measure standalone --dtype bf16 --M 32768 --N 4096,8192
exit codes: 0 ok, 1 a provider hit a fatal CUDA error, 2 no GPU / bad arguments.
"""


def build_parser() -> argparse.ArgumentParser:
    measure_help = f"comma list among {','.join(MEASURES)} (default both)"
    parser = cli_args.script_parser(
        "python -m bench.bench_rmsnorm_backward", DESCRIPTION, EPILOG, MEASURES, list(MEASURES), measure_help
    )
    cli_args.add_common_args(parser)
    return parser


def workspace_table(session: Session, configs: list[tuple[str, int, int]]) -> list[list[str]]:
    """Rows: dtype, M, N, minimal MB, then per backend workspace MiB and share."""
    rows = []
    mod = session.mod
    for dtype_name, m, n in configs:
        dtype = base.DTYPES[dtype_name]
        minimal = traffic.backward_bytes(m, n, dtype.itemsize)
        row = [dtype_name, str(m), str(n), f"{minimal / 1e6:.1f}"]
        for backend in ("cutile", "triton"):
            if mod is None or f"tilegym_rms-{backend}" not in [p.name for p in session.providers]:
                row.append("-")
                continue
            try:
                ws = int(mod.backward_workspace_bytes(m, n, dtype, backend, session.device))
                row.append(f"{ws / 2**20:.2f} MiB {100 * traffic.workspace_share(minimal, ws):.2f}%")
                session.extra_points.append(("tilegym_rms-" + backend, dtype_name, m, n, ws, minimal))
            except Exception as exc:  # noqa: BLE001
                row.append(f"n/a ({base.short_error(exc, 40)})")
        if "tilegym" in [p.name for p in session.providers]:
            try:
                from tilegym.ops.cutile.rms_norm import rms_norm_backward_workspace_bytes

                ws = int(rms_norm_backward_workspace_bytes(m, n)) // 2  # it returns the traffic (2x the buffer)
                row.append(f"{ws / 2**20:.2f} MiB {100 * traffic.workspace_share(minimal, ws):.2f}%")
                session.extra_points.append(("tilegym", dtype_name, m, n, ws, minimal))
            except Exception as exc:  # noqa: BLE001
                row.append(f"n/a ({base.short_error(exc, 40)})")
        else:
            row.append("-")
        rows.append(row)
    return rows


def workspace_records(session: Session) -> list[dict]:
    """Liger-format records for the workspace (bytes) and its traffic share (%)."""
    recs: dict[tuple, dict] = {}
    meta = session.meta()
    for provider, dtype_name, m, n, ws, minimal in session.extra_points:
        extra = {"M": m, "dtype": dtype_name, "suite": "grid"}
        for metric, unit, value in (
            ("workspace", "bytes", ws),
            ("workspace_share", "%", 100 * traffic.workspace_share(minimal, ws)),
        ):
            key = (provider, metric, records.extra_str(extra))
            if key not in recs:
                recs[key] = records.new_record(
                    meta, kernel_name=KERNEL_NAME, provider=provider, metric=metric, unit=unit, op="standalone",
                    extra=extra, x_name="N", x_label="hidden size N", timed=False,
                )  # fmt: skip
            rec = recs[key]
            if n in rec["x_values"]:
                continue
            rec["x_values"].append(n)
            for k in ("y_values_50", "y_values_20", "y_values_80"):
                rec[k].append(value)
            rec["rel_err"].append(None)
    return list(recs.values())


def main(argv: list[str] | None = None) -> int:
    args = cli_args.finish_args(build_parser().parse_args(argv))
    configs = grid_configs(args.dtype, args.M, args.N)
    session = start_session(args, [(op, "grid", configs) for op in args.measure], KERNEL_NAME, JSON_NAME)
    if isinstance(session, int):
        return session
    label = grid_label("grid")
    for op in args.measure:
        if session.aborted:
            break
        # standalone peers are torch, liger and tilegym; torch.compile joins only when asked for explicitly
        skip = ("torch.compile",) if op == "standalone" and not args.explicit_providers else ()
        points = session.run_configs(op, "grid", configs, label, skip=skip)
        session.print_table(f"RMSNorm backward, {op}", points)
        session.plot(plot_stem(op, "grid"), f"RMSNorm backward ({op})", _select(op))

    if not session.aborted:
        print()
        print("== dw workspace (fp32 partial buffer): size and share of traffic 2*ws/(minimal + 2*ws)")
        headers = ["dtype", "M", "N", "minimal MB", "tilegym_rms-cutile", "tilegym_rms-triton", "tilegym"]
        print(report.format_table(headers, workspace_table(session, configs)))
        try:
            records.write_json(session.json_path(), workspace_records(session))
        except OSError as exc:
            base.log(f"warning: could not write workspace records: {exc}")
    return session.finish()


def plot_stem(op: str, suite: str) -> str:
    """File name (without .png) of the plot of ``op`` (every suite of this script is the grid)."""
    return f"{KERNEL_NAME}_{op}"


def _select(op: str):
    def pick(rec: dict) -> bool:
        return (
            rec["kernel_name"] == KERNEL_NAME
            and rec["kernel_operation_mode"] == op
            and rec["metric_name"] == "throughput"
        )

    return pick


if __name__ == "__main__":
    sys.exit(main())
