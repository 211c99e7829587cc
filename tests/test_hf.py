"""Hugging Face transformers integration (tilegym_rms.integrations.hf): for each supported family, a
patched tiny model matches the unpatched one (logits, loss, every grad, state_dict, the same Parameter
objects), in fp32, bf16 and under bf16 autocast, with PEFT LoRA, under torch.compile, and through the
class-level patch. Models are built from tiny configs (no downloads) and run on the CPU (torch backend);
the ``gpu`` tests repeat the module parity on the GPU kernels.
"""

import copy
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from conftest import rel_err

transformers = pytest.importorskip("transformers")

from tilegym_rms.integrations import hf  # noqa: E402
from tilegym_rms.integrations.hf import (  # noqa: E402
    TilegymHFRMSNorm,
    apply_to_model,
    kinds,
    patch_transformers,
    patched_transformers,
    recognize,
    unpatch_transformers,
)
from tilegym_rms.integrations.hf import patch as class_patch  # noqa: E402

FAMILIES = list(hf.FAMILIES)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Models this small gain nothing from intra-op threads, and their spinning triples the wall time
    when the cores are busy (as on a shared CI machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


VOCAB = 64


def _config(family: str, layers: int = 2):
    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    head_dim = {"head_dim": 16}
    return {
        "llama": lambda: transformers.LlamaConfig(**common),
        "mistral": lambda: transformers.MistralConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common, **head_dim),
        "phi3": lambda: transformers.Phi3Config(**common),
        "gemma": lambda: transformers.GemmaConfig(**common, **head_dim),
        "gemma2": lambda: transformers.Gemma2Config(**common, **head_dim),
        "gemma3": lambda: transformers.Gemma3TextConfig(**common, **head_dim),
        "olmo2": lambda: transformers.Olmo2Config(**common),
    }[family]()


# Norm modules per decoder layer (Qwen3, Gemma3 and Olmo2 add q_norm and k_norm), plus the final norm.
NORMS_PER_LAYER = {"qwen3": 4, "gemma2": 4, "gemma3": 6, "olmo2": 4}


def expected_norms(family: str, layers: int = 2) -> int:
    return NORMS_PER_LAYER.get(family, 2) * layers + 1


def hf_class(family: str):
    return recognize.family_class(family)


def build(family: str, layers: int = 2, dtype=torch.float32, seed: int = 0):
    """A tiny random model whose norm weights are perturbed, so that the weight (and Gemma's offset) matters."""
    torch.manual_seed(seed)
    # .to(dtype) rather than from_config(dtype=...): transformers 4.x names that argument torch_dtype.
    model = transformers.AutoModelForCausalLM.from_config(_config(family, layers)).to(dtype)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.add_(torch.randn_like(m.weight) * 0.3)
    return model


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    return ids, ids.clone()


