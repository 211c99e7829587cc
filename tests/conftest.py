import pytest
import torch

from tilegym_rms import dispatch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    """Each test sees the environment it sets: no backend choice cached from an earlier test."""
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    dispatch._clear_cache()
    yield
    dispatch._clear_cache()


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are empty); NaN anywhere fails."""
    out, ref = out.double(), ref.double()
    if ref.numel() == 0:
        return 0.0
    assert torch.isfinite(out).all(), "non-finite values in the output"
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)
