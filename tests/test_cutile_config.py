"""The cuTile launch heuristics (pure functions: no GPU needed).

The forward's decisions are tested through the host (``tilegym_rms.cutile``), which hands the
heuristic M's power-of-two bucket, not M: the kernel an M gets is the one its bucket gets.
"""

from dataclasses import replace

import pytest
import torch

from tilegym_rms.cutile import config

SMS = 132  # an H100
BF16 = torch.bfloat16


@pytest.fixture
def host(monkeypatch):
    """The cuTile host modules (:mod:`tilegym_rms.cutile.host`) with an H100's SM count, empty caches and no
    tuning table (these tests are about the analytic heuristics; tests/test_tuning.py covers the tables);
    nothing launches (``cuda.tile`` imports without a GPU or driver)."""
    pytest.importorskip("cuda.tile")
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import host, launch, tuning

    monkeypatch.setattr(launch, "num_sms", lambda index: SMS)
    with tuning.use_table(None):
        yield host
    cutile.clear_caches()


def fwd(host, m, n, dtype=BF16, kernel=None) -> config.ForwardConfig:
    """The forward configuration the product uses for an (m, n) input (device index irrelevant here)."""
    return host.forward.cached_config(0, m, n, dtype, kernel)


def fwd_kernel(host, m, n, dtype=BF16) -> str:
    """One of config.FORWARD_KERNELS: the forward kernel the product launches for an (m, n) input (the persistent
    kernel with its last constant, WALK, off runs one tile per block: "tiles")."""
    add = host.forward.ADD_NONE
    launch = host.forward.cached_launch(0, m, n, dtype, None, "llama", True, True, add)
    kernels = host.common.kernels()
    if launch.kernel is kernels.rms_norm_fwd_gather:
        return "gather"
    assert launch.kernel is kernels.rms_norm_fwd_persistent
    return "persistent" if launch.constants[-1] else "tiles"


@pytest.mark.parametrize("n", [1, 64, 123, 512, 1000, 2001, 4096, 5120, 7168, 8192, 16384, 65536])
@pytest.mark.parametrize("m", [1, 7, 128, 4097, 65536])
def test_forward_config_invariants(m, n):
    cfg = config.forward_config(m, n, torch.bfloat16, SMS)
    assert cfg.tile_n & (cfg.tile_n - 1) == 0 and cfg.tile_m & (cfg.tile_m - 1) == 0
    if cfg.kernel == "persistent":
        most = max(
            config.HEURISTICS.fwd_narrow_blocks_per_sm,
            config.HEURISTICS.fwd_wide_blocks_per_sm,
            config.HEURISTICS.fwd_tiny_blocks_per_sm,
        )
        assert cfg.tile_n + cfg.tail_n >= n and 1 <= cfg.grid <= SMS * most
        assert cfg.grid <= config.cdiv(m, cfg.tile_m)
    elif cfg.kernel == "tiles":
        assert cfg.tile_n + cfg.tail_n >= n and cfg.grid == config.cdiv(m, cfg.tile_m)
    else:
        assert cfg.grid == m and cfg.single_tile == (cfg.tile_n >= n)


def test_forward_dispatch_thresholds(host):
    # Few rows: gather while M's bucket has at most GATHER_MAX_ROWS_PER_SM rows per SM: up to 512 rows on 132
    # SMs (bucket 512 <= 528). 513 to 528 rows are in bucket 1024 and take the persistent kernel.
    few = config.prev_pow2(config.HEURISTICS.gather_max_rows_per_sm * SMS)
    assert few == 512
    assert fwd_kernel(host, few, 4096) == "gather" and fwd(host, few, 4096).grid == few
    for m in (
        few + 1,
        config.HEURISTICS.gather_max_rows_per_sm * SMS,
        config.HEURISTICS.gather_max_rows_per_sm * SMS + 1,
    ):
        assert fwd_kernel(host, m, 4096) == "persistent", m
    wide = 2 * config.HEURISTICS.fwd_max_single_tile_n
    cfg = fwd(host, 65536, wide)
    assert cfg.kernel == "gather" and not cfg.single_tile and cfg.tile_n == config.HEURISTICS.fwd_chunk_n
    cfg = fwd(host, 65536, config.HEURISTICS.fwd_max_single_tile_n)
    assert cfg.kernel == "gather" and cfg.single_tile and cfg.tile_n == config.HEURISTICS.fwd_max_single_tile_n
    assert fwd(host, 65536, config.HEURISTICS.fwd_max_persistent_tile_n, kernel="persistent").kernel == "persistent"
    with pytest.raises(ValueError, match="kernel='gather'"):
        fwd(host, 65536, 2 * config.HEURISTICS.fwd_max_persistent_tile_n, kernel="persistent")
    with pytest.raises(ValueError, match="kernel must be one of"):
        fwd(host, 8, 8, kernel="fast")


