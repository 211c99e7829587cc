"""Compile check: every cuTile variant the dispatcher can select compiles to a cubin (no GPU needed)."""

import io

import pytest

pytest.importorskip("cuda.tile")  # the [cuda] extra; before the kernels module, which imports it

from tilegym_rms import aot  # noqa: E402
from tilegym_rms.cutile import kernels  # noqa: E402


def test_variants_cover_every_kernel():
    names = {v.kernel_name for v in aot.variants()}
    launched = {
        "rms_norm_fwd_gather",
        "rms_norm_fwd_persistent",
        "rms_norm_bwd_direct",
        "rms_norm_bwd_persistent",
        "rms_norm_bwd_row_dot",
        "rms_norm_bwd_column_chunk",
        "rms_norm_dw_reduce",
    }
    assert names == launched
    assert all(hasattr(kernels, n) for n in names)


@pytest.mark.parametrize("arch", aot.ARCHS)
def test_every_variant_compiles(arch):
    out = io.StringIO()
    failures = aot.run((arch,), jobs=2, out=out)
    assert failures == 0, out.getvalue()
    assert f"{len(aot.variants())} compiled, 0 failed" in out.getvalue()
