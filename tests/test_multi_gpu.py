"""Two GPUs in one process: every op runs on the device of its tensors, whatever device is current.

Marker ``gpu``; skipped with fewer than two CUDA devices. Device 0 stays current throughout (as with
Hugging Face ``device_map="auto"``, pipeline stages in one process, or a second model on another card)
while the tensors live on device 1. Each result is compared bit for bit with the same call on device 0:
the cards are alike, so the same kernels give the same bits. Run with
``pytest -m gpu tests/test_multi_gpu.py`` on a machine with two GPUs.
"""

import threading

import pytest
import torch

import tilegym_rms
from tilegym_rms import reference
from tilegym_rms.testing import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

BACKENDS = ["cutile", "triton"]
EPS = 1e-6
HOME, OTHER = torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.fixture(autouse=True)
def _device_zero_current(monkeypatch):
    monkeypatch.setenv("TILEGYM_RMS_SILENCE_EXPERIMENTAL", "1")
    torch.cuda.set_device(0)
    yield
    assert torch.cuda.current_device() == 0, "a call left another device current"


def _data(m, n, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, dy


def _on(device, *tensors, grad=False):
    return [t.to(device).requires_grad_(grad) for t in tensors]


def _assert_same(on_other, on_home, what):
    for i, (a, b) in enumerate(zip(on_other, on_home, strict=True)):
        assert a.device == OTHER, f"{what}[{i}] is on {a.device}, not on the inputs' device"
        assert torch.equal(a.cpu(), b.cpu()), f"{what}[{i}] differs from the same call on device 0"


def _norm_step(device, backend, x, w, dy):
    xd, wd = _on(device, x, w, grad=True)
    y = tilegym_rms.rms_norm(xd, wd, EPS, backend=backend)
    y.backward(dy.to(device))
    return [y.detach(), xd.grad, wd.grad]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_on_another_device(backend):
    x, w, dy = _data(3000, 4096)
    other = _norm_step(OTHER, backend, x, w, dy)
    torch.cuda.synchronize(OTHER)  # an illegal access would surface here
    _assert_same(other, _norm_step(HOME, backend, x, w, dy), "y, dx, dw")
    y_ref, _ = reference.rms_norm_forward(x.double(), w.double(), EPS)
    assert rel_err(other[0].cpu(), y_ref) < 1e-2


def _fused_step(device, backend, mode, x, r, w, dy):
    xd, rd, wd = _on(device, x, r, w, grad=True)
    y, res_out = tilegym_rms.fused_add_rms_norm(xd, rd, wd, EPS, mode=mode, backend=backend)
    (y.float() * dy.to(device).float()).sum().add(res_out.float().square().sum() if mode == "pre" else 0).backward()
    return [y.detach(), res_out.detach(), xd.grad, rd.grad, wd.grad]


@pytest.mark.parametrize("mode", ["pre", "post"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_add_forward_and_backward_on_another_device(backend, mode):
    x, w, dy = _data(2048, 5120)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype)
    other = _fused_step(OTHER, backend, mode, x, r, w, dy)
    _assert_same(other, _fused_step(HOME, backend, mode, x, r, w, dy), "y, residual_out, dx, dresidual, dw")


def _in_place(device, backend, x, r, w):
    xd, rd, wd = _on(device, x, r, w)
    with torch.inference_mode():
        y = tilegym_rms.fused_add_rms_norm_(xd, rd, wd, EPS, backend=backend)
    return [y, rd]


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_fused_add_on_another_device(backend):
    x, w, _ = _data(777, 4096)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x.dtype)
    other = _in_place(OTHER, backend, x, r, w)
    _assert_same(other, _in_place(HOME, backend, x, r, w), "y, residual")
    assert torch.equal(other[1].cpu(), reference.fused_add_sum(x, r)), "the residual holds the sum"


def _qk_step(device, backend, qkv, wq, wk, dq, dk, hq, hk, d):
    qkv_d, wq_d, wk_d = _on(device, qkv, wq, wk, grad=True)
    b, s = qkv.shape[:2]
    q = qkv_d[..., : hq * d].view(b, s, hq, d)  # slices of a fused qkv projection, read in place
    k = qkv_d[..., hq * d : (hq + hk) * d].view(b, s, hk, d)
    q_out, k_out = tilegym_rms.qk_rms_norm(q, k, wq_d, wk_d, EPS, backend=backend)
    torch.autograd.backward((q_out, k_out), (dq.to(device), dk.to(device)))
    return [q_out.detach(), k_out.detach(), qkv_d.grad, wq_d.grad, wk_d.grad]


@pytest.mark.parametrize("backend", BACKENDS)
def test_qk_norm_on_another_device(backend):
    b, s, hq, hk, d = 2, 512, 16, 4, 128
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, generator=g).bfloat16()
    wq, wk = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16(), (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    dq, dk = torch.randn(b, s, hq, d, generator=g).bfloat16(), torch.randn(b, s, hk, d, generator=g).bfloat16()
    args = (qkv, wq, wk, dq, dk, hq, hk, d)
    _assert_same(_qk_step(OTHER, backend, *args), _qk_step(HOME, backend, *args), "q_out, k_out, dqkv, dwq, dwk")


def _block(x, r, w):
    """A pre-norm block's norms, as a compiled model calls them."""
    y, s = tilegym_rms.fused_add_rms_norm(x, r, w, EPS)
    return tilegym_rms.rms_norm(y * 2, w, EPS), s


def test_compile_on_another_device():
    x, w, dy = _data(1024, 2048, seed=4)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(x.dtype)
    compiled = torch.compile(_block, fullgraph=True)
    results = {}
    for device in (OTHER, HOME):
        xd, rd, wd = _on(device, x, r, w, grad=True)
        y, s = compiled(xd, rd, wd)
        (y.float() * dy.to(device).float()).sum().add(s.float().sum()).backward()
        results[device] = [y.detach(), s.detach(), xd.grad, rd.grad, wd.grad]
    _assert_same(results[OTHER], results[HOME], "compiled y, sum, dx, dresidual, dw")


def test_cuda_graph_captured_on_another_device():
    x, w, _ = _data(512, 4096, seed=6)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(x.dtype)
    xs, rs, ws = _on(OTHER, x, r, w)
    stream = torch.cuda.Stream(device=OTHER)

    def serve():
        y = tilegym_rms.fused_add_rms_norm_(xs, rs, ws, EPS)
        return tilegym_rms.rms_norm(y, ws, EPS)

    with torch.inference_mode():
        with torch.cuda.stream(stream):
            serve()  # compile and warm up outside the capture
        rs.copy_(r.to(OTHER))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = serve()
        torch.cuda.set_device(0)  # replayed with device 0 current, as a server would
        x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(8)).to(x.dtype)
        xs.copy_(x2.to(OTHER))
        rs.copy_(r.to(OTHER))
        graph.replay()
        torch.cuda.synchronize(OTHER)
        y_home = tilegym_rms.fused_add_rms_norm_(*_on(HOME, x2, r, w), EPS)
        expected = tilegym_rms.rms_norm(y_home, w.to(HOME), EPS)
    _assert_same([out], [expected], "graph output")


