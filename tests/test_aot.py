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
        "qk_rms_norm_fwd",
        "qk_rms_norm_bwd",
    }
    assert names == launched
    assert all(hasattr(kernels, n) for n in names)


@pytest.mark.parametrize("arch", aot.ARCHS)
def test_every_variant_compiles(arch):
    out = io.StringIO()
    failures = aot.run((arch,), jobs=2, out=out)
    assert failures == 0, out.getvalue()
    assert f"{len(aot.variants())} compiled, 0 failed" in out.getvalue()


def test_qk_variants_cover_the_head_dims_and_both_kernels():
    """The qk variants reach each representative head dim's tile width, forward and backward."""
    qk = aot.qk_variants()
    assert {v.kernel_name for v in qk} == {"qk_rms_norm_fwd", "qk_rms_norm_bwd", "rms_norm_dw_reduce"}
    widths = {v.params[13] for v in qk if v.kernel_name == "qk_rms_norm_bwd"}
    assert widths == set(aot.QK_REPRESENTATIVE_D)
    assert set(qk) <= set(aot.variants())  # the full check compiles them too


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_qk_variants_compile(arch):
    """Only the qk variants (the full check above is slow): `pytest tests/test_aot.py -k qk`."""
    out = io.StringIO()
    only = aot.qk_variants()
    failures = aot.run((arch,), jobs=4, out=out, only=only)
    assert failures == 0, out.getvalue()
    assert f"{len(only)} compiled, 0 failed" in out.getvalue()
