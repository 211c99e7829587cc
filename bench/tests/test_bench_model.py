"""The training-step benchmark's gated-norm models (bench/bench_model.py), on the CPU at a tiny size: Qwen3-Next is
hybrid as the released model, every norm of each model is counted and swapped, and a step of ours matches HF's
loss."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_next")

from bench import bench_model  # noqa: E402

TINY = ["--device", "cpu", "--dtype", "fp32", "--layers", "4", "--hidden", "64", "--heads", "4", "--kv-heads", "2"]
TINY += ["--vocab", "128", "--seq", "16", "--steps", "1", "--warmup", "1", "--compile", "none"]


def test_qwen3_next_is_hybrid_and_has_gated_norms():
    args = bench_model.parse_args([*TINY, "--models", "qwen3_next"])
    model = bench_model._build_model("qwen3_next", args, torch.float32, torch.device("cpu"))
    kinds = [
        type(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn) for layer in model.model.layers
    ]
    assert [k.__name__.endswith("GatedDeltaNet") for k in kinds] == [True, True, True, False]
    names = [type(m).__name__ for m in model.modules() if "RMSNorm" in type(m).__name__]
    # Two per layer, q/k norms of the full-attention layer, the final norm, one gated norm per linear layer.
    assert len(names) == bench_model._count_norms(model) == 4 * 2 + 2 + 1 + 3
    assert sum(n.endswith("Gated") for n in names) == 3
    assert all(type(layer.mlp).__name__ == "Qwen3NextMLP" for layer in model.model.layers)  # dense


def test_mamba2_gated_norms_in_groups():
    args = bench_model.parse_args([*TINY, "--models", "mamba2"])
    model = bench_model._build_model("mamba2", args, torch.float32, torch.device("cpu"))
    gated = [m for m in model.modules() if type(m).__name__ == "MambaRMSNormGated"]
    assert len(gated) == 4 and all(m.group_size == 64 for m in gated)  # 2 x 64 columns / --kv-heads 2 groups
    assert bench_model._count_norms(model) == 4 + 4 + 1  # gated, per-layer and final norms


@pytest.mark.filterwarnings("ignore:.*falling back to its reference PyTorch implementation")
@pytest.mark.parametrize(("name", "norms"), [("qwen3_next", 14), ("mamba2", 9)])
def test_step_of_ours_matches_hf(name, norms):
    args = bench_model.parse_args([*TINY, "--models", name])
    cpu = torch.device("cpu")
    hf = bench_model._run_mode(name, "hf", "none", args, cpu)
    ours = bench_model._run_mode(name, "ours", "none", args, cpu)
    assert (hf["norms_total"], hf["norms_replaced"]) == (norms, 0)
    assert (ours["norms_total"], ours["norms_replaced"]) == (norms, norms)
    assert ours["init_checksum"] == hf["init_checksum"]  # the same weights
    # fp32 on the CPU: the first loss is HF's to rounding; the second follows one step of both backwards.
    assert ours["losses"][0] == pytest.approx(hf["losses"][0], rel=1e-6)
    assert ours["losses"][1] == pytest.approx(hf["losses"][1], rel=1e-4)
    assert ours["losses"][1] < ours["losses"][0]
