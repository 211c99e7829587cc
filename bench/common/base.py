"""What every benchmark module shares: the fixed choices (dtypes and tolerances, the grid, input rotation,
providers, the timing methods' descriptions) and the one-line helpers for progress and errors.

``TILEGYM_RMS_BENCH_CPU=1`` runs the whole pipeline on the CPU with wall-clock timing; it exists only to test
the scripts themselves, its numbers mean nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parents[1]  # bench/: heldout.json and results/ live there
REPO_ROOT = BENCH_DIR.parent  # RESULTS.md lives beside the README

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-2, "fp32": 1e-4}
# An FP8 output dequantized (error "y_q"): e4m3's half step at the bottom of a binade, 2^-4 of the value, bounds
# every normal element's rounding, so a correct quantization stays below it (randn rows: 0.026); a wrong scale
# or a saturated row does not.
FP8_TOLERANCE = 2.0**-4


def tolerance(err_name: str, dtype_name: str) -> float:
    """The limit of the relative error ``err_name`` of an output computed from ``dtype_name`` inputs."""
    return FP8_TOLERANCE if err_name == "y_q" else TOLERANCE[dtype_name]


GRID_M = (4096, 32768)
GRID_N = (1024, 2048, 4096, 5120, 7168, 8192, 16384)
QUICK_M = (4096,)
QUICK_N = (2048, 8192)

# The held-out shapes (bench/bench_rmsnorm.py --measure heldout): committed before tuning, never tuned on.
HELDOUT_FILE = BENCH_DIR / "heldout.json"

EPS = 1e-6
L2_FALLBACK_BYTES = 50 * 2**20
L2_FACTOR = 4
MAX_SETS = 512  # tiny shapes: more sets would only add Python calls; flagged when it caps
MIN_CALLS_PER_PASS = 4
COPY_BYTES = 2**30
DEFAULT_REPS = 20
QUICK_REPS = 10
MARKER_CYCLES = 1000
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_ENV = "TILEGYM_RMS_BENCH_CPU"

PROVIDERS_ALL = (
    "tilegym_rms-cutile",
    "tilegym_rms-triton",
    "tilegym_rms-torch",
    "tilegym_rms-unfused",
    "torch",
    "torch.compile",
    "liger",
    "tilegym",
    "quack",
    "mamba-torch",
)
PROVIDERS_DEFAULT = ("tilegym_rms-cutile", "tilegym_rms-triton", "torch", "torch.compile", "liger", "tilegym")
# Providers that run in some measures' own comparisons only, by the measures that take them: our RMSNorm plus
# a step in torch (the residual add before it, bench_rmsnorm.py --measure fused_add; the FP8 quantization after
# it, --measure fp8; the gate, --measure gated) or called on q and on k (--measure qk_norm), and mamba_ssm's gated
# norm semantics in torch (--measure gated).
OWN_MEASURE_ONLY = {"tilegym_rms-unfused": "fused_add, qk_norm, fp8 or gated", "mamba-torch": "gated"}
FUSED_ADD_PROVIDERS_DEFAULT = (
    "tilegym_rms-cutile",
    "tilegym_rms-triton",
    "tilegym_rms-unfused",
    "torch",
    "torch.compile",
    "liger",
    "quack",
)

# RMSNorm with FP8 output (bench_rmsnorm.py --measure fp8, and the latency measure's fp8_token): ours, the
# reference's norm and quantization compiled together, our norm then the reference's quantization.
FP8_PROVIDERS_DEFAULT = ("tilegym_rms-cutile", "torch.compile", "tilegym_rms-unfused")

# The held-out shapes and the large hidden sizes run beside quack too (it publishes its wide-row bandwidth); it
# is skipped, with the reason, where it does not import.
HELDOUT_PROVIDERS_DEFAULT = PROVIDERS_DEFAULT + ("quack",)
QUACK_BY_DEFAULT = ("heldout", "large")

# QK-norm (bench_rmsnorm.py --measure qk_norm): q of M rows in QK_HEADS[0] heads, k in QK_HEADS[1] (GQA). The
# run's ratio: bench_rmsnorm.py --qk-heads sets it for the process; every QK input set and traffic count reads
# it, and records of another ratio than QK_HEADS_DEFAULT carry it in their config ("heads": "32:8").
QK_HEADS_DEFAULT = (16, 4)
QK_HEADS = QK_HEADS_DEFAULT
QK_PROVIDERS_DEFAULT = ("tilegym_rms-cutile", "torch", "torch.compile", "liger", "quack")

METHOD_TEXT = {
    "profiler": "sum of device kernel+memcpy+memset durations (torch.profiler/CUPTI) per call",
    "cuda-events": "CUDA-event elapsed time per repetition / calls (includes launch gaps)",
    "wall": "host wall clock (CPU test mode; meaningless numbers)",
}


def log(msg: str) -> None:
    """A progress line, flushed, on stderr."""
    print(msg, file=sys.stderr, flush=True)


def is_sticky_cuda_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(
        s in text
        for s in ("illegal memory access", "unspecified launch failure", "device-side assert", "illegal instruction")
    )


def short_error(exc: BaseException, limit: int = 160) -> str:
    line = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {line}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def heldout_configs(path: Path | None = None) -> list[tuple[str, int, int]]:
    """(dtype, M, N) of every held-out shape (default :data:`HELDOUT_FILE`), in the file's order, each with its
    own dtype."""
    shapes = json.loads((path or HELDOUT_FILE).read_text())["shapes"]
    return [(s["dtype"], int(s["m"]), int(s["n"])) for s in shapes]
