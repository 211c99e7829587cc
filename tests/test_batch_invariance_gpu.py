"""Batch invariance of the kernel backends on a CUDA GPU in the batch-invariant mode (marker ``gpu``; skipped
without CUDA): each probe row's outputs in batches of many sizes M are those of the row alone, bit for bit
(test_batch_invariance.assert_rows_invariant): forward ``y`` and ``rstd``, backward ``dx``, the fused add (its
outputs and gradients), the in-place fused add and QK-norm, on cuTile and on Triton; ``dw``, a sum over the
rows, must only be deterministic. The default path is not batch invariant (PERFORMANCE.md, "Batch invariance").

The Ms of a check come from the default path's launch configurations: at every M where the kernel, strategy,
tiles or compiler hints would change without the mode (cuTile: the heuristics and the device's tuning table,
whichever decides; Triton: the path and its row tile), the Ms just below and above the change, plus a few small
M and the largest; the failure message names the mode's launches. A batch holds at
most about MAX_ELEMS elements. Widths: a few per tile class by default (WIDTHS): about 200 cuTile variants to
compile on a fresh machine, a few minutes under ``-n 4``; ``TILEGYM_RMS_TEST_WIDTHS=table`` adds every N point
of the shipped tuning tables (many more: run it after a table changes).
"""

import dataclasses
import itertools
import os

import pytest
import torch
from test_batch_invariance import (
    assert_rows_invariant,
    backward_op,
    forward_op,
    fused_add_op,
    in_place_op,
    qk_op,
    qk_probes,
    row_probes,
    weight_of,
)
from test_cutile_gpu import _quiet_experimental_and_release_memory  # noqa: F401  (autouse)

import tilegym_rms
from tilegym_rms.cutile import tuning
from tilegym_rms.cutile.host import backward as cutile_backward
from tilegym_rms.cutile.host import forward as cutile_forward
from tilegym_rms.cutile.host import qk as cutile_qk
from tilegym_rms.cutile.host.common import target

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _batch_invariant_mode():
    with tilegym_rms.batch_invariant():
        yield


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
MAX_ELEMS = 1 << 27  # elements of the largest batch; its first M above a power of two is still taken
# Widths by dtype, one or more per tile class of the cuTile kernels: short rows (64), a backward row split into
# a tile and a tail tile (96 = 64 + 32, 3072 = 2048 + 1024) that few rows keep as one padded tile, no table
# point (1000), 4096, a forward padded to a wider tile (5120), a forward split into 8192 + 4096 from 513 rows
# on (12288), the chunked backward (24576). bf16 takes them all, the other dtypes the most common and those
# whose tiles change with M: every cuTile variant compiles once per process (a few seconds each).
WIDTHS = {
    BF16: (64, 96, 1000, 3072, 4096, 5120, 12288, 24576),
    FP32: (96, 1000, 3072, 4096, 12288),
    FP16: (96, 1000, 4096, 12288),
}
FUSED_WIDTHS = {BF16: (1000, 4096, 5120, 12288), FP32: (1000, 12288), FP16: (4096,)}
EVERY_TABLE_WIDTH = os.environ.get("TILEGYM_RMS_TEST_WIDTHS") == "table"
QK_HEADS = (16, 4)  # GQA: heads of q, of k


def _table_widths(op: str, dtype) -> list[int]:
    """The N points of ``op`` for ``dtype`` in every shipped tuning table."""
    name = tuning.DTYPE_NAMES[dtype]
    found = set()
    for key in tuning.packaged_keys():
        found |= {n for (o, dt, n) in tuning.packaged(key).runs if o == op and dt == name}
    return sorted(found)


