"""Command-line parsing the benchmark scripts share: comma lists, dtype and provider names, the common options
and the defaults that depend on ``--quick``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from bench.common import base


def csv_list(kind: Callable[[str], object]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        try:
            return [kind(t) for t in items]
        except (ValueError, KeyError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse


def parse_heads(text: str) -> tuple[int, int]:
    """``HQ:HK`` query and key heads of a GQA layout (HK divides HQ), e.g. ``32:8``."""
    hq, sep, hk = text.partition(":")
    try:
        heads = (int(hq), int(hk)) if sep else None
    except ValueError:
        heads = None
    if heads is None or heads[1] < 1 or heads[0] < heads[1] or heads[0] % heads[1]:
        raise argparse.ArgumentTypeError(f"HQ:HK with HK >= 1 dividing HQ (e.g. 32:8), got {text!r}")
    return heads


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"an integer >= 1, got {text!r}")
    return value


def parse_dtype(name: str) -> str:
    name = name.lower()
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
    name = aliases.get(name, name)
    if name not in base.DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(base.DTYPES)}")
    return name


def parse_provider(name: str) -> str:
    if name not in base.PROVIDERS_ALL:
        raise ValueError(f"unknown provider {name!r}; choose from {', '.join(base.PROVIDERS_ALL)}")
    return name


def choice_list(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(name: str) -> str:
        if name not in choices:
            raise ValueError(f"unknown measure {name!r}; choose from {', '.join(choices)}")
        return name

    return parse


def script_parser(prog: str, description: str, epilog: str, measures: tuple[str, ...], default, measure_help: str):
    """The argument parser both scripts start from: their help text, ``--measure`` over ``measures``."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--measure", type=csv_list(choice_list(measures)), default=default, help=measure_help)
    return parser


def add_common_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("common options")
    g.add_argument(
        "--dtype",
        type=csv_list(parse_dtype),
        default=None,
        help="comma list of dtypes among bf16,fp16,fp32 (default: bf16,fp16,fp32 for the M x N grid)",
    )
    g.add_argument("--M", type=csv_list(int), default=None, help=f"comma list of row counts (default {base.GRID_M})")
    g.add_argument("--N", type=csv_list(int), default=None, help=f"comma list of hidden sizes (default {base.GRID_N})")
    g.add_argument(
        "--providers",
        type=csv_list(parse_provider),
        default=None,
        help=f"comma list among {', '.join(base.PROVIDERS_ALL)} (default: {', '.join(base.PROVIDERS_DEFAULT)}); "
        "unavailable ones are skipped with the reason printed",
    )
    g.add_argument(
        "--reps", type=int, default=None, help=f"timed repetitions, >= 10 advised (default {base.DEFAULT_REPS})"
    )
    g.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: M={base.QUICK_M}, N={base.QUICK_N}, bf16, {base.QUICK_REPS} reps, results under <out>/quick",
    )
    g.add_argument(
        "--timing",
        choices=("profiler", "cuda-events"),
        default="profiler",
        help="primary timing method (default profiler: sum of kernel durations)",
    )
    g.add_argument("--eps", type=float, default=base.EPS, help=f"RMSNorm epsilon (default {base.EPS})")
    g.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    g.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default bench/results/<gpu-slug>/, plus quick/ for --quick); JSON there is merged",
    )
    g.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    g.add_argument("--dry-run", action="store_true", help="print the planned configurations and exit (no GPU needed)")


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick."""
    args.explicit_dtype = args.dtype is not None
    args.explicit_M = args.M is not None
    args.explicit_N = args.N is not None
    if args.dtype is None:
        args.dtype = ["bf16"] if args.quick else list(base.DTYPES)
    if args.M is None:
        args.M = list(base.QUICK_M if args.quick else base.GRID_M)
    if args.N is None:
        args.N = list(base.QUICK_N if args.quick else base.GRID_N)
    if args.reps is None:
        args.reps = base.QUICK_REPS if args.quick else base.DEFAULT_REPS
    if args.reps < 1:
        raise SystemExit("--reps must be >= 1")
    if args.providers is None:
        args.providers = list(base.PROVIDERS_DEFAULT)
        args.explicit_providers = False
    else:
        args.explicit_providers = True
    return args