def test_launches_go_to_the_current_stream_of_the_tensors_device():
    """A kernel on device 1 is ordered after the work already queued on device 1's current stream (here a
    non-default one): it reads what a queued copy wrote, which a launch on another stream would not."""
    x_old, w, dy = _data(4096, 4096, seed=9)
    x_new = x_old.flip(0).contiguous()
    x, w1, dy1, x_new1 = _on(OTHER, x_old, w, dy, x_new)
    stream = torch.cuda.Stream(device=OTHER)
    with torch.cuda.device(OTHER):
        torch.cuda.set_stream(stream)
        try:
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # ~0.1 s on the stream before the copy lands
            x.copy_(x_new1)
            with torch.cuda.device(HOME):  # device 0 current, device 1's current stream the one above
                y, rstd = tilegym_rms.rms_norm_forward(x, w1, EPS, backend="cutile")
                dx, dw = tilegym_rms.rms_norm_backward(x, dy1, w1, rstd, backend="cutile")
                y_tr = tilegym_rms.rms_norm(x, w1, EPS, backend="triton")
            stream.synchronize()
        finally:
            torch.cuda.set_stream(torch.cuda.default_stream(OTHER))
    y_ref, rstd_ref = tilegym_rms.rms_norm_forward(*_on(HOME, x_new, w), EPS, backend="cutile")
    dx_ref, dw_ref = tilegym_rms.rms_norm_backward(*_on(HOME, x_new, dy, w), rstd_ref, backend="cutile")
    _assert_same([y, rstd, dx, dw], [y_ref, rstd_ref, dx_ref, dw_ref], "cutile y, rstd, dx, dw")
    _assert_same([y_tr], [tilegym_rms.rms_norm(*_on(HOME, x_new, w), EPS, backend="triton")], "triton y")


