"""The cuTile launch heuristics (pure functions: no GPU needed)."""

import pytest
import torch

from tilegym_rms.cutile import config

SMS = 132


@pytest.mark.parametrize("n", [1, 64, 123, 512, 1000, 2001, 4096, 5120, 7168, 8192, 16384, 65536])
@pytest.mark.parametrize("m", [1, 7, 128, 4097, 65536])
def test_forward_config_invariants(m, n):
    cfg = config.forward_config(m, n, torch.bfloat16, SMS)
    assert cfg.tile_n & (cfg.tile_n - 1) == 0 and cfg.tile_m & (cfg.tile_m - 1) == 0
    if cfg.mode == "persistent":
        most = max(config.FWD_NARROW_BLOCKS_PER_SM, config.FWD_WIDE_BLOCKS_PER_SM, config.FWD_TINY_BLOCKS_PER_SM)
        assert cfg.tile_n + cfg.tail_n >= n and 1 <= cfg.grid <= SMS * most
        assert cfg.grid <= config.cdiv(m, cfg.tile_m)
    else:
        assert cfg.grid == m and cfg.single_tile == (cfg.tile_n >= n)


def test_forward_dispatch_thresholds():
    small_m = config.GATHER_MAX_ROWS_PER_SM * SMS
    assert config.forward_config(small_m, 4096, torch.bfloat16, SMS).mode == "gather"
    assert config.forward_config(small_m + 1, 4096, torch.bfloat16, SMS).mode == "persistent"
    wide = 2 * config.FWD_MAX_SINGLE_TILE_N
    cfg = config.forward_config(65536, wide, torch.bfloat16, SMS)
    assert cfg.mode == "gather" and not cfg.single_tile and cfg.tile_n == config.FWD_CHUNK_N
    cfg = config.forward_config(65536, config.FWD_MAX_SINGLE_TILE_N, torch.bfloat16, SMS)
    assert cfg.mode == "gather" and cfg.single_tile and cfg.tile_n == config.FWD_MAX_SINGLE_TILE_N
    forced = config.forward_config(65536, config.FWD_MAX_PERSISTENT_TILE_N, torch.bfloat16, SMS, mode="persistent")
    assert forced.mode == "persistent"
    with pytest.raises(ValueError, match="mode='gather'"):
        config.forward_config(65536, 2 * config.FWD_MAX_PERSISTENT_TILE_N, torch.bfloat16, SMS, mode="persistent")
    with pytest.raises(ValueError, match="mode must be one of"):
        config.forward_config(8, 8, torch.bfloat16, SMS, mode="fast")


@pytest.mark.parametrize("n", [1, 123, 3072, 4096, 5120, 7168, 8192, 8193, 12288, 65536])
@pytest.mark.parametrize("m", [1, 7, 4097, 65536])
def test_backward_config_invariants(m, n):
    cfg = config.backward_config(m, n, torch.bfloat16, SMS)
    assert 1 <= cfg.grid <= max(m, 1)
    assert cfg.tile_m & (cfg.tile_m - 1) == 0
    if cfg.mode == "direct":
        assert cfg.tile_n == config.next_pow2(n) and cfg.grid * cfg.tile_m >= m
        assert cfg.num_chunks * cfg.strip_n >= n and cfg.strip_m * cfg.strip_n == config.BWD_DIRECT_STRIP_ELEMS
    elif cfg.mode == "fused":
        assert (cfg.tile_n, cfg.tail_n) == config.split_row(n) and cfg.num_chunks == 1
    else:
        assert cfg.num_chunks * cfg.tile_n >= n and next_pow2_gt(n)


def test_backward_is_one_launch_for_few_rows_of_one_tile():
    few = config.BWD_DIRECT_MAX_ROWS_PER_SM * SMS
    assert config.backward_config(few, 4096, torch.bfloat16, SMS).mode == "direct"
    assert config.backward_config(few + 1, 4096, torch.bfloat16, SMS).mode == "fused"
    wider = 2 * config.BWD_DIRECT_MAX_TILE_N
    assert config.backward_config(8, wider, torch.bfloat16, SMS).mode == "fused"
    assert config.backward_config(8, 2 * config.BWD_MAX_SINGLE_TILE_N, torch.bfloat16, SMS).mode == "chunked"
    strips = config.backward_config(8, 4096, torch.bfloat16, SMS)
    assert strips.strip_n == config.BWD_DIRECT_MIN_STRIP_N  # 4096 / 132 SMs: the narrowest strip
    assert config.backward_config(8, 4096, torch.bfloat16, 16).strip_n == config.BWD_DIRECT_MAX_STRIP_N


def next_pow2_gt(n):
    return config.next_pow2(n) > config.BWD_MAX_SINGLE_TILE_N


def test_tiles_do_not_depend_on_m_within_a_bucket():
    a = config.forward_config(5000, 4096, torch.bfloat16, SMS)
    b = config.forward_config(config.m_bucket(5000), 4096, torch.bfloat16, SMS)
    assert (a.mode, a.tile_m, a.tile_n) == (b.mode, b.tile_m, b.tile_n)


