"""bench/tools/dev_bytecode.py: the experiment runner that lets cuTile write its development-only bytecode."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest

from bench.tools import dev_bytecode, kernel_resources

PROBE = "import cuda.tile._compile as c; print(c.dev_features_enabled(), c._find_pip_tileiras() is None)"


def test_the_environment_puts_the_site_folder_first_and_sets_the_switch():
    env = dev_bytecode.environment({"PYTHONPATH": "/a:/b", "X": "1"})
    assert env[dev_bytecode.ENV] == "1" and env["X"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(dev_bytecode.SITE), "/a", "/b"]
    assert dev_bytecode.environment({})["PYTHONPATH"] == str(dev_bytecode.SITE)
    assert (dev_bytecode.SITE / "sitecustomize.py").is_file()


def test_only_the_runners_processes_get_the_development_bytecode():
    """In a process the runner starts (and so in the compile workers it starts), cuTile's development features
    are on and a pip-installed tileiras is passed over; a plain process, as the product runs, is untouched."""
    pytest.importorskip("cuda.tile")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop(dev_bytecode.ENV, None)
    run = [sys.executable, "-m", "bench.tools.dev_bytecode", "-c", PROBE]
    child = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert child.returncode == 0 and child.stdout.split() == ["True", "True"], child.stderr[-2000:]
    plain = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert plain.returncode == 0 and plain.stdout.split()[0] == "False", plain.stderr[-2000:]


def test_kernel_resources_reports_a_named_candidate(monkeypatch, capsys):
    """``--entry``: the build a table candidate would launch, its hints included, for each shape; with ``--sass``
    each build's instruction counts too."""
    pytest.importorskip("cuda.tile")
    from tilegym_rms import aot

    seen = []
    monkeypatch.setattr(kernel_resources, "find_cuobjdump", lambda: "cuobjdump")
    monkeypatch.setattr(aot, "cubin", lambda v, arch, as_launched: seen.append((v, as_launched)) or b"")
    use = {"REG": 32, "STACK": 0, "SHARED": 33920, "THREADS": 640}
    monkeypatch.setattr(kernel_resources, "resource_usage", lambda cubin, tool: use)
    counts = collections.Counter({"LDS.U16": 7, "FMUL": 3})
    monkeypatch.setattr(kernel_resources, "instruction_counts", lambda cubin, tool: counts)
    labels = "gather 1x8192 b0 o4 w0,gather 1x8192 b0 o4 w16"
    assert kernel_resources.main(["--shapes", "4096x8192,8192x5120", "--entry", labels, "--sass"]) == 0
    assert len(seen) == 4 and all(launched for _, launched in seen)
    assert all(v.kernel_name == "rms_norm_fwd_gather" for v, _ in seen)
    assert ["num_worker_warps=16" in v.describe() for v, _ in seen] == [False, True, False, True]
    out = capsys.readouterr().out
    assert "8192 x 5120:" in out and "gather 1x8192 b0 o4 w16" in out and "640 threads, 3 fit per SM" in out
    assert out.count("10 instructions; LDS.U16 7") == 4
