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
    for both forward kernels and each backward plan's kernel: the axes TILE_CLASS_N keeps to a few widths."""
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
    assert f"{len(aot.variants(arch))} compiled, 0 failed" in out.getvalue()


def test_table_winners_are_compiled_for_their_own_arch_only():
    """A table applies to its device class alone (other devices use the heuristics), so its measured
    winners are compiled for that arch; every arch still gets every heuristic variant."""
    from tilegym_rms.cutile import tuning

    table_archs = {aot.table_arch(tuning.packaged(key).doc) for key in tuning.packaged_keys()}
    assert table_archs == {"sm_90"}  # the shipped H100 table
    winners = set(aot.table_variants("sm_90"))
    heuristic = set(aot.variants("sm_80"))
    assert winners - heuristic, "the H100 table launches variants the heuristics never do"
    assert set(aot.variants("sm_90")) == heuristic | winners
    for arch in set(aot.ARCHS) - table_archs:
        assert aot.table_variants(arch) == [] and set(aot.variants(arch)) == heuristic, arch


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


def _measured_points(op):
    """(key, sms, m, n, dtype) at every measured run of ``op`` in the shipped tables: where a sweep may have
    picked a variant the heuristics never launch."""
    from tilegym_rms.cutile import tuning

    for key in tuning.packaged_keys():
        doc = tuning.packaged(key).doc
        for dt, by_n in doc.get(op, {}).items():
            for n_b, runs in by_n.items():
                for run in runs:
                    if "gbps" in run:
                        yield key, doc["device"]["sms"], run["m"], int(n_b), tuning.DTYPES[dt]


def _forward_name(launch):
    return "rms_norm_fwd_gather" if launch.kernel is kernels.rms_norm_fwd_gather else "rms_norm_fwd_persistent"


# the dx kernel of each backward plan, by the object the host launches
_BACKWARD_NAMES = {
    getattr(kernels, n): n for n in ("rms_norm_bwd_direct", "rms_norm_bwd_persistent", "rms_norm_bwd_column_chunk")
}


def _check_hosts_launches(monkeypatch, require_every_op=False):
    """The forward the host launches (kernel, constants, hints) at each measured table point, plain and
    fused (ADD "pre" and "post"), the backward with and without the residual gradient, and the qk kernels
    (a training call's), read from the host path itself, are among the variants the compile check builds."""
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import launch, tuning
    from tilegym_rms.cutile.host import backward, forward, qk
    from tilegym_rms.cutile.tuning import build

    # the constants: after the arrays and scalars (8 of a forward, 10 of the qk forward, 12 of its backward)
    skip = {"qk_rms_norm_fwd": 10, "qk_rms_norm_bwd": 12, "rms_norm_bwd_column_chunk": 9, "rms_norm_bwd_row_dot": 6}
    compiled = {(v.kernel_name, v.params[skip.get(v.kernel_name, 8) :], v.hints) for v in aot.variants()}
    adds = {"forward": (forward.ADD_NONE,), "fused_forward": tuple(forward.ADD_MODES.values())}
    checked = dict.fromkeys((*adds, "backward", "qk"), 0)
    for op, modes in adds.items():
        for key, sms, m, n, dtype in _measured_points(op):
            monkeypatch.setattr(launch, "num_sms", lambda index, sms=sms: sms)
            monkeypatch.setattr(tuning, "device_key", lambda index, key=key: key)
            cutile.clear_caches()
            for add in modes:
                with tuning.use_table("packaged"):
                    fl = forward.cached_launch(0, m, n, dtype, None, "llama", True, True, add).launch
                assert (_forward_name(fl), fl.constants, fl.hints) in compiled, (op, key, m, n, dtype, fl)
                checked[op] += 1
    for key, sms, m, n, dtype in _measured_points("backward"):
        monkeypatch.setattr(launch, "num_sms", lambda index, sms=sms: sms)
        monkeypatch.setattr(tuning, "device_key", lambda index, key=key: key)
        cutile.clear_caches()
        for has_dres in (False, True):  # the plain norm's backward and the fused add's
            with tuning.use_table("packaged"):
                b = backward.cached_launches(0, m, n, dtype, True, has_dres)
            want = (_BACKWARD_NAMES[b.main.kernel], b.main.constants, b.cfg.hints)
            assert want in compiled, (key, m, n, dtype, b)
            if b.cfg.plan == "chunked":  # its first launch, the row dots
                assert ("rms_norm_bwd_row_dot", b.row_dot.constants, b.cfg.hints) in compiled, (key, m, n, dtype, b)
        checked["backward"] += 1
    for key, sms, m, d, dtype in _measured_points("qk"):
        monkeypatch.setattr(launch, "num_sms", lambda index, sms=sms: sms)
        monkeypatch.setattr(tuning, "device_key", lambda index, key=key: key)
        cutile.clear_caches()
        tokens = build.qk_sweep_tokens(m)
        with tuning.use_table("packaged"):
            c = qk.cached_config(0, tokens * build.QK_SWEEP_HEADS[0], tokens * build.QK_SWEEP_HEADS[1], d, dtype)
        assert ("qk_rms_norm_fwd", (c.fwd_tile_m, c.tile_n, 0, True, True), c.fwd_hints) in compiled, (key, m, d, c)
        assert ("qk_rms_norm_bwd", (c.bwd_tile_m, c.tile_n, True, True), c.bwd_hints) in compiled, (key, m, d, c)
        checked["qk"] += 1
    cutile.clear_caches()
    assert checked["forward"], "the shipped tables hold no measured point"
    if require_every_op:
        assert all(checked.values()), checked


def test_the_hosts_launches_under_the_shipped_tables_are_compiled(monkeypatch):
    _check_hosts_launches(monkeypatch)


def _odd_table():
    """A table of measured winners the heuristics never pick, for every op a sweep writes."""
    from dataclasses import asdict

    import torch

    from tilegym_rms.cutile import config, tuning
    from tilegym_rms.cutile.tuning import build

    doc = build.new_doc("sm90_132sm", "test", (9, 0), 132, "measured", "test")
    gather = config.ForwardCandidate("gather", 1, 2048, 0, 0, 16, 2)
    persistent = config.ForwardCandidate("persistent", 32, 1024, 0, 4, 1, 4)
    for op, n_b, cand in (
        ("forward", 2048, gather),
        ("backward", 2048, config.BackwardCandidate("persistent", 64, 2048, 0, 3, 1, 4)),
        ("fused_forward", 2048, gather),
        ("fused_forward", 1024, persistent),
        ("qk", 64, config.QKCandidate(512, 64, 3, 1, 1, 4)),  # 512 x 64: twice the heuristics' largest tile
    ):
        build.set_runs(doc, op, "bf16", n_b, [{"m": 4096, "winner": asdict(cand), "gbps": {"x": 1.0}}])
    assert config.forward_candidate(4096, 2048, torch.bfloat16, 132) != gather
    return tuning.load(doc)


def test_the_hosts_launches_under_measured_fused_and_qk_winners_are_compiled(monkeypatch):
    """As above, with a table whose winners (every op) no heuristic picks: the compile check
    must follow them (``aot.table_variants``), not only the heuristics."""
    from tilegym_rms.cutile import tuning

    table = _odd_table()
    monkeypatch.setattr(tuning, "packaged_keys", lambda: [table.key])
    monkeypatch.setattr(tuning, "packaged", lambda key: table if key == table.key else None)
    _check_hosts_launches(monkeypatch, require_every_op=True)
