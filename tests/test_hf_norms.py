"""Every RMSNorm class of the installed transformers (``tilegym_rms.integrations.hf.catalog``): swapped by
``apply_to_model`` with HF's own forward's bits (bf16, fp16, fp32, mixed weights; CPU) and gradients close to
its math, or named with its reason in the one warning; weightless, optional-weight, cast-then-scale,
zero-centred and gated norms among them. A training step of a small Qwen3-Next and of a small Mamba2 (gated
norms of each semantics beside plain ones), patched, against HF's own.
"""

import copy
import importlib
import pathlib
import re
import warnings

import pytest
import torch
from conftest import rel_err

transformers = pytest.importorskip("transformers")

from tilegym_rms.integrations.hf import (  # noqa: E402
    TilegymHFGatedRMSNorm,
    TilegymHFRMSNorm,
    apply_to_model,
    catalog,
    kinds,
    patched_transformers,
    recognize,
)

# The classes of transformers 5.24 that apply_to_model leaves alone, each with a word of the reason its
# warning gives; any other must be swapped.
LEFT_ALONE = {
    "AXK2GatedRMSNorm": "submodules",  # an MLP computes its gate from the norm; its inner RMSNorm is swapped
    "HYV4UnweightedRMSNorm": "no formula",  # returns the rstd itself
    "HYV4VLUnweightedRMSNorm": "no formula",
    "IdeficsRMSNorm": "no formula",  # T5's: rounds to a 16-bit weight's dtype, not the input's
    "MuseSparkTextInputScaledRMSNorm": "no formula",  # scales by the weight, rounds, then normalizes
}

# (x dtype, weight dtype): the model's own dtype, and fp32 weights (master copies, autocast) beside 16-bit x.
PAIRS = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16),
]
# Gradients against HF's math on fp64 copies (its forward computes in fp32 inside): a few roundings of x's dtype.
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, whose spinning slows a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def entries():
    return catalog.catalog()


def hf_class(model, name):
    return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), name)


def prepared(module, w_dtype):
    """``module`` in ``w_dtype`` with an eps of 0.01 (so that reading the wrong attribute shows) and a weight
    perturbed off its initial ones or zeros (so that it matters)."""
    module = copy.deepcopy(module).to(w_dtype)
    for attr in recognize.EPS_ATTRS:
        if isinstance(getattr(module, attr, None), float):
            setattr(module, attr, 0.01)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.nn.Parameter):
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            weight.add_((torch.randn(weight.shape, generator=g) * 0.3).to(weight.device, w_dtype))
    return module


def swapped(hf_module, backend=None):
    """``apply_to_model`` on a holder of a copy of ``hf_module``: the replacement, or the warning's text."""
    holder = torch.nn.ModuleDict({"norm": copy.deepcopy(hf_module)})
    keys = list(holder.state_dict())
    weight = getattr(holder["norm"], "weight", None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        count = apply_to_model(holder, backend=backend)
    messages = [str(w.message) for w in record if "apply_to_model" in str(w.message)]
    new = holder["norm"]
    if not isinstance(new, TilegymHFRMSNorm):  # (a norm inside it may have been swapped)
        assert len(messages) == 1, messages
        return messages[0]
    assert count == 1 and not messages, messages
    # The same Parameter (none for a weightless norm), the same state_dict keys.
    assert list(holder.state_dict()) == keys
    if isinstance(weight, torch.nn.Parameter):
        assert new.weight is weight
    return new


def inputs(module, x_dtype, gated, device="cpu"):
    """``[x]``, or ``[x, gate]`` for a gated norm, of ``module``'s width."""
    weight = getattr(module, "weight", None)
    width = weight.shape[0] if isinstance(weight, torch.Tensor) else catalog.WIDTH
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(3, 5, width, generator=g) * 4] + (
        [torch.randn(3, 5, width, generator=g) * 2] if gated else []
    )
    return [t.to(device, x_dtype) for t in tensors]


def check_forward_bits(hf_module, ours, x_dtype):
    gated = isinstance(ours, TilegymHFGatedRMSNorm)
    tensors = inputs(hf_module, x_dtype, gated)
    with torch.no_grad():
        want, got = hf_module(*tensors), ours(*tensors)
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} differ"
        if gated:
            try:
                plain = hf_module(tensors[0])  # the class's own plain norm, where its forward takes no gate
            except Exception:  # noqa: BLE001 (Qwen3-Next's needs a gate; ours then normalizes without one)
                return
            assert torch.equal(ours(tensors[0]), plain)