def run(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out


def assert_grads_match(model, ref, tol):
    grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert got.keys() == grads.keys()
    for name, g in grads.items():
        assert got[name] is not None, name
        assert rel_err(got[name], g) <= tol, (name, rel_err(got[name], g))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of tilegym_rms.rms_norm from the integration: equal outputs alone would not show
    that our kernels ran (the torch backend computes HF's formulas exactly)."""
    calls = []
    real = kinds.rms_norm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kinds, "rms_norm", counting)
    return calls


def count_hf_norms(model, family: str) -> int:
    cls = hf_class(family)
    return sum(type(m) is cls for m in model.modules())


# ----------------------------------------------------------------------------------------------
# Optional dependency
# ----------------------------------------------------------------------------------------------


def test_tilegym_import_does_not_import_transformers_and_missing_transformers_names_the_extra():
    code = """
        import sys
        import tilegym_rms, tilegym_rms.integrations
        from tilegym_rms.integrations import hf  # the module itself imports transformers lazily
        assert "transformers" not in sys.modules, "importing tilegym_rms pulled in transformers"
        sys.modules["transformers"] = None  # as if it were not installed
        import torch
        try:
            hf.apply_to_model(torch.nn.Linear(2, 2))
        except ImportError as e:
            assert "pip install 'tilegym_rms[hf]'" in str(e), e
            print("ok")
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


# ----------------------------------------------------------------------------------------------
# Per family: fp32 parity, count, state_dict, Parameter identity
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_to_model_fp32_parity(family, kernel_calls):
    ref = build(family)
    model = copy.deepcopy(ref)
    params_before = dict(model.named_parameters())
    final_norm_weight = model.model.norm.weight
    assert count_hf_norms(model, family) == expected_norms(family)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every norm of these families is known: no warning
        assert apply_to_model(model) == expected_norms(family)
    assert count_hf_norms(model, family) == 0
    assert sum(isinstance(m, TilegymHFRMSNorm) for m in model.modules()) == expected_norms(family)
    assert apply_to_model(model) == 0  # idempotent

    # The same Parameter objects: a careless patch would build new ones (and lose optimizer state, ties).
    assert model.model.norm.weight is final_norm_weight
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is p for n, p in params_before.items())

    # state_dict: same keys, same tensors, and it loads both ways.
    sd, sd_ref = model.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)
    assert all(torch.equal(sd[k], sd_ref[k]) for k in sd)
    copy.deepcopy(ref).load_state_dict(sd, strict=True)
    model.load_state_dict(sd_ref, strict=True)
    assert model.model.norm.weight is final_norm_weight

    ids, labels = batch()
    out_ref = run(ref, ids, labels)
    assert not kernel_calls
    out = run(model, ids, labels)
    assert len(kernel_calls) == expected_norms(family)  # each norm runs once per forward
    assert out.logits.dtype == out_ref.logits.dtype
    assert rel_err(out.logits, out_ref.logits) <= 1e-5
    assert rel_err(out.loss, out_ref.loss) <= 1e-5
    assert_grads_match(model, ref, 1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_to_model_bf16_and_autocast(family):
    """A bf16 model, and an fp32 model under bf16 autocast (fp32 weights meet bf16 activations in the
    q/k norms of Qwen3, Gemma3 and Olmo2): same output dtype as HF, values within bf16 rounding."""
    ids, labels = batch()
    ref = build(family, dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    apply_to_model(model)
    out_ref, out = run(ref, ids, labels), run(model, ids, labels)
    assert out.logits.dtype == out_ref.logits.dtype == torch.bfloat16
    # Within one bf16 rounding (on the CPU the torch backend's forward is in fact bit-exact).
    assert rel_err(out.logits, out_ref.logits) <= 2**-7
    assert rel_err(out.loss, out_ref.loss) <= 2**-7
    # HF's autograd reduces the llama kind's weight grad in bf16; ours accumulates in fp32.
    assert_grads_match(model, ref, 5e-2)

    ref = build(family)
    model = copy.deepcopy(ref)
    apply_to_model(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, out = run(ref, ids, labels), run(model, ids, labels)
    assert out.logits.dtype == out_ref.logits.dtype
    assert rel_err(out.logits, out_ref.logits) <= 2**-7
    assert_grads_match(model, ref, 1e-2)


# Input and weight dtypes that meet in practice: a 16-bit model, fp32 master weights under autocast,
# and mixes where the weight's dtype wins the promotion (HF's llama formula then returns fp32).
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.bfloat16),
]


def check_module_parity(hf_module, x_dtype, device, backend=None):
    kind = recognize.kind_of(type(hf_module))
    ours = TilegymHFRMSNorm(hf_module.weight, getattr(hf_module, kind.eps_attr), kind.name, backend=backend)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 5, hf_module.weight.shape[0], generator=g) * 4).to(device, x_dtype)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    y_hf, y = hf_module(xs[0]), ours(xs[1])
    assert y.dtype == y_hf.dtype
    # One rounding of the output dtype apart at most (fp32 when HF's result is fp32).
    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}[y.dtype]
    torch.testing.assert_close(y.float(), y_hf.float(), rtol=tol, atol=tol)
    dy = torch.randn(y.shape, generator=g).to(device, y.dtype)
    dx_hf, dw_hf = torch.autograd.grad(y_hf, (xs[0], hf_module.weight), dy)
    dx, dw = torch.autograd.grad(y, (xs[1], ours.weight), dy)
    assert dx.dtype == dx_hf.dtype and dw.dtype == dw_hf.dtype
    # HF's autograd rounds in the input dtype between steps; ours rounds once: a few ulps apart.
    gtol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[x_dtype]
    assert rel_err(dx, dx_hf) <= gtol
    assert rel_err(dw, dw_hf) <= gtol


@pytest.mark.parametrize("family", ["llama", "gemma3", "olmo2"])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS)
def test_module_parity_over_dtypes(family, x_dtype, w_dtype):
    torch.manual_seed(0)
    module = hf_class(family)(48, eps=1e-5).to(w_dtype)
    with torch.no_grad():
        module.weight.add_(torch.randn(48).to(w_dtype) * 0.3)
    check_module_parity(module, x_dtype, "cpu")


# ----------------------------------------------------------------------------------------------
# PEFT LoRA
# ----------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_patches_and_trains(family):
    peft = pytest.importorskip("peft")

    def lora(model):
        torch.manual_seed(7)  # LoRA A is random: the same seed gives the same adapters
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
        return peft.get_peft_model(model, cfg)

    base = build(family, layers=1)
    ref = lora(copy.deepcopy(base))
    wrapped_then_patched = lora(copy.deepcopy(base))
    assert apply_to_model(wrapped_then_patched) == expected_norms(family, 1)
    patched_then_wrapped = copy.deepcopy(base)
    assert apply_to_model(patched_then_wrapped) == expected_norms(family, 1)
    patched_then_wrapped = lora(patched_then_wrapped)

    ids, labels = batch()
    losses = {}
    for name, model in (("ref", ref), ("a", wrapped_then_patched), ("b", patched_then_wrapped)):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        first = run(model, ids, labels).loss
        opt.step()
        with torch.no_grad():
            second = model(input_ids=ids, labels=labels).loss
        losses[name] = (first.item(), second.item())
        assert torch.isfinite(second)
    for name in ("a", "b"):
        for got, want in zip(losses[name], losses["ref"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (name, losses)
    assert losses["ref"][1] != losses["ref"][0]  # the step changed the adapters


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


def graph_breaks(model, ids, labels, backend, backward):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = torch.compile(model, backend=backend)(input_ids=ids, labels=labels)
    if backward:
        model.zero_grad(set_to_none=True)
        out.loss.backward()
    return sum(torch._dynamo.utils.counters["graph_break"].values()), out


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_patched_model_has_no_more_graph_breaks(family, kernel_calls):
    ids, labels = batch()
    ref = build(family, layers=1)
    model = copy.deepcopy(ref)
    apply_to_model(model)
    try:
        # aot_eager traces our custom ops' fake kernels and autograd formulas, forward and backward.
        got, out = graph_breaks(model, ids, labels, "aot_eager", backward=True)
        if got:
            # Dynamo counts graph breaks before any backend runs: the baseline needs no AOT pass.
            base, _ = graph_breaks(ref, ids, labels, "eager", backward=False)
            assert got <= base, (got, base)
    finally:
        torch._dynamo.reset()
    assert len(kernel_calls) == expected_norms(family, 1)  # traced once each into the graph
    out_ref = run(ref, ids, labels)
    assert rel_err(out.logits, out_ref.logits) <= 1e-5
    assert_grads_match(model, ref, 1e-5)


def test_class_patch_compiles_fullgraph():
    ids, labels = batch()
    ref = build("qwen3", layers=1)
    with patched_transformers("qwen3"):
        model = copy.deepcopy(ref)
        try:
            torch._dynamo.reset()
            out = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=labels)
            out.loss.backward()
        finally:
            torch._dynamo.reset()
    out_ref = run(ref, ids, labels)
    assert rel_err(out.logits, out_ref.logits) <= 1e-5
    assert_grads_match(model, ref, 1e-5)


# ----------------------------------------------------------------------------------------------
# patch_transformers: class level
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_transformers_before_from_config(family, kernel_calls):
    cls = hf_class(family)
    original = cls.forward
    ref = build(family)
    ids, labels = batch()
    out_ref = run(ref, ids, labels)
    with patched_transformers([family]) as names:
        assert names == [cls.__name__]
        assert cls.forward is not original
        patch_transformers([family])  # idempotent: still one level deep
        assert getattr(cls.forward, recognize.ORIGINAL_ATTR) is original
        model = build(family)  # the same seed: the same weights, built while patched
        assert count_hf_norms(model, family) == expected_norms(family)  # modules stay HF's
        assert list(model.state_dict()) == list(ref.state_dict())
        out = run(model, ids, labels)
        assert len(kernel_calls) == expected_norms(family)
    assert cls.forward is original
    assert rel_err(out.logits, out_ref.logits) <= 1e-5
    assert rel_err(out.loss, out_ref.loss) <= 1e-5
    assert_grads_match(model, ref, 1e-5)


def test_patch_transformers_api():
    llama, gemma = hf_class("llama"), hf_class("gemma")
    originals = {c: c.forward for c in (llama, gemma)}
    try:
        assert patch_transformers(["llama", gemma]) == ["LlamaRMSNorm", "GemmaRMSNorm"]
        with patched_transformers("llama"):  # already patched: left patched on exit
            pass
        assert llama.forward is not originals[llama]
        assert unpatch_transformers("gemma") == ["GemmaRMSNorm"]
        assert gemma.forward is originals[gemma]
        assert sorted(patch_transformers()) == sorted(hf_class(f).__name__ for f in FAMILIES)
    finally:
        unpatch_transformers()
    assert all(c.forward is f for c, f in originals.items())
    assert not class_patch._CLASS_PATCHES
    with pytest.raises(ValueError, match="unknown family"):
        patch_transformers("t5")
    with pytest.raises(ValueError, match="known RMSNorm kind"):
        patch_transformers(torch.nn.RMSNorm)

    # A model built under the class patch is still recognised (from the original code) by apply_to_model.
    with patched_transformers("llama"):
        model = build("llama")
        assert apply_to_model(model) == expected_norms("llama")


# ----------------------------------------------------------------------------------------------
# Which classes are replaced, which are reported
# ----------------------------------------------------------------------------------------------


def _llama_norm_copy():
    """A class with LlamaRMSNorm's source under another name, as transformers' generated copies are."""
    import inspect

    src = inspect.getsource(hf_class("llama")).replace("LlamaRMSNorm", "MyCopiedRMSNorm")
    src = "\n".join(line for line in src.splitlines() if not line.startswith("@"))
    # Under the module's own imports: CPython compiles attribute calls on an imported module differently.
    namespace = {}
    exec("import torch\nfrom torch import nn\n" + textwrap.dedent(src), namespace)
    return namespace["MyCopiedRMSNorm"]


def test_subclasses_copies_and_unknown_classes():
    llama = hf_class("llama")

    class MyLlamaRMSNorm(llama):  # a subclass that keeps the formula: replaced
        pass

    class OverriddenRMSNorm(llama):  # changes the formula: left alone, reported
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    class StrangeRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.weight

    copied = _llama_norm_copy()
    model = torch.nn.ModuleDict(
        {
            "sub": MyLlamaRMSNorm(8),
            "over": OverriddenRMSNorm(8),
            "odd": StrangeRMSNorm(),
            "copy": copied(8),
            "torch": torch.nn.RMSNorm(8),
            "ours": TilegymHFRMSNorm(torch.nn.Parameter(torch.ones(8)), 1e-6),
            "list": torch.nn.ModuleList([torch.nn.Linear(8, 8), llama(8)]),
        }
    )
    shared = model["sub"]
    model["again"] = shared  # one module under two names: replaced once, by one module

    with pytest.warns(UserWarning) as record:
        assert apply_to_model(model, match_copies=False) == 2
    assert len(record) == 1
    message = str(record[0].message)
    for name in ("MyCopiedRMSNorm", "OverriddenRMSNorm", "StrangeRMSNorm", "RMSNorm"):
        assert name in message
    assert isinstance(model["sub"], TilegymHFRMSNorm) and model["again"] is model["sub"]
    assert isinstance(model["list"][1], TilegymHFRMSNorm)
    assert type(model["over"]) is OverriddenRMSNorm and type(model["copy"]) is copied

    with pytest.warns(UserWarning, match="OverriddenRMSNorm"):
        assert apply_to_model(model) == 1  # the copy, now that copies count
    assert isinstance(model["copy"], TilegymHFRMSNorm) and model["copy"].kind == "llama"


class Olmo2Formula(torch.nn.Module):
    """Olmo2's RMSNorm as of transformers 5 (older releases had Llama's): the weight multiplies in fp32."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