def _points(widths, *table_ops: str):
    """``(N, dtype)`` parameters: ``widths`` (by dtype), and with TILEGYM_RMS_TEST_WIDTHS=table every point the
    shipped tables hold for ``table_ops``, in every dtype."""
    points = {(n, dt) for dt, ns in widths.items() for n in ns}
    if EVERY_TABLE_WIDTH:
        points |= {(n, dt) for op in table_ops for dt in DTYPES for n in _table_widths(op, dt)}
    return [pytest.param(n, dt, id=f"{n}-{str(dt)[6:]}") for n, dt in sorted(points, key=lambda p: (str(p[1]), p[0]))]


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def probe_ms(launch, max_m: int, rows_per_m: int = 1, extra=()) -> list[int]:
    """The Ms to check for a call whose launch configuration at M is ``launch(m)``: a few small M, the
    largest, and both sides of each change among the candidates (of the first where the same change recurs,
    as Triton's row mask does at every other M), which are the Ms on either side of each power of two of rows
    (M buckets) and of each multiple of the SM count that the heuristics' row thresholds use, in units of
    ``rows_per_m`` rows per M, plus ``extra``."""
    edges = [1 << k for k in range(24)] + [c * _sms() for c in (1, 2, 4, 8, 16)]
    candidates = {1, 2, 3, 7, *extra}
    for edge in edges:
        candidates |= {edge // rows_per_m, edge // rows_per_m + 1}
    candidates = sorted(m for m in candidates if 1 <= m <= max_m)
    chosen, changes = {1, 2, 3, 7, candidates[-1]} & set(candidates), set()
    for below, m in itertools.pairwise(candidates):
        change = (launch(below), launch(m))
        if change[0] != change[1] and change not in changes:
            chosen |= {below, m}
            changes.add(change)
    return sorted(chosen)


def _max_m(elems_per_m: int) -> int:
    return MAX_ELEMS // elems_per_m + 1


def _no_grid(cfg):
    """A launch configuration without its grids, which follow M and change no row's arithmetic."""
    return dataclasses.replace(cfg, **{f.name: 0 for f in dataclasses.fields(cfg) if f.name.endswith("grid")})


# ------------------------------------------------------------------------------------------------
# cuTile
# ------------------------------------------------------------------------------------------------


def _targets():
    """The host's targets on device 0: the default path's, whose launch changes choose the Ms, and the mode's."""
    return target(0), target(0, invariant=True)


def cutile_forward_launch(n, dtype, kernel=None, op="forward"):
    """The forward's configurations at M as the host chooses them on device 0 (the table's ``op``), without and
    with the mode."""
    targets = _targets()
    return lambda m: tuple(_no_grid(cutile_forward.config_for(on, m, n, dtype, kernel, op)) for on in targets)


def cutile_backward_launch(n, dtype):
    targets = _targets()
    return lambda m: tuple(_no_grid(cutile_backward.config_for(on, m, n, dtype)) for on in targets)


def cutile_qk_launch(d, dtype):
    """The default qk kernels' configurations for M tokens, q and k dense (one run of rows) and as qkv slices
    (tokens x heads: their tiles split along both, see cutile.config.qk_tile_split); then the mode's plain norm
    launches on q's rows and on k's."""
    on, invariant = _targets()
    fwd, bwd = cutile_forward_launch(d, dtype), cutile_backward_launch(d, dtype)

    def launch(m):
        rows_q, rows_k = m * QK_HEADS[0], m * QK_HEADS[1]
        dense, sliced = ((1, 1, rows_q), (1, 1, rows_k)), ((1, m, QK_HEADS[0]), (1, m, QK_HEADS[1]))
        default = tuple(_no_grid(cutile_qk.config_for(on, *shapes, d, dtype)) for shapes in (dense, sliced))
        return default, *(f(rows)[1] for rows in (rows_q, rows_k) for f in (fwd, bwd))

    return launch


def _both(*launches):
    return lambda m: tuple(launch(m) for launch in launches)


def _check_cutile(op, launch, n, dtype):
    probes = row_probes(n, dtype, "cuda")
    assert_rows_invariant(op, probes, probe_ms(launch, _max_m(n)), describe=launch)


CUTILE_OPS = {"forward": (forward_op, cutile_forward_launch), "backward": (backward_op, cutile_backward_launch)}


@pytest.mark.parametrize("table", ["packaged", "off"], ids=["table", "heuristics"])
@pytest.mark.parametrize("op_name", list(CUTILE_OPS))
@pytest.mark.parametrize("n,dtype", _points(WIDTHS, "forward", "backward"))
def test_cutile(n, dtype, op_name, table):
    """The plain norm under the device's tuning table and under the heuristics alone (other devices)."""
    make, launch = CUTILE_OPS[op_name]
    with tuning.use_table(table):
        _check_cutile(make(weight_of(n, dtype, "cuda"), backend="cutile"), launch(n, dtype), n, dtype)


@pytest.mark.parametrize("n,dtype", _points({BF16: (1000, 12288), FP32: (3072,)}))
def test_cutile_without_weight(n, dtype):
    launch = _both(cutile_forward_launch(n, dtype), cutile_backward_launch(n, dtype))
    for op in (forward_op(None, backend="cutile"), backward_op(None, backend="cutile")):
        _check_cutile(op, launch, n, dtype)


@pytest.mark.parametrize("n,dtype", _points({BF16: (1000, 4096, 12288), FP32: (1000, 4096, 12288)}))
def test_cutile_forced_gather_forward(n, dtype):
    """``kernel="gather"``, the mode's only forward kernel (the persistent one is refused), at the Ms where the
    default path's gather winners change."""
    op = forward_op(weight_of(n, dtype, "cuda"), backend="cutile", kernel="gather")
    _check_cutile(op, cutile_forward_launch(n, dtype, "gather"), n, dtype)


@pytest.mark.parametrize("n,dtype", _points(FUSED_WIDTHS, "fused_forward"))
def test_cutile_fused_add(n, dtype):
    launch = _both(cutile_forward_launch(n, dtype, op="fused_forward"), cutile_backward_launch(n, dtype))
    _check_cutile(fused_add_op(weight_of(n, dtype, "cuda"), backend="cutile"), launch, n, dtype)


@pytest.mark.parametrize("n,dtype", _points({BF16: (4096,)}))
def test_cutile_fused_add_post(n, dtype):
    launch = _both(cutile_forward_launch(n, dtype, op="fused_forward"), cutile_backward_launch(n, dtype))
    _check_cutile(fused_add_op(weight_of(n, dtype, "cuda"), mode="post", backend="cutile"), launch, n, dtype)


@pytest.mark.parametrize("n,dtype", _points({BF16: (1000, 12288), FP16: (4096,)}))
def test_cutile_fused_add_in_place(n, dtype):
    launch = cutile_forward_launch(n, dtype, op="fused_forward")
    _check_cutile(in_place_op(weight_of(n, dtype, "cuda"), backend="cutile"), launch, n, dtype)


def _qk_points():
    """``(D, dtype, weights)``: the qk table's head dims (every shipped table, every dtype it holds) and 128 in
    every dtype, with weights; 128 in bf16 without."""
    points = [(d, dt, True) for dt in DTYPES for d in sorted({128, *_table_widths("qk", dt)})] + [(128, BF16, False)]
    return [pytest.param(*p, id=f"{p[0]}-{str(p[1])[6:]}-{'weights' if p[2] else 'no_weights'}") for p in points]


@pytest.mark.parametrize("layout", ["qkv_slice", "contiguous"])
@pytest.mark.parametrize("d,dtype,weight", _qk_points())
def test_cutile_qk_norm(d, dtype, weight, layout):
    ws = (weight_of(d, dtype, "cuda"), weight_of(d, dtype, "cuda", seed=3)) if weight else (None, None)
    launch = cutile_qk_launch(d, dtype)
    ms = probe_ms(launch, _max_m(sum(QK_HEADS) * d), sum(QK_HEADS), extra=(*QK_HEADS, *(h - 1 for h in QK_HEADS)))
    op = qk_op(*ws, QK_HEADS, layout, backend="cutile")
    assert_rows_invariant(op, qk_probes(QK_HEADS, d, dtype, "cuda"), ms, describe=launch)


# ------------------------------------------------------------------------------------------------
# Triton (standard Triton on the NVIDIA GPU)
# ------------------------------------------------------------------------------------------------

# The Triton plans: the block-row path (64), rows of one tile whose row tile follows M up to 16 rows (1000),
# column chunks (5120, forward and backward). Triton compiles a kernel per row tile, mask and M divisible by 16.
TRITON_WIDTHS = {BF16: (64, 1000, 5120), FP32: (64, 1000, 5120)}


@pytest.fixture
def _compiled_triton():
    """Skips where Triton is missing or runs interpreted in this process (see test_triton_gpu.py)."""
    if os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: these tests need compiled Triton")
    pytest.importorskip("triton")
    from tilegym_rms.triton import kernels

    if type(kernels.rms_norm_fwd_kernel).__name__ == "InterpretedFunction":
        pytest.skip("the Triton kernels were created under the interpreter in this process")


def triton_launch(n, dtype, *ops):
    """The Triton plans (path, row tile, masks) of ``ops`` ("forward", "fused_add", "backward") at M, without and
    with the mode."""
    from tilegym_rms.triton import config as triton_config

    def tiles(m, op, invariant):
        return dataclasses.replace(triton_config.choose_tiles(m, n, dtype, op, invariant=invariant), num_tasks=0)

    # The default plans choose the Ms; the mode's are what runs.
    return lambda m: tuple(tiles(m, op, invariant) for invariant in (False, True) for op in ops)


TRITON_OPS = {
    "forward": (forward_op, ("forward",)),
    "backward": (backward_op, ("backward",)),
    "fused_add": (fused_add_op, ("fused_add", "backward")),
    "in_place": (in_place_op, ("fused_add",)),
}


@pytest.mark.usefixtures("_compiled_triton")
@pytest.mark.parametrize("op_name", list(TRITON_OPS))
@pytest.mark.parametrize("n,dtype", _points(TRITON_WIDTHS))
def test_triton_rows(n, dtype, op_name):
    make, plans = TRITON_OPS[op_name]
    launch = triton_launch(n, dtype, *plans)
    op = make(weight_of(n, dtype, "cuda"), backend="triton")
    assert_rows_invariant(op, row_probes(n, dtype, "cuda"), probe_ms(launch, _max_m(n)), describe=launch)


@pytest.mark.usefixtures("_compiled_triton")
@pytest.mark.parametrize("d,dtype", [pytest.param(128, dt, id=str(dt)[6:]) for dt in (BF16, FP32)])
def test_triton_qk_norm(d, dtype):
    """Without qk kernels, the plain norm on q's rows and on k's."""
    launch = triton_launch(d, dtype, "forward", "backward")

    def rows_launch(m):  # q's and k's row counts take their own plans
        return launch(m * QK_HEADS[0]), launch(m * QK_HEADS[1])

    ms = probe_ms(rows_launch, _max_m(sum(QK_HEADS) * d))
    ws = (weight_of(d, dtype, "cuda"), weight_of(d, dtype, "cuda", seed=3))
    op = qk_op(*ws, QK_HEADS, backend="triton")
    assert_rows_invariant(op, qk_probes(QK_HEADS, d, dtype, "cuda"), ms, describe=rows_launch)