def check_gradients(hf_module, ours, tensors, tol):
    """Ours against HF's forward on fp64 copies of the inputs and weight (fp32 math inside, as it casts)."""
    mine = [t.clone().requires_grad_(True) for t in tensors]
    exact = [t.detach().double().requires_grad_(True) for t in tensors]
    hf64 = copy.deepcopy(hf_module).double()
    params = [ours.weight] if ours.weight is not None else []
    y = ours(*mine)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.device, y.dtype)
    got = torch.autograd.grad(y, mine + params, dy)
    want = torch.autograd.grad(hf64(*exact), exact + ([hf64.weight] if params else []), dy.double())
    names = ["dx", "dz"][: len(tensors)] + ["dw"] * len(params)
    for name, a, b, t in zip(names, got, want, mine + params, strict=True):
        assert a.dtype == t.dtype, name
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))


def test_catalog_lists_every_rmsnorm_class_in_the_sources(entries):
    """Against the class statements of the modeling files, read as text."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    in_sources = set()
    for path in root.glob("*/modeling_*.py"):
        if path.name != f"modeling_{path.parent.name}.py":
            continue
        names = set(re.findall(r"^\s*class (\w*RMSNorm\w*)\(", path.read_text(), re.M))
        try:
            importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        except Exception:  # noqa: BLE001 (a model whose optional dependency is missing)
            continue
        in_sources |= names
    assert {e.cls.__name__ for e in entries} == in_sources


def test_every_rmsnorm_class_is_swapped_with_hf_bits_or_named_with_its_reason(entries):
    failures = []
    for entry in entries:
        label = f"{entry.cls.__name__}{dict(entry.settings) or ''}"
        module = catalog.build(entry.cls, dict(entry.settings))
        if isinstance(module, str):
            failures.append(f"{label}: the catalog cannot build it (its __init__ needs {module})")
            continue
        try:
            for x_dtype, w_dtype in PAIRS:
                hf_module = prepared(module, w_dtype)
                ours = swapped(hf_module)
                if isinstance(ours, str):
                    reason = LEFT_ALONE.get(label)
                    assert reason is not None, f"left alone: {ours}"
                    assert re.search(rf"{entry.cls.__name__} \([^)]*{reason}", ours), ours
                    break
                check_forward_bits(hf_module, ours, x_dtype)
                if x_dtype == w_dtype:
                    gated = isinstance(ours, TilegymHFGatedRMSNorm)
                    check_gradients(hf_module, ours, inputs(hf_module, x_dtype, gated), GRAD_TOL[x_dtype])
        except AssertionError as e:
            failures.append(f"{label}, x {x_dtype}, weight {w_dtype}: {e}")
    assert not failures, "\n".join(failures[:20])


def test_the_formulas_of_the_plain_variants_are_recognised(entries):
    """Which kind each family of the plain variants gets: a wrong kind could still pass the bits above only
    where two kinds agree (they do without a weight), so the weighted ones are named here."""

    def kind(name, **settings):
        (cls,) = {e.cls for e in entries if e.cls.__name__ == name}
        match = recognize.match_module(catalog.build(cls, settings))
        return (match.kind.name, match.weighted, match.kind.eps_attr, match.group_size)

    assert kind("Llama4TextRMSNorm") == ("llama", True, "eps", None)
    assert kind("Gemma4RMSNorm", with_scale=True) == ("olmo2", True, "eps", None)
    assert kind("Gemma4RMSNorm", with_scale=False)[1:] == (False, "eps", None)
    assert kind("NemotronHRMSNorm") == ("olmo2", True, "variance_epsilon", None)
    assert kind("MuseSparkTextCenteredRMSNorm") == ("centered", True, "eps", None)
    assert kind("Qwen4ExpTextRMSNorm") == ("gemma", True, "eps", None)
    assert kind("Qwen4ExpTextRMSNorm", group_size=16) == ("gemma", True, "eps", 16)
    assert kind("DeepseekV4UnweightedRMSNorm") == ("deepseek_v4", False, "eps", None)
    assert kind("NanoChatRMSNorm")[1:] == (False, "eps", None)


def test_centered_weight_rounds_one_plus_w_in_its_dtype():
    """MuseSpark's ``(1 + w).float()``: with a bf16 weight, 1 + w rounds in bf16 first; Gemma's
    ``1 + w.float()`` does not. Both kinds give each class's own bits."""
    weight = torch.full((64,), 2**-9 + 2**-12, dtype=torch.bfloat16)  # 1 + w is not a bf16 number
    x = torch.randn(4, 64).to(torch.bfloat16)
    centered = kinds.hf_rms_norm(x, weight, 1e-6, kinds.CENTERED, "torch")
    gemma = kinds.hf_rms_norm(x, weight, 1e-6, kinds.GEMMA, "torch")
    r = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(centered, (x.float() * r * (1 + weight).float()).to(torch.bfloat16))
    assert torch.equal(gemma, (x.float() * r * (1 + weight.float())).to(torch.bfloat16))
    assert not torch.equal(centered, gemma)