def test_forward_launches_the_kernel_of_the_bucket(host, monkeypatch):
    """End to end through ``cutile.forward`` (the launch stubbed): 512 rows run the gather kernel, 528
    rows (4 per SM, but bucket 1024) the persistent one."""
    import tilegym_rms.cutile as cutile

    seen = []
    monkeypatch.setattr(
        host.common,
        "launcher",
        lambda: lambda kernel, grid, args, dev, hints=(), built=None: seen.append((kernel, grid)),
    )
    w = torch.randn(4096, dtype=BF16)
    for m in (512, 528):
        cutile.forward(torch.randn(m, 4096, dtype=BF16), w, 1e-6, 0.0, "llama")
    kernels = host.common.kernels()
    assert seen[0] == (kernels.rms_norm_fwd_gather, (512,))
    tile_m = fwd(host, 528, 4096).tile_m
    assert seen[1] == (kernels.rms_norm_fwd_persistent, (config.cdiv(528, tile_m),))


@pytest.mark.parametrize("n", [1, 123, 3072, 4096, 5120, 7168, 8192, 8193, 12288, 65536])
@pytest.mark.parametrize("m", [1, 7, 4097, 65536])
def test_backward_config_invariants(m, n):
    cfg = config.backward_config(m, n, torch.bfloat16, SMS)
    assert 1 <= cfg.grid <= max(m, 1)
    assert cfg.tile_m & (cfg.tile_m - 1) == 0
    if cfg.strategy == "direct":
        assert cfg.tile_n == config.next_pow2(n) and cfg.grid * cfg.tile_m >= m
        assert (
            cfg.num_chunks * cfg.strip_n >= n and cfg.strip_m * cfg.strip_n == config.HEURISTICS.bwd_direct_strip_elems
        )
    elif cfg.strategy == "persistent":
        assert (cfg.tile_n, cfg.tail_n) == config.split_row(n) and cfg.num_chunks == 1
    else:
        assert cfg.num_chunks * cfg.tile_n >= n and next_pow2_gt(n)


def test_backward_is_one_launch_for_few_rows_of_one_tile():
    few = config.HEURISTICS.bwd_direct_max_rows_per_sm * SMS
    assert config.backward_config(few, 4096, torch.bfloat16, SMS).strategy == "direct"
    assert config.backward_config(few + 1, 4096, torch.bfloat16, SMS).strategy == "persistent"
    wider = 2 * config.HEURISTICS.bwd_direct_max_tile_n
    assert config.backward_config(8, wider, torch.bfloat16, SMS).strategy == "persistent"
    widest = config.HEURISTICS.bwd_max_single_tile_n
    assert config.backward_config(8, 2 * widest, torch.bfloat16, SMS).strategy == "chunked"
    strips = config.backward_config(8, 4096, torch.bfloat16, SMS)
    assert strips.strip_n == config.HEURISTICS.bwd_direct_min_strip_n  # 4096 / 132 SMs: the narrowest strip
    assert config.backward_config(8, 4096, torch.bfloat16, 16).strip_n == config.HEURISTICS.bwd_direct_max_strip_n


def next_pow2_gt(n):
    return config.next_pow2(n) > config.HEURISTICS.bwd_max_single_tile_n


