"""tune_cutile.py's gated and FP8 problems on the CPU: each timed call binds to the cuTile host function it stands
for (the real signatures, through a stand-in that records nothing else), and each problem's bytes are the
benchmark's for the same op."""

import inspect
import types

import pytest
import torch

import tilegym_rms.cutile as cutile
from bench.common import gated, traffic
from bench.tools import tune_cutile


def _bound(real, result):
    def call(*args, **kwargs):
        inspect.signature(real).bind(*args, **kwargs)  # raises TypeError where the tool's call does not fit
        return result(*args)

    return call


HOST = types.SimpleNamespace(
    gated_forward=_bound(cutile.gated_forward, lambda x, z, *_: (torch.zeros_like(x), torch.ones(x.shape[0], 1))),
    gated_backward=_bound(cutile.gated_backward, lambda x, z, dy, *_: (x, z, None)),
    fp8_forward=_bound(cutile.fp8_forward, lambda x, *_: (x, None)),
)


@pytest.mark.parametrize("op", [*gated.OPS, *traffic.FP8_OPS])
def test_problem_calls_the_host_and_counts_the_benchmarks_bytes(op):
    m, n = 8, 2048
    problem = tune_cutile._problem(HOST, op, m, n, torch.bfloat16, torch.device("cpu"), None, sets=1)
    problem.call(problem.sets[0])
    assert problem.nbytes == traffic.op_bytes(op, m, n, 2)


def test_a_gated_group_size_changes_only_the_rstd_bytes():
    m, n = 8, 2048
    one_group = tune_cutile._problem(HOST, "gated_bwd_before_bf16gate", m, n, torch.bfloat16, "cpu", n, sets=1)
    groups = tune_cutile._problem(HOST, "gated_bwd_before_bf16gate", m, n, torch.bfloat16, "cpu", 256, sets=1)
    assert groups.nbytes - one_group.nbytes == 4 * m * (n // 256 - 1)


def _args(*argv):
    return tune_cutile.build_parser().parse_args(list(argv))


def test_entries_parse_from_repeated_and_comma_separated_labels():
    args = _args("--op", "forward", "--entry", "persistent 2x8192 b8 o0 w0, gather 1x8192 b0 o4 w0", "--entry",
                 "persistent 4x4096+1024 b4 o2 w0")  # fmt: skip
    entries = tune_cutile._parse_entries(args, [])
    assert [label for label, _ in entries] == [
        "persistent 2x8192 b8 o0 w0",
        "gather 1x8192 b0 o4 w0",
        "persistent 4x4096+1024 b4 o2 w0",
    ]
    assert entries[2][1].tail_n == 1024 and entries[1][1].kernel == "gather"
    assert tune_cutile._parse_entries(_args("--op", "forward"), []) == [(None, None)]


@pytest.mark.parametrize(
    "argv, names",
    [
        (("--op", "gated_fwd_before_bf16gate", "--entry", "gather 1x8192 b0 o4 w0"), []),
        (("--op", "forward", "--entry", "gather 1x8192 b0 o4 w0"), ["gather_max_rows_per_sm"]),
        (("--op", "forward", "--entry", "gather 1x8192 b0"), []),
    ],
)
def test_entries_refused_where_they_cannot_apply(argv, names, capsys):
    assert tune_cutile._parse_entries(_args(*argv), names) is None
    assert "--entry" in capsys.readouterr().err
