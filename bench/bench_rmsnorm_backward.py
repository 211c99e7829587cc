"""Standalone RMSNorm backward benchmark of tilegym_rms against its peers.

Run from the repository root: ``python bench/bench_rmsnorm_backward.py [--quick] ...``; ``--help`` lists the flags.
"""

from __future__ import annotations

import argparse
import sys

try:  # imported as part of the bench package / namespace
    from . import common
except ImportError:  # run as a script: bench/ is on sys.path
    import common

KERNEL_NAME = "rms_norm_backward"
JSON_NAME = "rms_norm_backward.json"
MODES = ("standalone", "autograd")

DESCRIPTION = """\
Times the RMSNorm backward (dx and dw from x, dy, w, rstd) over M x N x dtype.

modes:
  standalone  tilegym_rms.rms_norm_backward(x, dy, w, rstd) called directly (and TileGym's standalone
              rms_norm_backward). Peers without a standalone backward (torch = F.rms_norm, liger) are
              timed through autograd as in 'autograd' mode, which the table notes. torch.compile runs in
              standalone mode only when named in --providers.
  autograd    y = provider(x, w) is computed once per input set OUTSIDE the timed region; the timed call is
              torch.autograd.grad(y, (x, w), dy, retain_graph=True), so only backward kernels are counted.

metric: GB/s of the minimal traffic = read x, dy (M*N each), w (N), rstd (M fp32) + write dx (M*N), dw (N),
over the median GPU time per call, also as % of a device-to-device copy measured in the same run.
Workspace: tilegym_rms.backward_workspace_bytes (the fp32 dw partial buffer) per backend and its share of
the traffic, 2*ws / (minimal + 2*ws) (written once, read once); TileGym's equivalent where importable.
"""

EPILOG = """\
timing: sum of device kernel/memcpy/memset durations from torch.profiler per call (see bench/common.py);
median of --reps repetitions with 20th/80th percentiles, each repetition one pass over input sets that
total > 4x L2. The first call of each provider and shape is checked against float64 math (rel. error limit
1e-2 bf16/fp16, 1e-4 fp32); failures are marked '!' in the tables.

output: tables on stdout, a progress line per configuration on stderr, Liger-format JSON merged into
<out>/rms_norm_backward.json and PNGs <out>/rms_norm_backward_<mode>.png.

examples:
  python bench/bench_rmsnorm_backward.py --quick
  python bench/bench_rmsnorm_backward.py
  python bench/bench_rmsnorm_backward.py --mode standalone --dtype bf16 --M 32768 --N 4096,8192
exit codes: 0 ok, 1 a provider hit a fatal CUDA error, 2 no GPU / bad arguments.
"""


def build_parser() -> argparse.ArgumentParser:
    mode_help = f"comma list among {','.join(MODES)} (default both)"
    parser = common.script_parser("bench_rmsnorm_backward.py", DESCRIPTION, EPILOG, MODES, list(MODES), mode_help)
    common.add_common_args(parser)
    return parser


def workspace_table(session: common.Session, configs: list[tuple[str, int, int]]) -> list[list[str]]:
    """Rows: dtype, M, N, minimal MB, then per backend workspace MiB and share."""
    rows = []
    mod = session.mod
    for dtype_name, m, n in configs:
        dtype = common.DTYPES[dtype_name]
        minimal = common.backward_bytes(m, n, dtype.itemsize)
        row = [dtype_name, str(m), str(n), f"{minimal / 1e6:.1f}"]
        for backend in ("cutile", "triton"):
            if mod is None or f"tilegym_rms-{backend}" not in [p.name for p in session.providers]:
                row.append("-")
                continue
            try:
                ws = int(mod.backward_workspace_bytes(m, n, dtype, backend, session.device))
                row.append(f"{ws / 2**20:.2f} MiB {100 * common.workspace_share(minimal, ws):.2f}%")
                session.extra_points.append(("tilegym_rms-" + backend, dtype_name, m, n, ws, minimal))
            except Exception as exc:  # noqa: BLE001
                row.append(f"n/a ({common.short_error(exc, 40)})")
        if "tilegym" in [p.name for p in session.providers]:
            try:
                from tilegym.ops.cutile.rms_norm import rms_norm_backward_workspace_bytes

                ws = int(rms_norm_backward_workspace_bytes(m, n)) // 2  # it returns the traffic (2x the buffer)
                row.append(f"{ws / 2**20:.2f} MiB {100 * common.workspace_share(minimal, ws):.2f}%")
                session.extra_points.append(("tilegym", dtype_name, m, n, ws, minimal))
            except Exception as exc:  # noqa: BLE001
                row.append(f"n/a ({common.short_error(exc, 40)})")
        else:
            row.append("-")
        rows.append(row)
    return rows