def test_patch_transformers_on_a_class_recognised_by_behaviour():
    """Llama4's norm keeps eps as ``eps`` and has its own code: the class patch reads eps from there."""
    cls = importlib.import_module("transformers.models.llama4.modeling_llama4").Llama4TextRMSNorm
    hf_module = prepared(cls(64, eps=0.5), torch.bfloat16)
    x = (torch.randn(3, 64) * 4).to(torch.bfloat16)
    want = hf_module(x)
    with patched_transformers([cls], backend="torch") as names:
        assert names == ["Llama4TextRMSNorm"]
        got = hf_module(x)
        assert hf_module.forward.__func__ is not recognize._original_forward(cls)
    assert torch.equal(got, want)


def test_the_sigmoid_gated_classes_are_recognised(entries):
    """Kimi-Linear's, Bailing-hybrid's and GLM-5-Next's gated norms: fp32 throughout (olmo2), one group, the
    sigmoid gate after the norm; the bits above cannot tell a sigmoid gate from a silu one that happens to agree,
    so the match is named."""
    for name in ("KimiLinearRMSNormGated", "BailingHybridRMSNormGated", "Glm5NextTextRMSNormGated"):
        (cls,) = {e.cls for e in entries if e.cls.__name__ == name}
        match = recognize.match_module(catalog.build(cls, {}))
        assert (match.kind.name, match.group_size, match.norm_before_gate, match.activation) == (
            "olmo2",
            None,
            True,
            "sigmoid",
        ), name
    qwen = recognize.match_module(catalog.build(hf_class("qwen3_next", "Qwen3NextRMSNormGated"), {}))
    assert qwen.activation == "silu"


def test_left_alone_modules_are_named_once_with_reasons():
    """A model holding several unsupported norms gets one warning naming each class with its reason: a gate of
    another activation than silu and sigmoid is one."""
    hy = importlib.import_module("transformers.models.hy_v4.modeling_hy_v4")
    cls = hf_class("bailing_hybrid", "BailingHybridRMSNormGated")
    model = torch.nn.ModuleDict({"a": cls(64), "b": cls(64), "c": hy.HYV4UnweightedRMSNorm()})
    for name in ("a", "b"):
        model[name].activation = "gelu"  # a setting its forward reads: ACT2FN["gelu"]
    with pytest.warns(UserWarning) as record:
        assert apply_to_model(model) == 0
    assert len(record) == 1
    message = str(record[0].message)
    assert "BailingHybridRMSNormGated (its gate is gelu; gated_rms_norm gates with silu or sigmoid)" in message
    assert "HYV4UnweightedRMSNorm (it computes no formula this integration knows)" in message


GATED_AND_GROUPED = [
    ("qwen3_next", "Qwen3NextRMSNormGated", {}, torch.float32),  # a wider weight: HF's product stays in torch
    ("mamba2", "MambaRMSNormGated", {"group_size": 16}, torch.bfloat16),
    ("falcon_h1", "FalconH1RMSNormGated", {"n_groups": 4, "norm_before_gate": False}, torch.bfloat16),
    ("kimi_linear", "KimiLinearRMSNormGated", {}, torch.float32),  # the sigmoid gate
    ("qwen4_exp", "Qwen4ExpTextRMSNorm", {"group_size": 16}, torch.bfloat16),  # groups, no gate
]


@pytest.mark.parametrize("model,name,settings,w_dtype", GATED_AND_GROUPED)
def test_swapped_gated_and_grouped_norms_compile_fullgraph_with_hf_bits(model, name, settings, w_dtype):
    hf_module = prepared(hf_class(model, name)(64, **settings), w_dtype)
    ours = swapped(hf_module, backend="torch")
    gated = isinstance(ours, TilegymHFGatedRMSNorm)
    tensors = inputs(hf_module, torch.bfloat16, gated)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            assert torch.equal(compiled(*tensors), hf_module(*tensors))
            if gated and model not in ("qwen3_next", "kimi_linear"):  # without the gate (their forward needs it)
                assert torch.equal(compiled(tensors[0]), hf_module(tensors[0]))
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# A training step of small hybrid models, each semantics of the gated norm: Qwen3-Next normalizes before its gate
# (gated norms in its linear-attention layers, Gemma-style ones elsewhere), Mamba2 gates first, in groups
# ----------------------------------------------------------------------------------------------