@pytest.mark.parametrize("n", [1000, 4096, 5120, 12288, 65536])
@pytest.mark.parametrize("bucket", [512, 1024, 8192, 16384, 65536])
def test_every_m_of_a_bucket_launches_one_compiled_variant(host, bucket, n):
    """What tiles independent of M (config._tile_m) are for: every M of a power-of-two bucket launches the
    same compiled variant (kernel, constants, hints), so a new batch size compiles nothing; only the grid
    follows M, and a persistent grid never has more blocks than M has row tiles."""
    ms = sorted({bucket // 2 + 1, bucket // 2 + 7, 3 * bucket // 4, bucket - 1, bucket})
    add = host.forward.ADD_NONE
    launches = {m: host.forward.cached_launch(0, m, n, BF16, None, "llama", True, True, add) for m in ms}
    assert len({(launch.kernel, launch.constants, launch.hints) for launch in launches.values()}) == 1
    for m, launch in launches.items():
        cfg = fwd(host, m, n)
        if cfg.kernel == "gather":
            assert launch.grid == (m,)
        else:
            assert 1 <= launch.grid[0] <= config.cdiv(m, cfg.tile_m) and launch.grid[0] <= launches[bucket].grid[0]


@pytest.mark.parametrize("n", [1, 64, 1000, 2048, 4096, 8192, 16384, 32768, 65536, 262144])
def test_reduce_config_fills_the_sms_and_covers_n(n):
    red = config.reduce_config(n, SMS)
    assert config.HEURISTICS.reduce_min_tile_n <= red.tile_n <= config.HEURISTICS.reduce_max_tile_n
    assert red.grid * red.tile_n >= n and red.tile_g * red.tile_n == config.HEURISTICS.reduce_tile_elems
    if n >= SMS * config.HEURISTICS.reduce_min_tile_n:
        assert red.grid >= SMS  # at least one block per SM whenever N allows it


def test_the_reduction_takes_its_occupancy_hint(host):
    """reduce_occupancy: the dw reduction of the plain, gated and qk backward launches with that occupancy
    hint (4 by default); 0 leaves it to the compiler."""
    tgt = host.common.Target(SMS)
    m, n = 32768, 5120
    plain = host.backward.backward_launches(tgt, m, n, BF16, True, False).reduce
    gated = host.gated.backward_launches(tgt, m, n, n, BF16, BF16, True, True).reduce
    qk = host.qk.backward_launches(tgt, (1, 1, m), (1, 1, m // 4), 128, BF16, True, True, True).reduce
    assert dict(plain.hints) == {"occupancy": 4} and gated.hints == qk.hints == plain.hints
    with config.override(reduce_occupancy=0):
        bare = host.backward.backward_launches(tgt, m, n, BF16, True, False).reduce
    assert bare.hints == ()
    assert plain.constants == bare.constants  # same strips, only the hint


def test_compiler_hints_follow_the_tile_width(host):
    """Narrow tiles get the occupancy hint; wide backward tiles one block per SM with 8 warps (PERFORMANCE.md,
    "Backward" and "Wide rows"); a zero constant sets no hint."""
    narrow_f = fwd(host, 8192, 4096)  # persistent: bucket 8192 is below GATHER_PREFERRED_MIN_M
    assert narrow_f.kernel == "persistent" and narrow_f.hints == (
        ("occupancy", config.HEURISTICS.fwd_narrow_occupancy),
    )
    assert narrow_f.grid == SMS * config.HEURISTICS.fwd_narrow_blocks_per_sm
    assert fwd(host, 65536, 1024).grid == SMS * config.HEURISTICS.fwd_tiny_blocks_per_sm
    wide_f = fwd(host, 4097, 8192)
    assert wide_f.kernel == "persistent" and wide_f.hints == ()
    narrow_b = config.backward_config(65536, 5120, torch.bfloat16, SMS)  # 4096 + 1024: still narrow
    assert narrow_b.hints == (("occupancy", config.HEURISTICS.bwd_narrow_occupancy),)
    wide_b = config.backward_config(65536, config.HEURISTICS.bwd_max_single_tile_n, torch.bfloat16, SMS)
    assert wide_b.strategy == "persistent" and wide_b.grid == SMS * config.HEURISTICS.bwd_wide_blocks_per_sm
    assert dict(wide_b.hints) == {
        "occupancy": config.HEURISTICS.bwd_wide_occupancy,
        "num_worker_warps": config.HEURISTICS.bwd_wide_worker_warps,
    }


def test_one_tile_per_block_bounds(host):
    """The analytic "tiles" choice starts at fwd_tiles_min_row columns (narrower rows were not measured) and a
    forced one never stacks more than fwd_tiles_max_tile_m rows, however narrow the row."""
    p = config.HEURISTICS
    assert fwd(host, 1 << 20, p.fwd_tiles_min_row // 2).kernel == "persistent"
    assert fwd(host, 1 << 20, p.fwd_tiles_min_row).kernel == "tiles"
    for n in (1, 3, 16):
        forced = fwd(host, 4097, n, kernel="tiles")
        assert forced.kernel == "tiles" and forced.tile_m == p.fwd_tiles_max_tile_m
        assert forced.grid == config.cdiv(4097, forced.tile_m)


def test_short_16bit_rows_get_more_resident_blocks_and_short_backward_rows_taller_tiles(host):
    """Head-dim rows (PERFORMANCE.md, "Narrow rows"): the forward of 16-bit rows up to 256 padded columns raises the
    occupancy hint (8 up to 64 columns, 4 up to 256); from 2^18 rows, where N is the padded width, it launches one
    4096-element tile per block ("tiles": occupancy 8, eight warps); the padded 96 keeps the persistent walk with
    about one row tile per block from 2^20 rows; fp32 and wider rows keep the narrow class. Backward rows up to
    128 padded columns take 32 rows."""
    p = config.HEURISTICS
    tiles_hints = (("num_worker_warps", p.fwd_tiles_short_worker_warps), ("occupancy", p.fwd_tiles_short_occupancy))
    for n, occupancy in ((64, 8), (96, 4), (128, 4), (256, 4)):
        for dtype in (BF16, torch.float16):
            f = fwd(host, 65536, n, dtype)
            assert f.kernel == "persistent" and f.hints == (("occupancy", occupancy),), (n, dtype)
            assert f.grid == SMS * p.fwd_tiny_blocks_per_sm
            many = fwd(host, 3 << 20, n, dtype)  # bucket 2^22
            if n == 96:  # one row tile per block, capped by the tiles
                assert many.kernel == "persistent"
                assert many.grid == min(SMS * p.fwd_short_many_blocks_per_sm, config.cdiv(3 << 20, many.tile_m))
                continue
            for m in (p.fwd_tiles_min_m, 3 << 20):
                tiles = fwd(host, m, n, dtype)
                assert (tiles.kernel, tiles.tile_m * tiles.tile_n) == ("tiles", p.fwd_tiles_tile_elems), (n, m)
                assert tiles.grid == config.cdiv(m, tiles.tile_m) and tiles.hints == tiles_hints
            assert fwd(host, p.fwd_tiles_min_m, n, torch.float32).kernel == "persistent"
        assert fwd(host, 65536, n, torch.float32).hints == (("occupancy", p.fwd_narrow_occupancy),)
    assert fwd(host, 65536, 512).hints == (("occupancy", p.fwd_narrow_occupancy),)
    for n, tile_m in ((64, 32), (96, 32), (128, 32), (256, p.max_tile_m)):
        for dtype in (BF16, torch.float32):
            b = config.backward_config(1 << 20, n, dtype, SMS)
            assert (b.strategy, b.tile_m) == ("persistent", tile_m), (n, dtype)


def test_gather_hints_follow_the_tile_width_table(host):
    table = {widest: (o, w) for widest, o, w in config.HEURISTICS.gather_single_tile_hints}
    assert max(table) == config.HEURISTICS.fwd_max_single_tile_n  # every single-tile row finds an entry
    for n, widest in ((1000, 2048), (2048, 2048), (3000, 4096), (5120, 8192), (16384, 16384), (20000, 32768)):
        occupancy, warps = table[widest]
        cfg = fwd(host, 8, n)
        assert cfg.kernel == "gather" and cfg.single_tile
        assert dict(cfg.hints) == {k: v for k, v in (("occupancy", occupancy), ("num_worker_warps", warps)) if v}
    chunked = fwd(host, 8, 2 * config.HEURISTICS.fwd_max_single_tile_n)
    occupancy, warps = config.HEURISTICS.gather_chunked_hints
    assert not chunked.single_tile and dict(chunked.hints) == {"occupancy": occupancy, "num_worker_warps": warps}


def test_gather_is_preferred_at_large_m_from_its_measured_width(host):
    # From GATHER_PREFERRED_MIN_M on, counted on M's bucket: every M above half of it (8193 rows on).
    big = config.HEURISTICS.gather_preferred_min_m
    assert big & (big - 1) == 0
    for n in (config.HEURISTICS.gather_preferred_min_n, 4096, 6144, 7168, config.HEURISTICS.gather_preferred_max_n):
        for m in (big // 2 + 1, big, 65536):
            assert fwd_kernel(host, m, n) == "gather", (m, n)
        assert fwd_kernel(host, big // 2, n) == "persistent", n
    # 5120 fills 62.5% of its 8192-wide tile: gather in fp32 only (GATHER_PREFERRED_MIN_FILL_16BIT)
    assert fwd_kernel(host, big, 5120, torch.float32) == "gather"
    for dtype in (torch.bfloat16, torch.float16):
        assert fwd_kernel(host, big, 5120, dtype) == "persistent"
    for n in (config.HEURISTICS.gather_preferred_min_n - 1, config.HEURISTICS.gather_preferred_max_n + 1, 12288):
        assert fwd_kernel(host, big, n) == "persistent"
    for m in (8, big // 2, big):  # from GATHER_MIN_N on, at every M
        assert fwd_kernel(host, m, config.HEURISTICS.gather_min_n) == "gather", m


def test_persistent_forward_splits_only_rows_padded_to_the_split_width(host):
    wide = fwd(host, 65536, 12288)
    assert wide.kernel == "persistent" and (wide.tile_n, wide.tail_n) == (8192, 4096)
    assert config.HEURISTICS.fwd_split_min_tile_n > 8192  # 5120 keeps one padded 8192-wide tile
    narrow = fwd(host, 8192, 5120)
    assert narrow.kernel == "persistent" and (narrow.tile_n, narrow.tail_n) == (8192, 0)


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


# ------------------------------------------------------------------------------------------------
# QK-norm
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("m_k", [1, 100, 4096, 1 << 18, 1 << 22])
def test_qk_config_invariants(d, m_k):
    m_q = 4 * m_k  # GQA
    c = config.qk_config((1, 1, m_q), (1, 1, m_k), d, BF16, SMS)
    tile_n = config.next_pow2(d)  # tiles are sized by the padded head, also where it is held as head + tail
    assert c.fwd_head == (tile_n, 0) and sum(c.bwd_head) in (tile_n, d)
    for tile_m, grid, elems, blocks in (
        (c.fwd_tile_m, c.fwd_grid, config.HEURISTICS.qk_fwd_tile_elems, config.HEURISTICS.qk_fwd_blocks_per_sm),
        (c.bwd_tile_m, c.bwd_grid, config.HEURISTICS.qk_bwd_tile_elems, config.HEURISTICS.qk_bwd_blocks_per_sm),
    ):
        assert (
            tile_m & (tile_m - 1) == 0 and config.HEURISTICS.qk_min_tile_m <= tile_m <= config.HEURISTICS.qk_max_tile_m
        )
        assert tile_m * tile_n <= max(elems, config.HEURISTICS.qk_min_tile_m * tile_n)
        tiles = config.cdiv(m_q, tile_m) + config.cdiv(m_k, tile_m)
        assert 1 <= grid <= min(tiles, SMS * blocks)  # never an idle block, never more than the SMs hold
    assert dict(c.fwd_hints) == {"occupancy": config.HEURISTICS.qk_fwd_occupancy}
    assert c.fwd_tiles == ((1, c.fwd_tile_m),) * 2 and c.bwd_tiles == ((1, c.bwd_tile_m),) * 2  # dense: one run


def test_qk_tiles_are_large_at_many_rows_and_shrink_to_fill_the_sms_at_few():
    many = config.qk_config((1, 1, 1 << 22), (1, 1, 1 << 20), 128, BF16, SMS)
    assert (
        many.fwd_tile_m == config.HEURISTICS.qk_fwd_tile_elems // 128
        and many.bwd_tile_m == config.HEURISTICS.qk_bwd_tile_elems // 128
    )
    assert many.fwd_grid == SMS * config.HEURISTICS.qk_fwd_blocks_per_sm
    few = config.qk_config((1, 1, 8192), (1, 1, 2048), 128, BF16, SMS)
    assert few.fwd_tile_m < many.fwd_tile_m and config.cdiv(8192 + 2048, few.fwd_tile_m) >= SMS // 2


def test_qk_tiles_depend_on_the_rows_bucket_only():
    a = config.qk_config((1, 1, 40000), (1, 1, 10000), 128, BF16, SMS)
    b = config.qk_config((1, 1, 50000), (1, 1, 12000), 128, BF16, SMS)
    assert (a.fwd_tile_m, a.bwd_tile_m, a.fwd_head, a.bwd_head) == (b.fwd_tile_m, b.bwd_tile_m, b.fwd_head, b.bwd_head)


@pytest.mark.parametrize(
    "d,split",
    [(80, (64, 16)), (96, (64, 32)), (192, (128, 64)), (72, (128, 0)), (112, (128, 0)), (128, (128, 0)), (64, (64, 0))],
)
def test_qk_head_tiles_hold_a_head_as_a_tile_and_a_tail(d, split):
    """A head of a power of two plus a smaller one of at least the minimum tail is held as those two tiles (72 = 64
    + 8 has too short a tail, 112 = 64 + 48 a tail that is not a power of two: both padded); with no minimum
    every head is one padded tile. The config carries each pass's split to its kernel: by default the backward's
    head and tail, the forward's one padded tile."""
    padded = (config.next_pow2(d), 0)
    assert config.qk_head_tiles(d, 16) == split
    assert config.qk_head_tiles(d, 0) == padded
    c = config.qk_config((1, 1, 4 * 4096), (1, 1, 4096), d, BF16, SMS)
    assert (c.fwd_head, c.bwd_head) == (padded, split)
    with config.override(qk_fwd_min_tail_n=16, qk_bwd_min_tail_n=0):
        c = config.qk_config((1, 1, 4 * 4096), (1, 1, 4096), d, BF16, SMS)
        assert (c.fwd_head, c.bwd_head) == (split, padded)


def test_qk_config_rejects_head_dims_wider_than_one_tile():
    with pytest.raises(ValueError, match="head dims of at most 1024"):
        config.qk_config((1, 1, 64), (1, 1, 64), 2048, BF16, SMS)


# The analytic heuristics' qk_config, pinned (132 SMs): (m_q, m_k, D) -> the forward's head tile, tile rows,
# grids and hints, which a table-less launch must keep.
QK_BEFORE_THE_TABLE = {
    (3276, 819, 128): (128, 16, 16, 257, 257, (("occupancy", 2),), (("occupancy", 2),)),
    (16384, 4096, 64): (64, 128, 128, 160, 160, (("occupancy", 2),), (("occupancy", 2),)),
    (838860, 209715, 256): (256, 64, 32, 1056, 264, (("occupancy", 2),), (("occupancy", 2),)),
    (48, 12, 96): (128, 16, 16, 4, 4, (("occupancy", 2),), (("occupancy", 2),)),
}


@pytest.mark.parametrize("shape", list(QK_BEFORE_THE_TABLE))
def test_qk_config_without_a_table_entry_is_the_heuristics_of_before(shape):
    m_q, m_k, d = shape
    dense = (1, 1, m_q), (1, 1, m_k)  # the dense layouts keep the one-run tiles of before
    got = config.qk_config(*dense, d, BF16, SMS)
    fields = (got.fwd_head[0], got.fwd_tile_m, got.bwd_tile_m, got.fwd_grid, got.bwd_grid, got.fwd_hints, got.bwd_hints)
    assert fields == QK_BEFORE_THE_TABLE[shape]
    assert config.qk_config(*dense, d, BF16, SMS, config.qk_candidate(m_q + m_k, d, BF16, SMS)) == got


@pytest.mark.parametrize(
    "rows,g,h,split",
    [
        (64, 1, 1 << 20, (1, 64)),  # one run (dense): the plain row tile
        (64, 8192, 32, (4, 16)),  # qkv slice, 32 heads: qk_tile_h heads of 4 tokens
        (64, 8192, 8, (8, 8)),  # 8 heads: all of a token's heads, never padded to 16
        (64, 8192, 40, (8, 8)),  # 40 heads: 5 tiles of 8 per token, not 64 with 24 empty
        (64, 8192, 28, (16, 4)),  # 28 heads: 7 tiles of 4
        (64, 8192, 1, (64, 1)),  # one head: a run of tokens
        (16, 7, 32, (1, 16)),  # 7 tokens: no tile padded along the tokens
        (64, 3, 20480, (1, 64)),  # batches with gaps between them: rows of one batch
    ],
)
def test_qk_tile_split_pads_little_and_prefers_qk_tile_h_heads(rows, g, h, split):
    tg, th = config.qk_tile_split(rows, g, h)
    assert (tg, th) == split and tg * th == rows


def test_qk_config_splits_each_tensors_tiles_and_counts_its_tiles():
    q_shape, k_shape = (2, 1000, 40), (2, 1000, 8)  # a gradient of three runs: batch, tokens, heads
    c = config.qk_config(q_shape, k_shape, 128, BF16, SMS)
    assert c.bwd_tiles == tuple(config.qk_tile_split(c.bwd_tile_m, g, h) for _, g, h in (q_shape, k_shape))
    tiles = sum(
        a * config.cdiv(g, tg) * config.cdiv(h, th)
        for (a, g, h), (tg, th) in zip((q_shape, k_shape), c.bwd_tiles, strict=True)
    )
    assert c.bwd_grid == min(tiles, SMS * config.HEURISTICS.qk_bwd_blocks_per_sm)
    few = config.qk_config((3, 2, 40), (3, 2, 8), 128, BF16, SMS)  # few tiles: one block each, never an idle one
    assert few.fwd_grid == sum(
        3 * config.cdiv(2, tg) * config.cdiv(h, th) for (tg, th), h in zip(few.fwd_tiles, (40, 8), strict=True)
    )


def test_qk_config_follows_a_table_entry():
    entry = config.QKCandidate(fwd_tile_m=64, bwd_tile_m=8, fwd_blocks_per_sm=1, bwd_blocks_per_sm=4, fwd_occupancy=0,
                               bwd_occupancy=3)  # fmt: skip
    c = config.qk_config((1, 1, 838860), (1, 1, 209715), 256, BF16, SMS, entry)
    assert (c.fwd_head, c.fwd_tile_m, c.bwd_tile_m, c.fwd_grid, c.bwd_grid) == ((256, 0), 64, 8, SMS, 4 * SMS)
    assert c.fwd_hints == () and c.bwd_hints == (("occupancy", 3),)
    few = config.qk_config((1, 1, 48), (1, 1, 12), 96, BF16, SMS, entry)  # never more blocks than row tiles
    assert (few.fwd_grid, few.bwd_grid) == (1 + 1, 6 + 2)


@pytest.mark.parametrize("n", [64, 1152, 4096, 5120, 8192])
def test_backward_keeps_dw_per_row_for_many_row_tiles_of_short_rows(n):
    """The persistent backward accumulates dw per tile row (kernels.DW_PER_ROW) when a tile holds several
    rows of at most bwd_dw_per_row_max_row columns; one-row tiles and wider rows sum each tile at once."""
    bound = config.HEURISTICS.bwd_dw_per_row_max_row
    cfg = config.backward_config(65536, n, torch.bfloat16, SMS)
    assert cfg.strategy == "persistent"
    assert cfg.dw_per_row == (cfg.tile_m > 1 and cfg.tile_n + cfg.tail_n <= bound)
    with config.override(bwd_dw_per_row_max_row=0):
        assert not config.backward_config(65536, n, torch.bfloat16, SMS).dw_per_row
    assert config.backward_config(65536, 64, torch.bfloat16, SMS).dw_per_row
    assert not config.backward_config(65536, 8192, torch.bfloat16, SMS).dw_per_row


def test_backward_sums_each_tile_for_the_narrowest_rows_from_many_rows_on():
    """From bwd_dw_per_row_many_m rows on, counted by M's bucket (2000000 rows are in 2^21's), rows narrower
    than bwd_dw_per_row_many_m_min_row go back to summing each tile; wider short rows keep dw per row."""
    p = config.HEURISTICS
    many, narrow = p.bwd_dw_per_row_many_m, p.bwd_dw_per_row_many_m_min_row // 2
    for m in (many // 2 + 1, many, many + 12345):
        assert config.m_bucket(m) >= many
        assert not config.backward_config(m, narrow, torch.float16, SMS).dw_per_row
        assert config.backward_config(m, 2 * narrow, torch.float16, SMS).dw_per_row
    assert config.backward_config(many // 4, narrow, torch.float16, SMS).dw_per_row


def test_split_forward_config_spreads_a_row_over_a_block_per_chunk(host):
    """kernel="split": rows wider than one chunk run a block per (row, chunk), never chosen without being named
    (or a table naming it); rows of one chunk, and rows of more chunks than SMs (a row's blocks wait for each
    other, so all must be resident at once), are refused before any launch."""
    from tilegym_rms.cutile.tuning import candidate_error

    chunk = config.HEURISTICS.fwd_chunk_n
    cfg = fwd(host, 1000, 4 * chunk + 1, kernel="split")
    assert (cfg.kernel, cfg.tile_m, cfg.tile_n, cfg.grid) == ("split", 1, chunk, 1000 * 5)
    launch = host.forward.cached_launch(0, 1000, 4 * chunk + 1, BF16, "split", "llama", True, False, 0)
    assert launch.sum_slots == 8 and launch.constants[:3] == (chunk, 5, 8) and launch.allocates_rstd
    for n in (4 * chunk + 1, 262144):
        assert fwd(host, 65536, n).kernel == "gather"
    with pytest.raises(ValueError, match="rows wider than 16384"):
        fwd(host, 8, chunk, kernel="split")
    with pytest.raises(ValueError, match="exceed the 132 SMs"):
        config.forward_config(8, (SMS + 1) * chunk, BF16, SMS, kernel="split")
    with config.override(fwd_split_min_n=2 * chunk):  # the analytic choice from that width, within the SMs
        assert [config.forward_candidate(4096, n, BF16, SMS).kernel for n in (2 * chunk - 1, 2 * chunk, 262144)] == [
            "gather",
            "split",
            "split",
        ]
        assert config.forward_candidate(4096, (SMS + 1) * chunk, BF16, SMS).kernel == "gather"
    with config.override(fwd_split_min_n=2 * chunk, fwd_split_max_m=64):  # and only up to a row bound
        assert [config.forward_candidate(m, 4 * chunk, BF16, SMS).kernel for m in (1, 64, 128)] == [
            "split",
            "split",
            "gather",
        ]
        assert [fwd(host, m, 4 * chunk).kernel for m in (33, 64, 65)] == ["split", "split", "gather"]
    split = config.forward_candidate(8, 2 * chunk, BF16, SMS, "split")
    assert candidate_error("forward", split, 2 * chunk) is None
    assert "fit one" in candidate_error("forward", split, chunk)


@pytest.mark.parametrize("chunk", [2048, 4096, 8192, 16384])
def test_split_forward_builds_with_the_compilers_warps(chunk):
    """The split forward takes the gather's occupancy for a row of its chunk's width but never its worker
    warps (the gather's 4096-column row has eight): with them its build never finished its spin on an H200.
    Tables and ``--entry`` candidates that name worker warps for it are refused."""
    from tilegym_rms.cutile.tuning import candidate_error

    with config.override(fwd_chunk_n=chunk):
        split = config.forward_candidate(8, 5 * chunk, BF16, SMS, "split")
        gather = config.forward_candidate(8, chunk, BF16, SMS, "gather")  # a row of one chunk
    assert (split.tile_n, split.occupancy, split.num_worker_warps) == (chunk, gather.occupancy, 0)
    assert "num_worker_warps must be 0" in candidate_error("forward", replace(split, num_worker_warps=8), 5 * chunk)


def _table_with_settings(**settings):
    """The shipped H100 table with ``settings`` as its ``heuristics``."""
    from tilegym_rms.cutile import tuning

    return tuning.Table({**tuning.packaged("sm90_132sm").doc, "heuristics": settings})


def test_a_tables_settings_set_its_cards_fp8_and_gated_launches(host):
    """A table's ``heuristics`` change the FP8 and gated launches on its card, and only there: the FP8 tile and
    blocks per SM, the gated backward's blocks per SM; the same call on a target without them is unchanged."""
    from tilegym_rms.cutile.host import fp8 as fp8_host
    from tilegym_rms.cutile.host.forward import ADD_NONE

    table = _table_with_settings(fp8_tile_elems=8192, fp8_blocks_per_sm=4, gated_bwd_blocks_per_sm=4)
    tuned, plain = host.common.Target(SMS, table), host.common.Target(SMS)
    m, n = 32768, 4096

    def fp8_launch(tgt):
        return fp8_host.fp8_launch(tgt, m, n, BF16, "llama", True, ADD_NONE, fp8_host.QUANT_TOKEN, None, False, False,
                                   torch.float8_e4m3fn)  # fmt: skip

    base, changed = fp8_launch(plain), fp8_launch(tuned)
    assert (base.constants[0], changed.constants[0]) == (4, 2)  # TILE_M: 16384, 8192 elements of 4096-column rows
    assert (base.grid, changed.grid) == ((2 * SMS,), (4 * SMS,))
    grid = [host.gated.backward_launches(t, m, n, 512, BF16, BF16, True, True).main.grid for t in (plain, tuned)]
    assert grid[1][0] == 2 * grid[0][0]


def test_an_override_wins_over_a_tables_settings(host):
    """config.override (a sweep's --set) sets what the launch gets even where the device's table names it too."""
    from tilegym_rms.cutile.host import fp8 as fp8_host
    from tilegym_rms.cutile.host.forward import ADD_NONE

    tuned = host.common.Target(SMS, _table_with_settings(fp8_tile_elems=8192, fp8_blocks_per_sm=4))
    with config.override(fp8_tile_elems=16384):
        launch = fp8_host.fp8_launch(tuned, 32768, 4096, BF16, "llama", True, ADD_NONE, fp8_host.QUANT_TOKEN, None,
                                     False, False, torch.float8_e4m3fn)  # fmt: skip
    assert launch.constants[0] == 4 and launch.grid == (4 * SMS,)  # the override's tile, the table's blocks
    assert tuned.params().fp8_tile_elems == 8192  # outside the override the table's again


@pytest.mark.parametrize(
    "n, group, one_row, prefill",
    [(5120, None, (4096, 1024), (8192, 0)), (5120, 128, (4096, 1024), (8192, 0)), (4160, 64, (4096, 64), (8192, 0)),
     (4160, 128, (8192, 0), (8192, 0)), (10240, 128, (8192, 2048), (8192, 2048)), (7168, None, (8192, 0), (8192, 0)),
     (4096, None, (4096, 0), (4096, 0)), (32, 128, (128, 0), (128, 0))],
)  # fmt: skip
def test_fp8_tiles_of_one_row_are_a_tile_and_a_tail_where_that_holds_fewer_columns(n, group, one_row, prefill):
    """The FP8 kernel's ``(TILE_N, TAIL_N)``: a tail where a tile is one row (decode sizes, the widest rows at
    every M), the two hold fewer columns than the padded tile and no group straddles them (4160 per 128 columns
    pads to 8192); tiles of several rows (5120 at 32768 rows) and every tile without ``fp8_tail`` padded."""
    decode, walk = config.fp8_config(1, n, group, SMS), config.fp8_config(32768, n, group, SMS)
    assert (decode.tile_n, decode.tail_n) == one_row and (walk.tile_n, walk.tail_n) == prefill
    assert walk.tail_n == 0 or walk.tile_m == 1
    with config.override(fp8_tail=False):
        assert config.fp8_config(1, n, group, SMS).tail_n == 0


@pytest.mark.parametrize(
    "n, tiles", [(5120, (1, 4096, 1024)), (6144, (1, 4096, 2048)), (7168, (2, 8192, 0)), (2560, (4, 4096, 0))]
)
def test_fp8_group_rows_with_a_tail_take_a_tile_each_from_a_setting(n, tiles):
    """With ``fp8_group_tail_one_row_min`` set, walked per-group rows of at least that many padded columns that
    split into a tile and a tail get a tile of one row (with the tail); rows without a tail (7168), narrower ones and
    the per-row mode keep theirs."""
    with config.override(fp8_group_tail_one_row_min=8192):
        cfg = config.fp8_config(32768, n, 128, SMS)
        per_row = config.fp8_config(32768, n, None, SMS)
    assert (cfg.tile_m, cfg.tile_n, cfg.tail_n) == tiles
    assert per_row == config.fp8_config(32768, n, None, SMS)  # the setting is the per-group mode's alone
    assert config.fp8_config(32768, n, 128, SMS).tail_n == 0  # off by default: several padded rows a tile


def test_fp8_word_stores_follow_the_mode():
    """y_q as int64 words per group, value by value per row and static (the defaults, each a setting)."""
    assert config.fp8_config(32768, 4096, 128, SMS).words and not config.fp8_config(32768, 4096, None, SMS).words
    with config.override(fp8_group_word_stores=False, fp8_row_word_stores=True):
        assert config.fp8_config(32768, 4096, None, SMS).words and not config.fp8_config(32768, 4096, 64, SMS).words
