"""The batch-invariant mode without a GPU: the switch (tilegym_rms.batch_invariance) and what it makes each
backend launch. In the mode, the cuTile host's launches for an (N, dtype) must be the same at every M bucket
and be kernels that compute each row once, outside any row loop; Triton's row tile and schedule must not follow
M. test_batch_invariance_gpu.py checks the resulting bits on a GPU."""

import os
import subprocess
import sys

import pytest
import torch

import tilegym_rms
from tilegym_rms import aot, batch_invariance
from tilegym_rms.cutile import config, tuning
from tilegym_rms.cutile.host import backward as cutile_backward
from tilegym_rms.cutile.host import forward as cutile_forward
from tilegym_rms.cutile.host.common import Target
from tilegym_rms.triton import config as triton_config

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SMS = aot.REFERENCE_SMS
# Every M bucket and the M just above each power of two (where the default path changes its launch).
MS = sorted({1 << k for k in range(23)} | {(1 << k) + 1 for k in range(23)})
# Every tile class: short rows, tile plus tail widths, the direct backward's widest (4096) and beyond, the widest
# single tiles, column chunks; N points of the shipped table and points between them.
WIDTHS = (64, 96, 128, 1000, 3072, 4096, 5120, 7168, 8192, 12288, 16384, 24576, 32768, 65536, 100000)
# The cuTile kernels without a row loop: one row per block (gather), one row tile per block and dw strips (direct).
LOOP_FREE = {"rms_norm_fwd_gather", "rms_norm_bwd_direct"}


@pytest.fixture(autouse=True)
def _restore_mode():
    saved = batch_invariance._enabled
    yield
    batch_invariance._enabled = saved


def _fresh(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != batch_invariance.ENV} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)


@pytest.mark.parametrize("value,expected", [(None, False), ("1", True), ("true", True), ("0", False), ("", False)])
def test_environment_variable_sets_the_mode_at_first_use(value, expected):
    env = {} if value is None else {batch_invariance.ENV: value}
    out = _fresh("import tilegym_rms; print(tilegym_rms.is_batch_invariant())", **env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expected)


def test_a_bad_environment_value_is_a_one_line_error():
    out = _fresh("import tilegym_rms; tilegym_rms.is_batch_invariant()", **{batch_invariance.ENV: "maybe"})
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: TILEGYM_RMS_BATCH_INVARIANT must be 1 or 0") and "'maybe'" in last


def test_setter_and_context_manager():
    tilegym_rms.set_batch_invariant(False)
    with tilegym_rms.batch_invariant():
        assert tilegym_rms.is_batch_invariant()
        with tilegym_rms.batch_invariant(False):
            assert not tilegym_rms.is_batch_invariant()
        assert tilegym_rms.is_batch_invariant()
    assert not tilegym_rms.is_batch_invariant()
    with pytest.raises(TypeError, match="takes True or False"):
        tilegym_rms.set_batch_invariant("0")


def test_the_setter_overrides_the_environment():
    code = "import tilegym_rms; tilegym_rms.set_batch_invariant(False); print(tilegym_rms.is_batch_invariant())"
    out = _fresh(code, **{batch_invariance.ENV: "1"})
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------------------------------
# cuTile: the host's launches, recorded on meta tensors as the compile check records them
# ------------------------------------------------------------------------------------------------


def _tables():
    return [pytest.param(None, id="heuristics"), *(pytest.param(k, id=k) for k in tuning.packaged_keys())]


def _launches(m, n, dtype, table, fused):
    if fused:
        return aot.fused_add_variants_for(m, n, dtype, dtype, SMS, (None,), table, invariant=True)
    return aot.variants_for(m, n, dtype, SMS, (None,), True, table, invariant=True)


@pytest.mark.parametrize("fused", [False, True], ids=["norm", "fused_add"])
@pytest.mark.parametrize("table_key", _tables())
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
def test_cutile_launches_are_the_same_at_every_m_and_loop_free(dtype, table_key, fused):
    table = tuning.packaged(table_key) if table_key else None
    for n in WIDTHS:
        at_one = _launches(1, n, dtype, table, fused)
        assert {v.kernel_name for v in at_one} - {"rms_norm_dw_reduce"} <= LOOP_FREE, (n, at_one)
        assert "rms_norm_dw_reduce" not in {v.kernel_name for v in at_one}, n  # the direct backward sums dw itself
        for m in MS:
            assert _launches(m, n, dtype, table, fused) == at_one, (n, m)


@pytest.mark.parametrize("table_key", _tables())
def test_cutile_mode_forward_is_the_one_row_launch(table_key):
    """The mode's forward is what the default path launches for a single row, so decoding one token costs the same."""
    target = Target(SMS, tuning.packaged(table_key) if table_key else None)
    invariant = Target(SMS, target.table, True)
    for n in WIDTHS:
        for op in ("forward", "fused_forward"):
            assert cutile_forward.config_for(invariant, 1, n, BF16, None, op) == cutile_forward.config_for(
                target, 1, n, BF16, None, op
            )
            assert cutile_forward.config_for(invariant, 4096, n, BF16, None, op).grid == 4096  # one block per row


def test_cutile_mode_backward_widths():
    """Whole padded rows in one tile up to bwd_max_single_tile_n (the direct strategy's usual limit is 4096
    columns), column chunks beyond, and a dx block never loops: one row per block, so that a row is always the
    first of its tile (a row's place in a tile of several can change its reduction order)."""
    p = config.HEURISTICS
    for n in WIDTHS:
        cfg = cutile_backward.config_for(Target(SMS, None, True), 10_000, n, BF16)
        assert cfg.strategy == "direct"
        assert (cfg.tile_m, cfg.grid) == (1, 10_000)
        if config.next_pow2(n) <= p.bwd_max_single_tile_n:
            assert cfg.tile_n == config.next_pow2(n)
        else:
            assert cfg.tile_n == p.bwd_chunk_n


@pytest.mark.parametrize("kernel", ["persistent", "tiles"])
def test_cutile_mode_refuses_the_row_tile_forwards(kernel):
    with pytest.raises(ValueError, match=f"kernel='{kernel}' puts rows in tiles that follow M and is not batch"):
        cutile_forward.config_for(Target(SMS, None, True), 4096, 4096, BF16, kernel)


# ------------------------------------------------------------------------------------------------
# Triton
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", triton_config.OPS)
@pytest.mark.parametrize("n", [1, 64, 512, 1000, 4096, 5120, 65536])
def test_triton_mode_tiles_do_not_follow_m(n, op):
    first = triton_config.choose_tiles(1, n, BF16, op, invariant=True)
    assert first.path in ("block", "partitioned")
    for m in MS:
        tiles = triton_config.choose_tiles(m, n, BF16, op, invariant=True)
        assert (tiles.path, tiles.block_m, tiles.block_n) == (first.path, first.block_m, first.block_n), m


def test_triton_mode_refuses_the_block_row_path():
    with pytest.raises(ValueError, match="'block_row'.*not batch invariant"):
        triton_config.choose_tiles(8192, 64, BF16, "forward", "block_row", invariant=True)
