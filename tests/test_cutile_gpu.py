"""cuTile kernels on a CUDA GPU against float64 (marker `gpu`; skipped without CUDA).

The grid is shaped so that its kernel variants compile in a few minutes on a fresh machine: the
full (M, N, dtype) grid runs with the default options, and each other axis (casting mode, weight /
offset, forward kernel, strides) runs over a smaller set of shapes.
"""

import re
import warnings

import pytest
import torch
from conftest import BIG_GPU_ELEMS, big_gpu_memory_if, chunked_errors

import tilegym_rms
from tilegym_rms import reference

pytestmark = pytest.mark.gpu

M_GRID = [1, 7, 128, 4097, 65536]
N_GRID = [1, 64, 123, 512, 1000, 2001, 4096, 5120, 7168, 16384, 20000, 32768, 65536]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
Y_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DW_TOL = 1e-2
# (m, n) of the grid; the big ones take turns on the GPU under pytest-xdist (conftest: big_gpu_memory).
MN_GRID = [
    pytest.param(m, n, id=f"{m}-{n}", marks=big_gpu_memory_if(m * n >= BIG_GPU_ELEMS)) for m in M_GRID for n in N_GRID
]
REF_CHUNK_ELEMS = 1 << 25  # fp64 reference computed in row chunks: bounded memory


def _skip_if_too_big(m, n, dtype):
    # 65536 x 65536 needs ~8 GB per tensor in bf16; run that corner in bf16 only.
    if m * n > (1 << 30) and dtype != torch.bfloat16:
        pytest.skip("largest corner runs in bf16 only")


def _check(m, n, dtype, *, weight=True, offset=0.0, casting_mode="llama", kernel=None, x=None, eps=1e-6):
    torch.manual_seed(m * 131 + n)
    dev = "cuda"
    if x is None:
        x = torch.randn(m, n, dtype=dtype, device=dev)
    w = torch.randn(n, dtype=dtype, device=dev) if weight else None
    dy = torch.randn(x.shape, dtype=dtype, device=dev)
    kw = dict(offset=offset, casting_mode=casting_mode, backend="cutile")
    y, rstd = tilegym_rms.rms_norm_forward(x, w, eps, kernel=kernel, **kw)
    dx, dw = tilegym_rms.rms_norm_backward(x, dy, w, rstd, **kw)
    outputs = {"y": y, "dx": dx, "rstd": rstd} | ({"dw": dw} if weight else {})
    err = chunked_errors(
        x, w, dy, outputs, eps=eps, offset=offset, casting_mode=casting_mode, chunk_elems=REF_CHUNK_ELEMS
    )
    tol = Y_TOL[dtype]
    assert err["y"] <= tol, err
    assert err["dx"] <= tol, err
    assert err["rstd"] <= 1e-5 if casting_mode != "none" else err["rstd"] <= 1e-2, err
    if weight:
        assert dw.dtype == w.dtype and err["dw"] <= DW_TOL, err
    else:
        assert dw is None


@pytest.fixture(autouse=True)
def _quiet_experimental_and_release_memory(monkeypatch):
    monkeypatch.setenv("TILEGYM_RMS_SILENCE_EXPERIMENTAL", "1")
    yield
    # Under pytest-xdist several workers share the GPU: hand cached blocks back after each test, or the
    # largest shapes (8 GB per tensor) run out of memory beside another worker's cache.
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n", MN_GRID)
def test_grid_forward_backward(m, n, dtype):
    _skip_if_too_big(m, n, dtype)
    # At N = 1, x^2 / (x^2 + eps) is 1 - O(eps): dx is a catastrophic cancellation whose relative error
    # measures eps, not the kernel. A large eps keeps that one case well conditioned.
    _check(m, n, dtype, eps=1e-6 if n > 1 else 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2560, 3072, 6144, 12288])
@pytest.mark.parametrize("weight", [True, False])
def test_backward_rows_split_into_tile_and_tail(n, dtype, weight):
    """Widths held as a tile plus a tail tile in the backward (config.split_row), with and without dw."""
    from tilegym_rms.cutile import config

    assert config.split_row(n)[1] > 0
    _check(4097, n, dtype, weight=weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [128, 1000, 1152])
@pytest.mark.parametrize("per_row_max", [0, 2048])
def test_backward_dw_per_row_and_per_tile(n, dtype, per_row_max):
    """The persistent backward's two dw accumulations (kernels.DW_PER_ROW), chosen by the heuristic's bound:
    rows of many-row tiles, with a tail tile at 1152 (1024 + 128); the host's launch carries the choice."""
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import config
    from tilegym_rms.cutile.host import backward

    cutile.clear_caches()
    try:
        with config.override(bwd_dw_per_row_max_row=per_row_max):
            launches = backward.cached_launches(0, 4097, n, dtype, True, False)
            assert launches.cfg.strategy == "persistent" and launches.cfg.tile_m > 1
            assert launches.cfg.dw_per_row == (per_row_max > 0) == launches.main.constants[-1]
            _check(4097, n, dtype)
    finally:
        cutile.clear_caches()