def qwen3_next(dtype, device="cpu"):
    config = transformers.Qwen3NextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=64, max_position_embeddings=64, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    return random_norm_weights(config, dtype, device)


def mamba2(dtype, device="cpu"):
    # Two groups of 64 columns: the gated norm of each mixer normalizes per group.
    config = transformers.Mamba2Config(
        vocab_size=64, hidden_size=64, state_size=16, num_heads=8, head_dim=16, expand=2, n_groups=2,
        num_hidden_layers=2, chunk_size=8, tie_word_embeddings=False,
    )  # fmt: skip
    return random_norm_weights(config, dtype, device)


def random_norm_weights(config, dtype, device):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device, dtype)
    with torch.no_grad():
        for m in model.modules():
            if "RMSNorm" in type(m).__name__:
                m.weight.add_(torch.randn_like(m.weight) * 0.3)
    return model


# model builder: (norms swapped, of which gated): Qwen3-Next 2 per layer, q/k norms, the final one, 1 gated;
# Mamba2 one per layer and the final one, 1 gated per mixer.
MODELS = {"qwen3_next": (qwen3_next, 8, 1), "mamba2": (mamba2, 5, 2)}


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return out


def check_training(name, dtype, device, backend, exact, tol):
    build, swapped, gated = MODELS[name]
    ref = build(dtype, device)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # every norm of the model is swapped
        assert apply_to_model(model, backend=backend) == swapped
    assert sum(isinstance(m, TilegymHFGatedRMSNorm) for m in model.modules()) == gated
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    for step in range(2):
        out_ref, out = train_step(ref, ids), train_step(model, ids)
        if exact and step == 0:
            assert torch.equal(out.loss, out_ref.loss) and torch.equal(out.logits, out_ref.logits)
        assert rel_err(out.loss, out_ref.loss) <= tol, step
        # Over all parameters at once: a bf16 gradient of a few tiny entries (A_log's) is a few ulps apart alone.
        assert list(dict(model.named_parameters())) == list(dict(ref.named_parameters()))
        grads = [torch.cat([p.grad.flatten().double() for p in m.parameters()]) for m in (model, ref)]
        assert rel_err(*grads) <= tol, step


@pytest.mark.filterwarnings("ignore:.*falling back to its reference PyTorch implementation")
@pytest.mark.parametrize("name", MODELS)
def test_training_step_matches_hf_bf16(name):
    # bf16: the first step's loss and logits are HF's bits; the second step starts from weights that the
    # backward (exact derivative of the fp32 math, not HF's rounded one) moved a few ulps apart.
    check_training(name, torch.bfloat16, "cpu", "torch", exact=True, tol=2e-2)


@pytest.mark.filterwarnings("ignore:.*falling back to its reference PyTorch implementation")
@pytest.mark.parametrize("name", MODELS)
def test_training_step_matches_hf_fp32(name):
    # The first step's loss and logits are HF's bits; later steps follow the exact derivative (see the bf16 test).
    check_training(name, torch.float32, "cpu", "torch", exact=True, tol=1e-5)


# ----------------------------------------------------------------------------------------------
# GPU kernels
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cutile", "triton"])
def test_every_swapped_formula_on_gpu(entries, backend):
    """One module of each distinct formula (kind, weight, gating) on the GPU kernels: outputs within one
    rounding of HF's on the GPU, gradients close to HF's math in fp64."""
    if backend == "triton":
        pytest.importorskip("triton")
    seen, failures = set(), []
    for entry in entries:
        if not entry.swapped or entry.action in seen:
            continue
        seen.add(entry.action)
        module = catalog.build(entry.cls, dict(entry.settings))
        for x_dtype in (torch.bfloat16, torch.float16, torch.float32):
            try:
                hf_module = prepared(module, x_dtype).cuda()
                ours = swapped(hf_module, backend=backend)
                tensors = inputs(hf_module, x_dtype, isinstance(ours, TilegymHFGatedRMSNorm), "cuda")
                with torch.no_grad():
                    got, want = ours(*tensors), hf_module(*tensors)
                assert got.dtype == want.dtype
                tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[x_dtype]
                assert rel_err(got, want) <= tol, rel_err(got, want)
                check_gradients(hf_module, ours, tensors, 2 * GRAD_TOL[x_dtype])
            except AssertionError as e:
                failures.append(f"{entry.cls.__name__} ({entry.action}), {x_dtype}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:.*falling back to its reference PyTorch implementation")
@pytest.mark.parametrize("name", MODELS)
def test_training_step_matches_hf_gpu(name):
    # The kernels sum in another order than torch: a few bf16 ulps from HF's values (as test_hf's GPU model test).
    check_training(name, torch.bfloat16, "cuda", None, exact=False, tol=5e-2)
