"""Every Python example of the README runs as written, each in a fresh interpreter (first contact: nothing
imported or compiled before it). Examples on CUDA tensors run on a GPU only (marker ``gpu``)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _needs(example: str) -> tuple:
    marks = (pytest.mark.gpu,) if '"cuda"' in example else ()
    if "transformers" in example:
        marks += (pytest.mark.skipif(not _importable("transformers"), reason="needs the [hf] extra"),)
    return marks


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_the_readme_has_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize(
    "example", [pytest.param(e, id=f"example{i}", marks=_needs(e)) for i, e in enumerate(EXAMPLES)]
)
def test_readme_example_runs_as_written(example, tmp_path):
    done = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{example}\n--- stderr:\n{done.stderr[-3000:]}"
