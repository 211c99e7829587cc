"""Compiling a variant: its kernel signature (as the compile check assumes it, or as a launch derives it) and its
cubin."""

from __future__ import annotations

import io
import time

import torch

from .variant import Variant

# Bytes to which a launched array's base address and row stride are aligned in the "as launched" signature.
LAUNCH_ALIGN_BYTES = 16


def signature(v: Variant, as_launched: bool = False):
    """The variant's signature with no assumption on its arrays beyond their rank and dtype (the compile
    check's), or ``as_launched``: what a launch derives from contiguous tensors whose rows are 16-byte aligned
    (every hidden size that is a multiple of 8 in 16-bit, 4 in fp32). Only that build can use TMA, so it is the
    one the GPU runs for such shapes; its registers and shared memory differ (PERFORMANCE.md, "Toolchain")."""
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint

    ct_dtype = {torch.float32: ct.float32, torch.float16: ct.float16, torch.bfloat16: ct.bfloat16,
                torch.float8_e4m3fn: ct.float8_e4m3fn, torch.float8_e5m2: ct.float8_e5m2,
                torch.int32: ct.int32, torch.int64: ct.int64}  # fmt: skip
    params = []
    for p in v.params:
        if isinstance(p, tuple) and p[0] == "array":
            aligned = {}
            if as_launched:
                ndim, itemsize = p[2], p[1].itemsize
                aligned = dict(
                    stride_constant=(None,) * (ndim - 1) + (1,),
                    stride_divisible_by=(LAUNCH_ALIGN_BYTES // itemsize,) * (ndim - 1) + (1,),
                    base_addr_divisible_by=LAUNCH_ALIGN_BYTES,
                )
            params.append(
                ArrayConstraint(
                    ct_dtype[p[1]],
                    p[2],
                    index_dtype=ct.int32,
                    stride_lower_bound_incl=0,
                    alias_groups=(),
                    may_alias_internally=False,
                    **aligned,
                )
            )
        elif isinstance(p, tuple) and p[0] == "scalar":
            params.append(ScalarConstraint(ct.float32))
        else:
            params.append(p)
    return KernelSignature(params, CallingConvention.cutile_python_v1())


def cubin(v: Variant, arch: str, as_launched: bool = False) -> bytes:
    """One variant compiled for ``arch`` (raises on failure); ``as_launched``: see :func:`signature`."""
    from cuda.tile.compilation import export_kernel

    from ..cutile import kernels
    from ..cutile.launch import with_hints

    buf = io.BytesIO()
    kernel = with_hints(getattr(kernels, v.kernel_name), v.hints)
    export_kernel(kernel, [signature(v, as_launched)], buf, gpu_code=arch, output_format="cubin")
    if not buf.getvalue():
        raise RuntimeError("empty cubin")
    return buf.getvalue()


def compile_variant(v: Variant, arch: str) -> int:
    """Compiles one variant for ``arch``; returns the cubin size in bytes (raises on failure)."""
    return len(cubin(v, arch))


def compile_timed(item: tuple[Variant, str]) -> tuple[int, str | None, float]:
    """``(cubin bytes, error or None, seconds)`` of one (variant, arch): the work of one pool task."""
    v, a = item
    t0 = time.perf_counter()
    try:
        return compile_variant(v, a), None, time.perf_counter() - t0
    except Exception as exc:  # report every failure, keep going
        return 0, f"{type(exc).__name__}: {exc}".splitlines()[0][:160], time.perf_counter() - t0