@pytest.mark.parametrize("n", [1000, 5120])
def test_backward_with_the_reductions_own_occupancy(n):
    """reduce_occupancy 0: the dw reduction without the default occupancy hint (the compiler's ring of load
    stages, one block per SM) sums the same partial rows; dw and dx against float64."""
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import config
    from tilegym_rms.cutile.host import backward

    cutile.clear_caches()
    try:
        with config.override(reduce_occupancy=0):
            launches = backward.cached_launches(0, 4097, n, torch.bfloat16, True, False)
            assert launches.reduce.hints == ()
            _check(4097, n, torch.bfloat16)
    finally:
        cutile.clear_caches()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
@pytest.mark.parametrize("weight,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
@pytest.mark.parametrize("m,n", [(7, 123), (4097, 4096), (128, 16384)])
def test_casting_weight_offset(m, n, dtype, casting_mode, weight, offset):
    _check(m, n, dtype, weight=weight, offset=offset, casting_mode=casting_mode)


FORCED_MODE_SHAPES = [(1, 64), (4097, 1000), (7, 4096), (65536, 5120), (4097, 8192), (4097, 12288)]


@pytest.mark.parametrize("kernel", ["gather", "persistent", "tiles"])
@pytest.mark.parametrize(
    "m,n", [pytest.param(m, n, marks=big_gpu_memory_if(m * n >= BIG_GPU_ELEMS)) for m, n in FORCED_MODE_SHAPES]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forced_forward_kernel(m, n, dtype, kernel):
    _check(m, n, dtype, kernel=kernel)


@pytest.mark.parametrize("label", ["tiles 16x512+128 b0 o4 w0", "persistent 16x512+128 b8 o4 w0"])
@pytest.mark.parametrize("n", [576, 640])
def test_forward_of_a_tile_and_a_tail_as_a_table_entry(n, label):
    """A padded row held as a tile plus a tail tile (512 + 128) when a tuning table names it, for the walking and
    the one-tile-per-block kernel (sweep candidates of the wide set): values against float64, 4097 rows."""
    from tilegym_rms.cutile import tuning
    from tilegym_rms.cutile.host import forward
    from tilegym_rms.cutile.launch import num_sms
    from tilegym_rms.cutile.tuning import build

    cand = build.parse_label("forward", label)
    empty = build.new_doc("test", "test", torch.cuda.get_device_capability(0), num_sms(0), "measured", "test")
    doc = build.with_winner(empty, "forward", "bf16", tuning.m_bucket(4097), n, cand)
    with tuning.use_table(doc):
        cfg = forward.cached_config(0, 4097, n, torch.bfloat16, None)
        assert (cfg.kernel, cfg.tile_n, cfg.tail_n) == (cand.kernel, 512, 128)
        _check(4097, n, torch.bfloat16)


@pytest.mark.parametrize("n", [64, 1000, 4096, 16384])
def test_noncontiguous_inputs(n):
    big = torch.randn(300, n + 24, dtype=torch.bfloat16, device="cuda")
    _check(300, n, torch.bfloat16, x=big[:, 8 : 8 + n])  # strided rows, read in place
    _check(40, n, torch.bfloat16, x=torch.randn(n, 40, dtype=torch.bfloat16, device="cuda").t())  # copied
    _check(3 * 50, n, torch.bfloat16, x=big[:150].view(3, 50, n + 24)[..., :n])  # leading dims


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", [(7, 1000), (4097, 4096), (3, 65536)])
def test_inference_forward_matches_the_rstd_storing_forward(m, n, dtype):
    """Without grad, rms_norm runs the kernels that skip rstd (STORE_RSTD=False): same y, bit for bit."""
    x = torch.randn(m, n, dtype=dtype, device="cuda")
    w = torch.randn(n, dtype=dtype, device="cuda")
    y_ref, _ = tilegym_rms.rms_norm_forward(x, w, backend="cutile")
    with torch.no_grad():
        y = tilegym_rms.rms_norm(x, w, backend="cutile")
    assert torch.equal(y, y_ref)


def test_empty_and_weight_dtype_mix():
    x = torch.randn(0, 4096, dtype=torch.bfloat16, device="cuda")
    y, rstd = tilegym_rms.rms_norm_forward(x, torch.ones(4096, device="cuda"), backend="cutile")
    assert y.shape == x.shape and rstd.shape == (0,)
    x = torch.randn(33, 512, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(512, dtype=torch.float32, device="cuda")
    y = tilegym_rms.rms_norm(x, w, backend="cutile")
    ref, _ = reference.rms_norm_forward(x.double(), w.double(), 1e-6)
    assert y.dtype == torch.bfloat16 and (y.double() - ref).norm() / ref.norm() <= 1e-2


@pytest.mark.big_gpu_memory
def test_dw_is_deterministic():
    x = torch.randn(65536, 4096, dtype=torch.bfloat16, device="cuda")
    dy, w = torch.randn_like(x), torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    _, rstd = tilegym_rms.rms_norm_forward(x, w, backend="cutile")
    runs = [tilegym_rms.rms_norm_backward(x, dy, w, rstd, backend="cutile") for _ in range(3)]
    assert all(torch.equal(r[1], runs[0][1]) and torch.equal(r[0], runs[0][0]) for r in runs)


def test_default_backend_on_this_gpu_is_cutile():
    from tilegym_rms.dispatch import resolve_backend

    assert resolve_backend(torch.device("cuda", 0)) == "cutile"
    assert tilegym_rms.available_backends()["cutile"] == (True, "")


def test_forward_kernel_chosen_by_heuristic():
    """The analytic heuristics' kernel (the device's tuning table set aside: a card's table may choose otherwise)."""
    from tilegym_rms import cutile
    from tilegym_rms.cutile import tuning

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    small = torch.empty(sms, 4096, device="cuda", dtype=torch.bfloat16)
    large = torch.empty(65536, 1024, device="cuda", dtype=torch.bfloat16)
    large_preferred = torch.empty(65536, 4096, device="cuda", dtype=torch.bfloat16)  # a GATHER_PREFERRED width
    wide = torch.empty(4096, 65536, device="cuda", dtype=torch.bfloat16)
    with tuning.use_table(None):
        assert cutile.forward_config(small).kernel == "gather"
        assert cutile.forward_config(large).kernel == "persistent"
        assert cutile.forward_config(large_preferred).kernel == "gather"
        assert cutile.forward_config(wide).kernel == "gather" and not cutile.forward_config(wide).single_tile


def test_experimental_warning_on_first_backward(monkeypatch):
    """Each experimental kernel warns once, on its first launch: the one-launch backward of few rows, then
    the persistent backward and the dw reduction of more rows."""
    from tilegym_rms import experimental

    monkeypatch.delenv("TILEGYM_RMS_SILENCE_EXPERIMENTAL")
    experimental._reset_warnings()
    w = torch.randn(256, device="cuda", requires_grad=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for m in (64, 64, 4097, 4097):
            x = torch.randn(m, 256, device="cuda", requires_grad=True)
            tilegym_rms.rms_norm(x, w, backend="cutile").sum().backward()
    names = [str(s.message) for s in seen if issubclass(s.category, tilegym_rms.ExperimentalKernelWarning)]
    warned = [re.search(r"kernel '(\w+)'", s).group(1) for s in names]
    assert warned == ["rms_norm_bwd_direct", "rms_norm_bwd_persistent", "rms_norm_dw_reduce"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_rms_norm_and_module_gpu(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 33, 2048, dtype=dtype, device="cuda", requires_grad=True)
    mod = tilegym_rms.RMSNorm(2048, eps=1e-6, device="cuda", dtype=dtype)
    with torch.no_grad():
        mod.weight.normal_()
    dy = torch.randn_like(x)
    mod(x).backward(dy)
    xr, wr = x.detach().double().requires_grad_(), mod.weight.detach().double().requires_grad_()
    torch.nn.functional.rms_norm(xr, (2048,), wr, 1e-6).backward(dy.double())
    tol = Y_TOL[dtype]
    assert (x.grad.double() - xr.grad).norm() / xr.grad.norm() <= tol
    assert (mod.weight.grad.double() - wr.grad).norm() / wr.grad.norm() <= DW_TOL


def test_autograd_torch_compile_fullgraph_gpu():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), tilegym_rms.RMSNorm(1024), torch.nn.Linear(1024, 8)).cuda()
    x = torch.randn(64, 512, device="cuda")
    model(x).square().sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    compiled(x).square().sum().backward()
    for g, p in zip(eager, model.parameters(), strict=False):
        assert (p.grad - g).norm() / g.norm() <= 1e-4


@pytest.mark.parametrize("mode", ["pre", "post"])
def test_autograd_fused_add_gpu(mode):
    torch.manual_seed(2)
    x = torch.randn(300, 1000, device="cuda", requires_grad=True)
    r = torch.randn(300, 1000, device="cuda", requires_grad=True)
    w = torch.randn(1000, device="cuda", requires_grad=True)
    y, res = tilegym_rms.fused_add_rms_norm(x, r, w, mode=mode, backend="cutile")
    (y * 2 + res.sin()).sum().backward()
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    y64, res64 = tilegym_rms.fused_add_rms_norm(x64, r64, w64, mode=mode, backend="torch")
    (y64 * 2 + res64.sin()).sum().backward()
    for a, b in ((y, y64), (res, res64), (x.grad, x64.grad), (r.grad, r64.grad), (w.grad, w64.grad)):
        assert (a.double() - b).norm() / b.norm() <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("m,n", [(7, 64), (4097, 1000), (4097, 5120), (4097, 12288), (129, 16384), (4097, 24576),
                                 (7, 65536), (3, 100000)])  # fmt: skip
def test_batch_invariant_mode(m, n, dtype, weight):
    """The mode's launches against float64: the gather forward and the direct backward at every width, whole padded
    rows up to 16384 columns and column chunks beyond (the direct backward's chunked dx branch, SINGLE_TILE off)."""
    with tilegym_rms.batch_invariant():
        _check(m, n, dtype, weight=weight)


# Rows wider than one 16384-column chunk, split over a block per chunk (kernel "split"): one chunk and a bit,
# chunks that end inside the row, 2 to 16 whole chunks.
SPLIT_SHAPES = [(1, 16385), (7, 20000), (129, 32768), (300, 65536), (33, 131072), (5, 262144)]


@pytest.mark.parametrize("m,n", SPLIT_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_forward_kernel(m, n, dtype, split_forward_finishes):
    _check(m, n, dtype, kernel="split")


@pytest.mark.parametrize("chunk", [4096, 8192])
@pytest.mark.parametrize("m,n", [(7, 20000), (33, 131072), (5, 262144)])
def test_split_forward_narrower_chunks(chunk, m, n, split_forward_finishes):
    """Chunks narrower than the default (more of them per row, up to 64, and more blocks resident: the launch
    takes the gather's occupancy for a row of that width) against float64; the launch splits as configured."""
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import config
    from tilegym_rms.cutile.host import common, forward

    cutile.clear_caches()
    try:
        with config.override(fwd_chunk_n=chunk):
            assert forward.config_for(common.target(0), m, n, torch.bfloat16, "split").tile_n == chunk
            _check(m, n, torch.bfloat16, kernel="split")
    finally:
        cutile.clear_caches()


@pytest.mark.parametrize("casting_mode", reference.CASTING_MODES)
@pytest.mark.parametrize("weight,offset", [(True, 1.0), (False, 0.0)])
def test_split_forward_casting_weight_offset(casting_mode, weight, offset, split_forward_finishes):
    _check(65, 40000, torch.bfloat16, weight=weight, offset=offset, casting_mode=casting_mode, kernel="split")


def test_split_forward_rows_do_not_depend_on_the_call(split_forward_finishes):
    """A block per chunk, chunks taken in the order blocks start, sums traded through memory: a row's y and rstd
    are the same bits in a call of its own, in a larger call and on a second run, and match the chunked gather's
    rounding within one step of its dtype."""
    x = torch.randn(2000, 49152, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(49152, dtype=torch.bfloat16, device="cuda")
    y, rstd = tilegym_rms.rms_norm_forward(x, w, backend="cutile", kernel="split")
    again, rstd_again = tilegym_rms.rms_norm_forward(x, w, backend="cutile", kernel="split")
    assert torch.equal(y, again) and torch.equal(rstd, rstd_again)
    for rows in (slice(0, 1), slice(1000, 1003), slice(1999, 2000)):
        part, part_rstd = tilegym_rms.rms_norm_forward(x[rows], w, backend="cutile", kernel="split")
        assert torch.equal(part, y[rows]) and torch.equal(part_rstd, rstd[rows])
    gathered, _ = tilegym_rms.rms_norm_forward(x, w, backend="cutile", kernel="gather")
    assert (y.float() - gathered.float()).abs().max() <= 2**-7 * gathered.float().abs().max()


def test_split_forward_replays_in_a_cuda_graph(split_forward_finishes):
    """The launch zeroes its ticket and clears its sums on the stream before the kernel: a captured call replays
    with new inputs and the values of an eager call."""
    x = torch.randn(64, 65536, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(65536, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        tilegym_rms.rms_norm(x, w, backend="cutile", kernel="split")  # compiled and warned outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = tilegym_rms.rms_norm(x, w, backend="cutile", kernel="split")
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert torch.equal(y, tilegym_rms.rms_norm(x, w, backend="cutile", kernel="split"))
