"""The ``tilegym-rms`` command line, run as a user runs it: ``python -m tilegym_rms ...`` in a fresh process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, env=None, path_first=None, gpu=False):
    """``env``: variables to set; ``path_first``: a directory ahead of the repository on PYTHONPATH; ``gpu``:
    keep the GPUs visible (else check runs on the CPU, cheap, also on a GPU host)."""
    # A clean environment for backend selection: a pytest process may have set TRITON_INTERPRET.
    full = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TILEGYM_RMS_BACKEND")}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (path_first, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if not gpu:
        full["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "-m", "tilegym_rms", *args],
        capture_output=True,
        text=True,
        env=full | (env or {}),
        cwd=ROOT,
        timeout=300,
    )


def one_error_line(out) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{out.stderr}"
    assert lines[0].startswith("tilegym-rms: error: ")
    assert "Traceback" not in out.stderr and "usage:" not in out.stderr
    assert out.stdout == "", "nothing ran"
    return lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--m", "-1"], "--m must be a positive integer, got -1"),
        (["--n", "0"], "--n must be a positive integer, got 0"),
        (["--n", "wide"], "--n must be a positive integer, got wide"),
        (["check", "--m=0"], "--m must be a positive integer, got 0"),
        (["--m"], "argument --m: expected one argument"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["check", "aot"], "unrecognized arguments: aot"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message):
    assert one_error_line(run_cli(*args)) == f"tilegym-rms: error: {message}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--m", "8", "aot"], "--m is an option of check, not of aot"),
        (["--n=16", "aot", "--help"], "--n is an option of check, not of aot"),
        (["--m", "8", "--n", "16", "bench"], "--m and --n are options of check, not of bench"),
        (["--n", "16", "bench-backward", "--quick"], "--n is an option of check, not of bench-backward"),
    ],
)
def test_command_after_check_options_is_recognised(args, message):
    """The command counts wherever it stands: check's options given with another command are an error
    (before, ``--m 8 aot`` silently ran the check)."""
    assert one_error_line(run_cli(*args)) == f"tilegym-rms: error: {message}"


def test_flags_after_aot_pass_through():
    out = run_cli("aot", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: tilegym-rms aot") and "--arch" in out.stdout
    out = run_cli("aot", "--arch", "sm_1")  # aot's own parser judges its flags
    assert out.returncode == 2 and "tilegym-rms aot" in out.stderr and "sm_1" in out.stderr


@pytest.mark.parametrize(
    "args", [["--m", "8", "--n", "16"], ["--m=8", "check", "--n=16"], ["check", "--n", "16", "--m", "8"]]
)
def test_check_runs_on_the_cpu(args):
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    assert "device cpu" in out.stdout
    assert "(8x16) vs float64" in out.stdout and out.stdout.rstrip().endswith("-> ok")


@pytest.mark.parametrize(
    ("command", "module"), [("bench", "bench.bench_rmsnorm"), ("bench-backward", "bench.bench_rmsnorm_backward")]
)
def test_bench_commands_run_the_checkouts_scripts_from_any_directory(command, module, tmp_path):
    """As after ``pip install -e .``: tilegym_rms imports, the checkout's bench package is not on the path and
    the command runs elsewhere; the command still finds and runs the script (its own --help)."""
    (tmp_path / "tilegym_rms").symlink_to(ROOT / "tilegym_rms")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "tilegym_rms", command, "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: python -m {module} ") and "--measure" in out.stdout


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "cutile",
            "backend 'cutile' (TILEGYM_RMS_BACKEND=cutile) cannot run on cpu: cuTile runs on CUDA devices, not cpu",
        ),
        (
            "cuda",
            "unknown backend 'cuda' (TILEGYM_RMS_BACKEND=cuda); choose one of 'cutile', 'triton', 'torch' or None",
        ),
    ],
)
def test_a_forced_backend_that_cannot_run_is_one_line(value, message):
    """The report of what can run comes first, then one line on what the variable asks for, exit 2."""
    out = run_cli(env={"TILEGYM_RMS_BACKEND": value})
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.splitlines() == [f"tilegym-rms: error: {message}"]
    assert "cutile  cannot run: cuTile runs on CUDA devices" in out.stdout and "vs float64" not in out.stdout


def test_help_describes_the_commands_in_whole_sentences():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "and on a GPU time it against torch. Subcommands: aot (compile check)," in text
    assert "``" not in text


def test_version():
    import torch

    import tilegym_rms

    out = run_cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"tilegym-rms {tilegym_rms.__version__} (torch {torch.__version__})\n"


NO_CUDA_SITECUSTOMIZE = """
import sys


class _NoCuda:  # as if the [cuda] extra were not installed: cuda.tile cannot be imported
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, _NoCuda())
"""


def test_aot_without_the_cuda_extra_is_one_line(tmp_path):
    """Every variant would fail to import cuda.tile: one line naming the extra, status 2, nothing compiled.
    The shim goes in through a sitecustomize on PYTHONPATH, so the compile processes would see it too."""
    (tmp_path / "sitecustomize.py").write_text(NO_CUDA_SITECUSTOMIZE)
    out = run_cli("aot", path_first=str(tmp_path))
    expected = (
        "tilegym-rms aot: error: cuda.tile is not importable (No module named 'cuda'); pip install 'tilegym_rms[cuda]'"
    )
    assert (out.returncode, out.stdout, out.stderr) == (2, "", expected + "\n")


def test_check_passes_a_single_column():
    """At N = 1, x * rstd is +-1 and dx cancels to rounding (in torch too): judged by the size of its
    terms, it passes."""
    out = run_cli("--n", "1", "--m", "8")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "(8x1) vs float64" in out.stdout and out.stdout.rstrip().endswith("-> ok")


@pytest.mark.parametrize("n", [1, 64])
def test_check_still_fails_a_wrong_dx(monkeypatch, capsys, n):
    """A dx off by 1% of rstd * w * dy (the size of its terms) fails, at N = 1 as elsewhere."""
    import torch

    from tilegym_rms import cli

    real = cli.rms_norm_backward

    def off(x, dy, w, rstd, **kw):
        dx, dw = real(x, dy, w, rstd, **kw)
        return dx + 0.01 * rstd[:, None] * w * dy, dw

    monkeypatch.setattr(cli, "rms_norm_backward", off)
    assert not cli._check_one("torch", torch.device("cpu"), torch.float32, 64, n)
    assert capsys.readouterr().out.rstrip().endswith("-> FAIL")


@pytest.mark.gpu
def test_check_on_a_gpu_names_the_tuning_table_it_runs():
    """On a GPU the main job runs the cuTile backend and says which tuning table tunes it, and where that
    table was measured (the shipped one of this card or its class, else the heuristics)."""
    import torch

    from tilegym_rms.cutile import tuning

    with tuning.use_table("packaged"):
        expected = tuning.describe(torch.cuda.current_device())
    out = run_cli(env={"TILEGYM_RMS_TUNING": "packaged"}, gpu=True)
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert f"  tuning table: {expected}\n" in out.stdout
    assert out.stdout.count("-> ok") == 2  # fp32 and bf16 against float64
