"""``tilegym-rms`` (also ``python -m tilegym_rms``).

Default command (``check``): report which backends can run here and why the others cannot (and, for
cuTile, which tuning table tunes it), run a forward and backward on the best backend against float64, and
on a GPU time it against torch.
Subcommands: ``aot`` (compile check), ``bench`` and ``bench-backward`` (the scripts in ``bench/``).
The command may stand anywhere; ``--m``/``--n`` are options of ``check``, and every flag after another
command passes through to it. Bad arguments exit with status 2 and one line on stderr, as does a
``TILEGYM_RMS_BACKEND`` that names a backend that cannot run here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

from . import __version__
from .dispatch import available_backends, default_device, resolve_backend
from .ops import rms_norm_backward, rms_norm_forward
from .testing import chunked_errors

BENCH_MODULES = {"bench": "bench.bench_rmsnorm", "bench-backward": "bench.bench_rmsnorm_backward"}
COMMANDS = ("check", "aot", *BENCH_MODULES)
# The options of check, with or without ``=value`` (the only ones that take a value before a command).
_CHECK_OPTIONS = ("--m", "--n")


class _Parser(argparse.ArgumentParser):
    """Errors as one line on stderr (``tilegym-rms: error: ...``) and exit status 2: no usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def _positive_int(parser: argparse.ArgumentParser, option: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        parser.error(f"{option} must be a positive integer, got {value}")
    return number


def _command_index(argv: list[str]) -> int | None:
    """Where the command stands in ``argv`` (None: none given), skipping the values of --m and --n."""
    i = 0
    while i < len(argv):
        if argv[i] in _CHECK_OPTIONS:
            i += 2
            continue
        if argv[i] in COMMANDS:
            return i
        i += 1
    return None


def _gpu_time_us(fn, reps=50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def _check_one(backend: str, device: torch.device, dtype: torch.dtype, m: int, n: int) -> bool:
    """Forward and backward of one dtype against float64 (and a quick timing on a GPU)."""
    torch.manual_seed(0)
    x = torch.randn(m, n, dtype=dtype, device=device)
    w = torch.randn(n, dtype=dtype, device=device)
    dy = torch.randn_like(x)
    y, rstd = rms_norm_forward(x, w, 1e-6, backend=backend)
    dx, dw = rms_norm_backward(x, dy, w, rstd, backend=backend)
    # dx against the size of its terms, not of itself: they cancel (at N = 1 to rounding, in torch too).
    errs = chunked_errors(x, w, dy, {"y": y, "dx": dx, "dw": dw}, eps=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ok = errs["y"] <= tol and errs["dx"] <= tol and errs["dw"] <= 1e-2
    shown = ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
    print(f"{backend} {str(dtype).replace('torch.', '')} ({m}x{n}) vs float64: {shown} -> {'ok' if ok else 'FAIL'}")
    if device.type == "cuda":
        ours = _gpu_time_us(lambda: rms_norm_forward(x, w, backend=backend))
        theirs = _gpu_time_us(lambda: torch.nn.functional.rms_norm(x, (n,), w, 1e-6))
        ours_b = _gpu_time_us(lambda: rms_norm_backward(x, dy, w, rstd, backend=backend))
        print(
            f"  forward {ours:.1f} us (torch F.rms_norm {theirs:.1f} us); backward {ours_b:.1f} us "
            "(CUDA events around 50 eager calls; bench/ has the careful numbers)"
        )
    return ok


def check(m: int = 4096, n: int = 4096) -> int:
    """The main job: backends, a correctness run against float64, and a quick timing on a GPU."""
    device = default_device()
    print(
        f"tilegym_rms {__version__}, torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    for name, (ok, why) in available_backends(device).items():
        print(f"  {name:<7} {'can run' if ok else 'cannot run: ' + why}")
    try:
        backend = resolve_backend(device)
    except (ValueError, RuntimeError) as exc:  # TILEGYM_RMS_BACKEND names a backend that cannot run here
        print(f"tilegym-rms: error: {exc}", file=sys.stderr)
        return 2
    if backend == "cutile":
        from .cutile import tuning

        print(f"  tuning table: {tuning.describe(device.index or 0)}")
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    failed = [not _check_one(backend, device, dtype, m, n) for dtype in dtypes]
    return 1 if any(failed) else 0


def _run_bench(module: str, argv) -> int:
    root = Path(__file__).resolve().parent.parent
    bench = root / "bench"
    if not (bench / "__init__.py").exists():
        print(
            f"{bench} not found: the benchmarks live in the repository's bench/ (install with pip install -e .)",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(root))  # the checkout's bench package, not any other of that name
    return int(importlib.import_module(module).main(argv) or 0)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The module doc's paragraph on the commands, whole (argparse reflows it), without its reST quotes.
    description = " ".join(__doc__.split("\n\n")[1].split()).replace("``", "")
    parser = _Parser(prog="tilegym-rms", description=description, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"tilegym-rms {__version__} (torch {torch.__version__})")
    parser.add_argument(
        "command",
        nargs="?",
        default="check",
        choices=COMMANDS,
        help="check (default): backends, correctness, quick timing; aot: compile check; "
        "bench / bench-backward: run the benchmark scripts (every flag after the command passes through)",
    )
    parser.add_argument("--m", default="4096", metavar="M", help="rows for check, a positive integer (default 4096)")
    parser.add_argument(
        "--n", default="4096", metavar="N", help="hidden size for check, a positive integer (default 4096)"
    )
    at = _command_index(argv)
    if at is not None and argv[at] != "check":
        command, rest = argv[at], argv[at + 1 :]
        parser.parse_args(argv[:at])  # what stands before the command: only check's options are known
        used = [o for o in _CHECK_OPTIONS if any(a == o or a.startswith(o + "=") for a in argv[:at])]
        if used:
            what = "is an option" if len(used) == 1 else "are options"
            parser.error(f"{' and '.join(used)} {what} of check, not of {command}")
        if command == "aot":
            from .aot import main as aot_main

            return aot_main(rest)
        return _run_bench(BENCH_MODULES[command], rest)
    args = parser.parse_args(argv)
    return check(_positive_int(parser, "--m", args.m), _positive_int(parser, "--n", args.n))


if __name__ == "__main__":
    sys.exit(main())