def test_probe_tells_the_formulas_apart():
    llama, gemma = hf_class("llama"), hf_class("gemma")
    assert (
        recognize._probe(kinds.LLAMA, llama)
        and recognize._probe(kinds.GEMMA, gemma)
        and recognize._probe(kinds.OLMO2, Olmo2Formula)
    )
    # Olmo2 multiplies before rounding, Llama after: the probe's inputs make that visible.
    assert not recognize._probe(kinds.LLAMA, Olmo2Formula)
    assert not recognize._probe(kinds.OLMO2, llama)
    assert not recognize._probe(kinds.GEMMA, llama)
    assert not recognize._probe(kinds.LLAMA, gemma)
    # Whatever this transformers' Olmo2RMSNorm computes, it is given the kind whose probe it passes.
    olmo2 = hf_class("olmo2")
    assert recognize._probe(recognize.kind_of(olmo2), olmo2)


def test_hooks_and_accelerate_hook_move_to_the_replacement():
    model = build("llama", layers=1)
    calls = []
    handle = model.model.norm.register_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
    accelerate_hooks = pytest.importorskip("accelerate.hooks")

    class Count(accelerate_hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append("pre")
            return args, kwargs

    accelerate_hooks.add_hook_to_module(model.model.layers[0].input_layernorm, Count())
    apply_to_model(model)
    ids, labels = batch()
    model(input_ids=ids, labels=labels)
    assert calls == ["pre", "TilegymHFRMSNorm"]
    handle.remove()
    model(input_ids=ids, labels=labels)
    assert calls == ["pre", "TilegymHFRMSNorm", "pre"]


def test_fsdp_wrapped_model_is_refused():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "FSDPModule"):
        pytest.skip("this torch has no FSDPModule")
    model = build("llama", layers=1)
    # fully_shard swaps a module's class for a subclass of FSDPModule; that is what is detected.
    layer = model.model.layers[0]
    layer.__class__ = type("FSDPLlamaDecoderLayer", (fsdp.FSDPModule, type(layer)), {})
    with pytest.raises(RuntimeError, match="before FSDP"):
        apply_to_model(model)


