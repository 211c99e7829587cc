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


def test_arithmetic_axes_are_compiled_for_every_kernel_class():
    """Each casting mode, the no-weight and (gather) the no-rstd forward, and the no-weight backward, appear
    for both forward kernels and each backward plan's kernel: the axes EVERY_PATH_N keeps to a few widths."""
    vs = aot.variants()
    for name in ("rms_norm_fwd_gather", "rms_norm_fwd_persistent"):
        fwd = [v for v in vs if v.kernel_name == name and v.params[-1] == 0]  # ADD = 0: the plain norm
        cast_w = {(v.params[-5], v.params[-4]) if name.endswith("gather") else v.params[-3:-1] for v in fwd}
        assert cast_w >= {(0, True), (1, True), (2, True), (0, False)}, name
    gather = [v for v in vs if v.kernel_name == "rms_norm_fwd_gather" and v.params[-1] == 0]
    assert {v.params[-2] for v in gather} == {True, False}  # STORE_RSTD
    for name in ("rms_norm_bwd_direct", "rms_norm_bwd_persistent", "rms_norm_bwd_column_chunk"):
        assert {v.params[-2] for v in vs if v.kernel_name == name} == {True, False}, name  # HAS_W


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


def _measured_points():
    """(m, n, dtype) at every measured run of the shipped tables: where a sweep may have picked a variant
    the heuristics never launch."""
    from tilegym_rms.cutile import tuning

    for key in tuning.packaged_keys():
        doc = tuning.packaged(key).doc
        for dt, by_n in doc["forward"].items():
            for n_b, runs in by_n.items():
                for run in runs:
                    if "gbps" in run:
                        yield key, doc["device"]["sms"], run["m"], int(n_b), tuning.DTYPES[dt]


def test_the_hosts_launches_under_the_shipped_tables_are_compiled(monkeypatch):
    """The forward the host launches (kernel, constants, hints) at each measured table point, read from the
    host path itself, is one of the variants the compile check builds."""
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import launch, tuning

    compiled = {(v.kernel_name, v.params[-len(v.params) + 8 :], v.hints) for v in aot.variants()}
    points = list(_measured_points())
    assert points, "the shipped tables hold no measured point"
    for key, sms, m, n, dtype in points:
        monkeypatch.setattr(launch, "num_sms", lambda index, sms=sms: sms)
        monkeypatch.setattr(tuning, "device_key", lambda index, key=key: key)
        cutile.clear_caches()
        with tuning.use_table("packaged"):
            plan = cutile._forward_launch(0, m, n, dtype, None, "llama", True, True, cutile._ADD_NONE)
        name = "rms_norm_fwd_gather" if plan.kernel is kernels.rms_norm_fwd_gather else "rms_norm_fwd_persistent"
        assert (name, plan.constants, plan.hints) in compiled, (key, m, n, dtype, plan)
    cutile.clear_caches()
