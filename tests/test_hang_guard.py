"""The GPU suite's hang guard (``hang_guard`` in tests/conftest.py, around every GPU test): a test that never
finishes fails with its stack instead of stalling the run. Each case runs in a fresh process."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
LOAD_GUARD = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
hang_guard = suite.hang_guard
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


def test_a_block_past_its_time_ends_the_process_with_every_stack():
    start = time.monotonic()
    done = _python(LOAD_GUARD + "import time\nwith hang_guard(1):\n    time.sleep(120)\nprint('after')\n")
    assert done.returncode != 0 and "after" not in done.stdout
    assert time.monotonic() - start < 90
    assert "Timeout" in done.stderr and 'File "<string>"' in done.stderr, done.stderr[-2000:]


def test_a_block_within_its_time_leaves_the_process_running():
    done = _python(LOAD_GUARD + "import time\nwith hang_guard(2):\n    pass\ntime.sleep(3)\nprint('after')\n")
    assert done.returncode == 0 and "after" in done.stdout, done.stderr[-2000:]


def test_xdist_fails_the_hung_test_and_runs_the_others(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "test_guarded.py").write_text(
        LOAD_GUARD
        + textwrap.dedent(
            """
            import time

            def test_hangs():
                with hang_guard(1):
                    time.sleep(120)

            def test_runs():
                assert True
            """
        )
    )
    cmd = [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "1 failed" in out and "1 passed" in out and "test_hangs" in out, out[-3000:]