# ----------------------------------------------------------------------------------------------
# The HF kernels package, offline
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3", "olmo2"])
def test_kernelize_model_with_the_local_kernels_layer(family, kernel_calls):
    pytest.importorskip("kernels")
    ids, labels = batch()
    ref = build(family, layers=1)
    model = copy.deepcopy(ref)
    params = dict(model.named_parameters())
    hf.kernelize_model(model, device="cpu")
    norms = [m for m in model.modules() if type(m) is hf_class(family)]
    assert len(norms) == expected_norms(family, 1)  # kernels swaps forwards, not modules
    assert all(m.forward.__func__ is hf.TilegymKernelsRMSNorm.forward for m in norms)
    assert all(p is params[n] for n, p in model.named_parameters())
    out_ref, out = run(ref, ids, labels), run(model, ids, labels)
    assert len(kernel_calls) == len(norms)
    assert rel_err(out.logits, out_ref.logits) <= 1e-5
    assert_grads_match(model, ref, 1e-5)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=labels)
    finally:
        torch._dynamo.reset()
    assert rel_err(compiled.logits, out_ref.logits) <= 1e-5


# ----------------------------------------------------------------------------------------------
# GPU kernels
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cutile", "triton"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "olmo2"])
def test_module_parity_over_dtypes_gpu(family, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    for x_dtype, w_dtype in DTYPE_PAIRS:
        torch.manual_seed(0)
        module = hf_class(family)(512, eps=1e-5).to("cuda", w_dtype)
        with torch.no_grad():
            module.weight.add_(torch.randn(512, device="cuda").to(w_dtype) * 0.3)
        try:
            check_module_parity(module, x_dtype, "cuda", backend=backend)
        except AssertionError as e:
            raise AssertionError(f"x {x_dtype}, weight {w_dtype}: {e}") from e


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_apply_to_model_bf16_gpu(family):
    ids, labels = (t.cuda() for t in batch())
    ref = build(family, dtype=torch.bfloat16).cuda()
    model = copy.deepcopy(ref)
    apply_to_model(model)
    out_ref, out = run(ref, ids, labels), run(model, ids, labels)
    assert out.logits.dtype == out_ref.logits.dtype
    assert rel_err(out.logits, out_ref.logits) <= 2e-2
    assert_grads_match(model, ref, 5e-2)