@pytest.mark.parametrize("n", [1, 64, 1000, 2048, 4096, 8192, 16384, 32768, 65536, 262144])
def test_reduce_config_fills_the_sms_and_covers_n(n):
    red = config.reduce_config(n, SMS)
    assert config.REDUCE_MIN_TILE_N <= red.tile_n <= config.REDUCE_MAX_TILE_N
    assert red.grid * red.tile_n >= n and red.tile_g * red.tile_n == config.REDUCE_TILE_ELEMS
    if n >= SMS * config.REDUCE_MIN_TILE_N:
        assert red.grid >= SMS  # at least one block per SM whenever N allows it


def test_compiler_hints_follow_the_tile_width():
    """Narrow tiles get the occupancy hint; wide backward tiles one block per SM with 8 warps (NOTES
    experiments 6 and 10); a zero constant sets no hint."""
    narrow_f = config.forward_config(8192, 4096, torch.bfloat16, SMS)  # persistent below GATHER_PREFERRED_MIN_M
    assert narrow_f.hints == (("occupancy", config.FWD_NARROW_OCCUPANCY),)
    assert narrow_f.grid == SMS * config.FWD_NARROW_BLOCKS_PER_SM
    assert config.forward_config(65536, 1024, torch.bfloat16, SMS).grid == SMS * config.FWD_TINY_BLOCKS_PER_SM
    assert config.forward_config(4097, 8192, torch.bfloat16, SMS).hints == ()  # persistent, wide
    narrow_b = config.backward_config(65536, 5120, torch.bfloat16, SMS)  # 4096 + 1024: still narrow
    assert narrow_b.hints == (("occupancy", config.BWD_NARROW_OCCUPANCY),)
    wide_b = config.backward_config(65536, config.BWD_MAX_SINGLE_TILE_N, torch.bfloat16, SMS)
    assert wide_b.mode == "fused" and wide_b.grid == SMS * config.BWD_WIDE_BLOCKS_PER_SM
    assert dict(wide_b.hints) == {
        "occupancy": config.BWD_WIDE_OCCUPANCY,
        "num_worker_warps": config.BWD_WIDE_WORKER_WARPS,
    }


def test_gather_hints_follow_the_tile_width_table():
    table = {widest: (o, w) for widest, o, w in config.GATHER_SINGLE_TILE_HINTS}
    assert max(table) == config.FWD_MAX_SINGLE_TILE_N  # every single-tile row finds an entry
    for n, widest in ((1000, 2048), (2048, 2048), (3000, 4096), (5120, 8192), (16384, 16384), (20000, 32768)):
        occupancy, warps = table[widest]
        cfg = config.forward_config(8, n, torch.bfloat16, SMS)
        assert cfg.mode == "gather" and cfg.single_tile
        assert dict(cfg.hints) == {k: v for k, v in (("occupancy", occupancy), ("num_worker_warps", warps)) if v}
    chunked = config.forward_config(8, 2 * config.FWD_MAX_SINGLE_TILE_N, torch.bfloat16, SMS)
    occupancy, warps = config.GATHER_CHUNKED_HINTS
    assert not chunked.single_tile and dict(chunked.hints) == {"occupancy": occupancy, "num_worker_warps": warps}


def test_gather_is_preferred_at_large_m_from_its_measured_width():
    big = config.GATHER_PREFERRED_MIN_M
    for n in (config.GATHER_PREFERRED_MIN_N, 4096, 6144, 7168, config.GATHER_PREFERRED_MAX_N):
        assert config.forward_config(big, n, torch.bfloat16, SMS).mode == "gather"
        assert config.forward_config(big // 2, n, torch.bfloat16, SMS).mode == "persistent"
    # 5120 fills 62.5% of its 8192-wide tile: gather in fp32 only (GATHER_PREFERRED_MIN_FILL_16BIT)
    assert config.forward_config(big, 5120, torch.float32, SMS).mode == "gather"
    for dtype in (torch.bfloat16, torch.float16):
        assert config.forward_config(big, 5120, dtype, SMS).mode == "persistent"
    for n in (config.GATHER_PREFERRED_MIN_N - 1, config.GATHER_PREFERRED_MAX_N + 1, 12288):
        assert config.forward_config(big, n, torch.bfloat16, SMS).mode == "persistent"
    for m in (big // 2, big):  # from GATHER_MIN_N on, at every M
        assert config.forward_config(m, config.GATHER_MIN_N, torch.bfloat16, SMS).mode == "gather"


def test_persistent_forward_splits_only_rows_padded_to_the_split_width():
    wide = config.forward_config(65536, 12288, torch.bfloat16, SMS, mode="persistent")
    assert (wide.tile_n, wide.tail_n) == (8192, 4096)
    assert config.FWD_SPLIT_MIN_TILE_N > 8192  # 5120 keeps one padded 8192-wide tile
    narrow = config.forward_config(8192, 5120, torch.bfloat16, SMS)
    assert narrow.mode == "persistent" and (narrow.tile_n, narrow.tail_n) == (8192, 0)


def test_split_row_is_exact_for_common_widths_and_never_wider_than_padding():
    assert config.split_row(5120) == (4096, 1024)
    assert config.split_row(6144) == (4096, 2048)
    assert config.split_row(12288) == (8192, 4096)
    assert config.split_row(7168) == (8192, 0)  # 4096 + 4096 would be no narrower than one 8192 tile
    assert config.split_row(4096) == (4096, 0)
    for n in range(1, 20000, 7):
        head, tail = config.split_row(n)
        assert head & (head - 1) == 0 and tail & (tail - 1) == 0 and tail < head
        assert n <= head + tail <= config.next_pow2(n) and (tail == 0 or head < n)
