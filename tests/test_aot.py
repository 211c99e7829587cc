"""Compile check: every cuTile variant the dispatcher can select compiles to a cubin (no GPU needed)."""

import io
from pathlib import Path

import pytest

pytest.importorskip("cuda.tile")  # the [cuda] extra; before the kernels module, which imports it

import torch  # noqa: E402

from tilegym_rms import aot  # noqa: E402
from tilegym_rms.cutile import kernels  # noqa: E402
from tilegym_rms.reference import CASTING_CODES, DEFAULT_CASTING_MODE, GATE_CODES  # noqa: E402


def test_variants_cover_every_kernel():
    names = {v.kernel_name for v in aot.variants()}
    launched = {
        "rms_norm_fwd_gather",
        "rms_norm_fwd_persistent",
        "rms_norm_fwd_split",
        "rms_norm_bwd_direct",
        "rms_norm_bwd_persistent",
        "rms_norm_bwd_row_dot",
        "rms_norm_bwd_column_chunk",
        "rms_norm_dw_reduce",
        "qk_rms_norm_fwd",
        "qk_rms_norm_bwd",
        "gated_rms_norm_fwd",
        "gated_rms_norm_bwd",
        "rms_norm_fp8_fwd",
    }
    assert names == launched
    assert all(hasattr(kernels, n) for n in names)


def test_arithmetic_axes_are_compiled_for_every_kernel_class():
    """Each casting mode, the no-weight and (gather) the no-rstd forward, and the no-weight backward, appear
    for every forward kernel and each backward kernel: the axes TILE_CLASS_N keeps to a few widths."""
    vs = aot.variants()

    def constants(name):
        return [v.constants() for v in vs if v.kernel_name == name]

    casts = set(CASTING_CODES.values())
    for name in ("rms_norm_fwd_gather", "rms_norm_fwd_persistent", "rms_norm_fwd_split"):
        plain = [c for c in constants(name) if c["ADD"] == 0]
        assert {(c["CAST"], c["HAS_W"]) for c in plain} >= {
            *((cast, True) for cast in casts),
            (CASTING_CODES[DEFAULT_CASTING_MODE], False),
        }, name
    assert {c["STORE_RSTD"] for c in constants("rms_norm_fwd_gather") if c["ADD"] == 0} == {True, False}
    for name in ("rms_norm_bwd_direct", "rms_norm_bwd_persistent", "rms_norm_bwd_column_chunk"):
        assert {c["HAS_W"] for c in constants(name)} == {True, False}, name


def test_one_variant_of_each_kernel_compiles():
    """What a plain ``pytest`` compiles, in about a minute on two cores: the first variant of each kernel, for
    the shipped table's arch. The exhaustive check below builds every variant for every arch."""
    first = {}
    for v in aot.variants("sm_90"):
        first.setdefault(v.kernel_name, v)
    out = io.StringIO()
    failures = aot.run(("sm_90",), jobs=2, out=out, only=list(first.values()))
    assert failures == 0, out.getvalue()
    assert f"{len(first)} compiled, 0 failed" in out.getvalue()
    assert set(first) == {v.kernel_name for v in aot.variants()}


@pytest.mark.exhaustive
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
    heuristic = set(aot.variants("sm_100"))
    assert winners - heuristic, "the H100 table launches variants the heuristics never do"
    assert set(aot.variants("sm_90")) == heuristic | winners
    no_fp8 = {v for v in heuristic if v.kernel_name != aot.FP8_KERNEL}  # sm_80 has no fp8 types
    for arch in set(aot.ARCHS) - table_archs:
        assert aot.table_variants(arch) == [], arch
        assert set(aot.variants(arch)) == (heuristic if aot.fp8_arch(arch) else no_fp8), arch


def test_the_shipped_tables_measured_winners_are_those_of_their_sweeps_tables(monkeypatch):
    """A shipped table keeps the winners of its sweep's full table and which runs were measured
    (``build.slim``), so the compile check builds the same table variants from either."""
    from tilegym_rms.cutile import tuning

    repo = Path(__file__).resolve().parents[1]
    full = {t.key: t for t in map(tuning.load, repo.glob("bench/results/*/sweeps/table_*_candidates.json"))}
    shipped = set(aot.table_variants())
    assert full and shipped
    packaged = tuning.packaged
    monkeypatch.setattr(tuning, "packaged", lambda key: full.get(key) or packaged(key))
    assert set(aot.table_variants()) == shipped