def workspace_records(session: common.Session) -> list[dict]:
    """Liger-format records for the workspace (bytes) and its traffic share (%)."""
    recs: dict[tuple, dict] = {}
    meta = session.meta()
    for provider, dtype_name, m, n, ws, minimal in session.extra_points:
        extra = {"M": m, "dtype": dtype_name, "suite": "grid"}
        for metric, unit, value in (
            ("workspace", "bytes", ws),
            ("workspace_share", "%", 100 * common.workspace_share(minimal, ws)),
        ):
            key = (provider, metric, common.extra_str(extra))
            rec = recs.setdefault(
                key,
                {
                    "kernel_name": KERNEL_NAME,
                    "kernel_provider": provider,
                    "metric_name": metric,
                    "metric_unit": unit,
                    "gpu_name": meta["gpu_name"],
                    "x_name": "N",
                    "x_label": "hidden size N",
                    "x_values": [],
                    "y_values_50": [],
                    "y_values_20": [],
                    "y_values_80": [],
                    "timestamp": meta["timestamp"],
                    "kernel_operation_mode": "standalone",
                    "extra_benchmark_config_str": common.extra_str(extra),
                    "tilegym_rms_version": meta["tilegym_rms_version"],
                    "rel_err": [],
                    "mismatch_x_values": [],
                },
            )
            if n in rec["x_values"]:
                continue
            rec["x_values"].append(n)
            for k in ("y_values_50", "y_values_20", "y_values_80"):
                rec[k].append(value)
            rec["rel_err"].append(None)
    return list(recs.values())


def main(argv: list[str] | None = None) -> int:
    args = common.finish_args(build_parser().parse_args(argv))
    configs = common.grid_configs(args.dtype, args.M, args.N)
    session = common.start_session(args, [(op, "grid", configs) for op in args.mode], KERNEL_NAME, JSON_NAME)
    if isinstance(session, int):
        return session
    label = common.grid_label("grid")
    for op in args.mode:
        if session.aborted:
            break
        # standalone peers are torch, liger and tilegym; torch.compile joins only when asked for explicitly
        skip = ("torch.compile",) if op == "standalone" and not args.explicit_providers else ()
        points = session.run_configs(op, "grid", configs, label, skip=skip)
        session.print_table(f"RMSNorm backward, {op} mode", points)
        session.plot(f"rms_norm_backward_{op}", f"RMSNorm backward ({op})", _select(op))

    if not session.aborted:
        print()
        print("== dw workspace (fp32 partial buffer): size and share of traffic 2*ws/(minimal + 2*ws)")
        headers = ["dtype", "M", "N", "minimal MB", "tilegym_rms-cutile", "tilegym_rms-triton", "tilegym"]
        print(common.format_table(headers, workspace_table(session, configs)))
        try:
            common.write_json(session.json_path(), workspace_records(session))
        except OSError as exc:
            common.log(f"warning: could not write workspace records: {exc}")
    print(f"\nJSON: {session.json_path()}")
    if session.aborted:
        print("ABORTED: a fatal CUDA error stopped the run; results so far are saved", file=sys.stderr)
        return 1
    return 0


def _select(op: str):
    def pick(rec: dict) -> bool:
        return (
            rec["kernel_name"] == KERNEL_NAME
            and rec["kernel_operation_mode"] == op
            and rec["metric_name"] == "throughput"
        )

    return pick


if __name__ == "__main__":
    if not __package__:
        common.ensure_repo_on_path()
    sys.exit(main())