def test_two_threads_each_driving_its_own_gpu():
    x, w, dy = _data(2048, 4096, seed=10)
    expected = {device: _norm_step(device, "cutile", x, w, dy) for device in (HOME, OTHER)}
    results, errors = {}, []

    def drive(device):
        try:  # a new thread starts with device 0 current: the thread on device 1 never makes it current
            for _ in range(30):
                results[device] = _norm_step(device, "cutile", x, w, dy)
            torch.cuda.synchronize(device)
        except Exception as exc:  # reported by the main thread
            errors.append(f"{device}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=drive, args=(device,)) for device in (HOME, OTHER)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    _assert_same(results[OTHER], expected[OTHER], "thread on device 1")
    assert all(torch.equal(a, b) for a, b in zip(results[HOME], expected[HOME], strict=True))


@pytest.mark.parametrize("op", [
    lambda a, b: tilegym_rms.rms_norm(a, b.new_ones(a.shape[-1])),
    lambda a, b: tilegym_rms.rms_norm_backward(a, b, None, torch.ones(a.shape[0], device=a.device)),
    lambda a, b: tilegym_rms.rms_norm_backward(a, a, None, torch.ones(b.shape[0], device=b.device)),
    lambda a, b: tilegym_rms.fused_add_rms_norm(a, b),
    lambda a, b: tilegym_rms.fused_add_rms_norm_(a, b),
    lambda a, b: tilegym_rms.qk_rms_norm(a.view(-1, 4, 64), b.view(-1, 4, 64)),
    lambda a, b: tilegym_rms.qk_rms_norm(a.view(-1, 4, 64), a.view(-1, 4, 64), None, b.new_ones(64)),
    lambda a, b: tilegym_rms.RMSNorm(256, device=b.device)(a),
], ids=["weight", "dy", "rstd", "residual", "residual-in-place", "k", "k_weight", "module"])  # fmt: skip
def test_mixed_devices_raise_a_clear_error(op):
    a, b = torch.randn(8, 256, device=OTHER), torch.randn(8, 256, device=HOME)
    with pytest.raises(ValueError, match=r"device") as info:
        with torch.no_grad():
            op(a, b)
    assert "cuda:0" in str(info.value) and "cuda:1" in str(info.value), str(info.value)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(11)
    return transformers.LlamaForCausalLM(config).float()


def _train_step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.detach().cpu() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return loss.detach().cpu(), grads, model(input_ids=ids, labels=ids).loss.detach().cpu()


def test_hf_model_split_over_two_gpus_trains_like_one_gpu():
    accelerate = pytest.importorskip("accelerate")
    from tilegym_rms.integrations.hf import apply_to_model

    one = _tiny_llama().to(HOME)
    split = _tiny_llama()
    split.load_state_dict(one.state_dict())
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
                  "model.layers.3": 1, "model.norm": 1, "model.rotary_emb": 1, "lm_head": 1}  # fmt: skip
    split = accelerate.dispatch_model(split, device_map=device_map)
    assert apply_to_model(one) == apply_to_model(split) == 2 * 4 + 1
    on_other = [m for m in split.modules() if type(m).__name__ == "TilegymHFRMSNorm" and m.weight.device == OTHER]
    assert len(on_other) == 2 * 2 + 1, "the split model has norms on device 1"
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(12)).to(HOME)
    loss_one, grads_one, after_one = _train_step(one, ids)
    loss_split, grads_split, after_split = _train_step(split, ids)
    torch.testing.assert_close(loss_split, loss_one, rtol=1e-5, atol=1e-6)
    for name, grad in grads_one.items():
        torch.testing.assert_close(grads_split[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(after_split, after_one, rtol=1e-5, atol=1e-6)
    assert after_one < loss_one, "the step lowered the loss"