def test_qk_variants_cover_the_head_dims_and_both_kernels():
    """The qk variants reach each representative head dim's tile width, and the heads held as a tile and a tail,
    forward and backward."""
    qk = aot.qk_variants()
    assert {v.kernel_name for v in qk} == {"qk_rms_norm_fwd", "qk_rms_norm_bwd", "rms_norm_dw_reduce"}
    widths = {(v.constants()["TILE_N"], v.constants()["TAIL_N"]) for v in qk if v.kernel_name == "qk_rms_norm_bwd"}
    assert widths == {(d, 0) for d in aot.QK_REPRESENTATIVE_D} | {(64, d - 64) for d in aot.QK_TAIL_D}
    tails = {v.constants()["TAIL_N"] for v in qk if v.kernel_name == "qk_rms_norm_fwd"}
    assert tails == {0, 16, 32}
    assert set(qk) <= set(aot.variants())  # the full check compiles them too


def test_gated_variants_cover_the_tile_classes_and_axes():
    """The gated variants reach each group tile of GATED_SHAPES (a padded group, groups padded to a power of two
    in count, and the tile and tail a table's settings give), both orders of norm and gate, every casting mode (with
    either gate), the no-weight and no-rstd forward, and an fp32 gate beside bf16 x."""
    gated = aot.gated_variants()
    assert {v.kernel_name for v in gated} == {"gated_rms_norm_fwd", "gated_rms_norm_bwd", "rms_norm_dw_reduce"}
    fwd = [v for v in gated if v.kernel_name == "gated_rms_norm_fwd"]
    tiles = {(c["TILE_G"], c["TILE_S"], c["TAIL_S"]) for c in (v.constants() for v in fwd)}
    padded = {(1, 128, 0), (1, 8192, 0), (4, 512, 0), (32, 128, 0), (8, 1024, 0)}
    # A table that sets gated_fwd_tail_min_group (the H200's) holds 5120 and groups of 96 as a tile and a tail.
    assert tiles == padded | {(1, 4096, 1024), (32, 64, 32)}
    assert {c["CAST"] for c in (v.constants() for v in fwd)} == set(CASTING_CODES.values())
    sigmoid = [c for c in (v.constants() for v in fwd) if c["GATE"] == GATE_CODES["sigmoid"]]
    assert {c["CAST"] for c in sigmoid} == set(CASTING_CODES.values())
    assert {c["NORM_BEFORE_GATE"] for c in sigmoid} == {True, False}
    axes = {(c["HAS_W"], c["NORM_BEFORE_GATE"], c["STORE_RSTD"]) for c in (v.constants() for v in fwd)}
    assert axes >= {(False, True, True), (True, True, False), (True, False, True)}
    bwd = [v for v in gated if v.kernel_name == "gated_rms_norm_bwd"]
    assert {(v.constants()["HAS_W"], v.constants()["NORM_BEFORE_GATE"]) for v in bwd} == {
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    }
    assert {v.constants()["GATE"] for v in bwd} == set(GATE_CODES.values())
    assert ("array", torch.float32, 3) in {v.params[2] for v in bwd}  # the gate of bf16 x in fp32
    # The grouped backward with a 16-bit gate at both of its warp settings, before the gate (1536 in groups of 512
    # is a tile row of 2048 padded columns: gated_bwd_grouped_before_*)
    grouped = [v for v in bwd if v.constants()["TILE_G"] > 1 and v.params[2] == ("array", torch.bfloat16, 3)]
    warps = {(v.constants()["NORM_BEFORE_GATE"], dict(v.hints).get("num_worker_warps", 0)) for v in grouped}
    assert {(True, 8), (True, 0), (False, 0)} <= warps
    assert set(gated) <= set(aot.variants())  # the full check compiles them too


def test_fp8_variants_cover_every_quantization_mode_and_switch():
    """Each quantization mode at one row per tile and at several, and each switch of the FP8 kernel."""
    from tilegym_rms.cutile.host import fp8

    vs = aot.fp8_variants()
    assert {v.kernel_name for v in vs} == {"rms_norm_fp8_fwd"}
    consts = [v.constants() for v in vs]
    modes = {(c["QUANT"], c["GROUP"]) for c in consts}
    assert modes == {(fp8.QUANT_STATIC, 1), (fp8.QUANT_TOKEN, 1), (fp8.QUANT_GROUP, 64), (fp8.QUANT_GROUP, 128)}
    for mode in modes:
        assert {c["TILE_M"] > 1 for c in consts if (c["QUANT"], c["GROUP"]) == mode} == {True, False}, mode
    for switch in ("HAS_UB", "UE8M0", "HAS_W"):
        assert {c[switch] for c in consts} == {True, False}, switch
    assert {c["ADD"] for c in consts} == {0, 1}
    assert {c["CAST"] for c in consts} == set(CASTING_CODES.values())
    # y_q: value by value (an fp8 array) in the modes that store so and where a row is not whole int64 words, else
    # its int64 view holding either fp8 format's codes
    stores = {(c["WORDS"], v.params[2][1]) for c, v in zip(consts, vs, strict=True)}
    assert stores == {
        (fp8.WORDS_NONE, torch.float8_e4m3fn),
        (fp8.WORDS_NONE, torch.float8_e5m2),
        (fp8.WORDS_E4M3, torch.int64),
        (fp8.WORDS_E5M2, torch.int64),
    }
    # a row as one tile, and as a tile and a tail in every mode, stored either way
    assert {c["TAIL_N"] > 0 for c in consts} == {True, False}
    tails = {((c["QUANT"], c["GROUP"]), c["WORDS"] != fp8.WORDS_NONE) for c in consts if c["TAIL_N"]}
    assert {mode for mode, _ in tails} == modes and {words for _, words in tails} == {True, False}
    assert set(vs) <= set(aot.variants())


@pytest.mark.exhaustive
@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("op", ["qk", "gated", "fp8"])
def test_op_variants_compile(op, arch):
    """Only one op's variants, for work on its kernels (a few minutes; the full check about twenty):
    `pytest tests/test_aot.py -m exhaustive -k qk` (or gated, fp8)."""
    out = io.StringIO()
    only = getattr(aot, f"{op}_variants")()
    failures = aot.run((arch,), jobs=4, out=out, only=only)
    assert failures == 0, out.getvalue()
    assert f"{len(only)} compiled, 0 failed" in out.getvalue()


def _measured_points(op):
    """(key, sms, m, n, dtype) at every measured run of ``op`` in the shipped tables: where a sweep may have
    picked a variant the heuristics never launch. For the fused forward, every measured run of the entry its
    host's lookup takes at a width (``tuning.fallback_chain``: its own fused entry, else the other 16-bit dtype's,
    else the plain forward's), in each dtype."""
    from tilegym_rms.cutile import tuning

    for key in tuning.packaged_keys():
        doc = tuning.packaged(key).doc
        if op != "fused_forward":
            entries = [(dt, n_b, runs, dt) for dt, by_n in doc.get(op, {}).items() for n_b, runs in by_n.items()]
        else:
            entries = []
            for user in tuning.DTYPES:
                for n_b in {n for o in ("fused_forward", "forward") for by_n in doc.get(o, {}).values() for n in by_n}:
                    has = lambda o, d, n_b=n_b, doc=doc: n_b in doc.get(o, {}).get(d, {})  # noqa: E731
                    step = tuning.serving_entry("fused_forward", user, has)
                    if step is not None:
                        entries.append((step[1], n_b, doc[step[0]][step[1]][n_b], user))
        for _dt, n_b, runs, user in entries:
            for run in runs:
                if "gbps" in run:
                    yield key, doc["device"]["sms"], run["m"], int(n_b), tuning.DTYPES[user]


def _meta(dtype, *shape):
    return torch.empty(shape, dtype=dtype, device="meta")


def _host_call(cutile, op, m, n, dtype):
    """The host calls of a training step for ``op`` at ``(m, n)``, on meta tensors (a weight of x's dtype):
    the forward, the fused add's forward in both modes, the backward with and without the residual gradient,
    or the qk forward and backward (q and k of the sweep's heads, n their head dim)."""
    from tilegym_rms.cutile.tuning import build

    x, w, rstd = _meta(dtype, m, n), _meta(dtype, n), _meta(torch.float32, m)
    if op == "forward":
        cutile.forward(x, w, 1e-6, 0.0, DEFAULT_CASTING_MODE)
    elif op == "fused_forward":
        for mode in ("pre", "post"):
            cutile.fused_add_forward(x, _meta(dtype, m, n), w, 1e-6, 0.0, DEFAULT_CASTING_MODE, mode=mode)
    elif op == "backward":
        cutile.backward(x, x, w, rstd, 0.0, DEFAULT_CASTING_MODE)
        cutile.fused_add_backward(x, x, x, w, rstd, 0.0, DEFAULT_CASTING_MODE)
    else:
        tokens = build.qk_sweep_tokens(m)  # dense (tokens, heads, n) tensors, viewed as ops views them
        q, k = (_meta(dtype, 1, 1, tokens * heads, n) for heads in build.QK_SWEEP_HEADS)
        _, _, rq, rk = cutile.qk_forward(q, k, w, w, 1e-6, 0.0, DEFAULT_CASTING_MODE)
        cutile.qk_backward(q, k, q, k, w, w, rq, rk, 0.0, DEFAULT_CASTING_MODE)


def _check_hosts_launches(monkeypatch, require_every_op=False):
    """Every launch the host's own functions make at each measured table point (:func:`_host_call`, on a
    device of the table's class) is a variant the compile check builds: the same kernel, argument dtypes and
    ranks, constants, and the build of its hints."""
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import launch, tuning
    from tilegym_rms.cutile.host import common
    from tilegym_rms.experimental import kernel_name

    compiled = set(aot.variants())
    launched = []
    monkeypatch.setattr(common, "launcher", lambda: lambda *launch_args: launched.append(launch_args))
    checked = dict.fromkeys(("forward", "fused_forward", "backward", "qk"), 0)
    for op in checked:
        for key, sms, m, n, dtype in _measured_points(op):
            monkeypatch.setattr(launch, "num_sms", lambda index, sms=sms: sms)
            monkeypatch.setattr(tuning, "device_key", lambda index, key=key: key)
            launched.clear()
            with tuning.use_table("packaged"):  # clears the host caches on the way in and out
                _host_call(cutile, op, m, n, dtype)
            assert launched, (op, m, n)
            for kernel, _grid, args, _dev, hints, built in launched:
                v = aot.Variant(kernel_name(kernel), aot.params_of(args), hints)
                assert v in compiled, (op, key, m, n, dtype, v.describe())
                assert built is launch.with_hints(kernel, hints), v.describe()  # the build that runs
            checked[op] += 1
    assert checked["forward"], "the shipped tables hold no measured point"
    if require_every_op:
        assert all(checked.values()), checked


def test_the_hosts_launches_under_the_shipped_tables_are_compiled(monkeypatch):
    _check_hosts_launches(monkeypatch)


def _odd_table():
    """A table of measured winners the heuristics never pick, for every op a sweep writes."""
    from dataclasses import asdict

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


def test_the_fp8_kernel_is_compiled_only_for_archs_with_fp8_types():
    """tileiras refuses float8 on sm_80: the compile check leaves the FP8 kernel out there (the host quantizes
    after the norm on such cards) and keeps it for sm_90 and newer."""
    for arch in aot.ARCHS:
        has_fp8 = any(v.kernel_name == aot.FP8_KERNEL for v in aot.variants(arch))
        assert has_fp8 == (arch != "sm_80"), arch


def test_the_compile_check_builds_the_fp8_and_gated_launches_a_tables_settings_give(monkeypatch):
    """A shipped table's ``heuristics`` change its card's FP8 and gated tiles: the compile check builds those
    variants beside the reference target's."""
    from tilegym_rms.cutile import tuning

    h200, packaged = tuning.packaged("sm90_132sm.nvidia-h200"), tuning.packaged
    plain_doc = {k: v for k, v in h200.doc.items() if k != "heuristics"}

    def variants_with(doc):
        table = tuning.Table(doc)
        monkeypatch.setattr(tuning, "packaged", lambda key: table if key == h200.key else packaged(key))
        return set(aot.fp8_variants()), set(aot.gated_variants())

    before_fp8, before_gated = variants_with(plain_doc)
    fp8, gated = variants_with({**plain_doc, "heuristics": {"fp8_tile_elems": 8192, "gated_bwd_tile_elems": 4096}})
    assert before_fp8 < fp8 and before_gated < gated
    # the FP8 tiles of 8192 elements: 2 rows of 4096 columns, where the reference target's hold 4
    rows_4096 = {
        v.constants()["TILE_M"]
        for v in fp8 - before_fp8
        if (v.constants()["TILE_N"], v.constants()["TAIL_N"]) == (4096, 0)
    }
    assert rows_4096 == {2}
