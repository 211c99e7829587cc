"""Public API: input errors, shapes, dispatch, the experimental warning (CPU)."""

import importlib.util
import warnings

import numpy as np
import pytest
import torch

import tilegym_rms
from tilegym_rms import dispatch, experimental


def test_leading_dims_and_dtypes_preserved():
    for shape in [(16,), (3, 16), (2, 3, 4, 16)]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = torch.randn(shape, dtype=dtype)
            y = tilegym_rms.rms_norm(x, torch.ones(16))
            assert y.shape == x.shape and y.dtype == dtype


def test_weight_dtype_may_differ_output_follows_x():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    y = tilegym_rms.rms_norm(x, torch.randn(8, dtype=torch.float32))
    assert y.dtype == torch.bfloat16


def test_empty_inputs():
    x = torch.randn(0, 5, 32)
    y, rstd = tilegym_rms.rms_norm_forward(x, torch.ones(32))
    assert y.shape == (0, 5, 32) and rstd.shape == (0, 5)
    dx, dw = tilegym_rms.rms_norm_backward(x, torch.randn_like(x), torch.ones(32), rstd)
    assert dx.shape == x.shape and dw.shape == (32,) and torch.all(dw == 0)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"x": torch.tensor(1.0)}, ValueError, "at least one dimension"),
        ({"x": torch.ones(2, 4, dtype=torch.int32)}, TypeError, "floating-point"),
        ({"weight": torch.ones(5)}, ValueError, r"shape \(4,\)"),
        ({"weight": torch.ones(2, 2)}, ValueError, r"shape \(4,\)"),
        ({"weight": torch.ones(4, dtype=torch.int64)}, TypeError, "floating-point"),
        ({"weight": torch.ones(4).to(torch.float8_e4m3fn)}, TypeError, "16 bits or more, got torch.float8_e4m3fn"),
        ({"eps": -1e-6}, ValueError, "non-negative"),
        ({"eps": float("nan")}, ValueError, "non-negative"),
        ({"casting_mode": "fp8"}, ValueError, "'llama', 'gemma', 'none'"),
        ({"backend": "cuda"}, ValueError, "'cutile', 'triton', 'torch'"),
        ({"weight": None, "offset": 1.0}, ValueError, "offset applies to the weight"),
        ({"x": [1.0, 2.0]}, TypeError, "torch.Tensor"),
    ],
)
def test_input_errors_say_what_is_allowed(kwargs, exc, match):
    args = {"x": torch.randn(2, 4), "weight": torch.ones(4), "eps": 1e-6, "casting_mode": "llama", "backend": None}
    args.update(kwargs)
    x, w = args.pop("x"), args.pop("weight")
    with pytest.raises(exc, match=match):
        tilegym_rms.rms_norm(x, w, **args)


def test_device_mismatch_is_a_clear_error():
    x = torch.randn(2, 4)
    w = torch.ones(4, device="meta")
    with pytest.raises(ValueError, match="same device"):
        tilegym_rms.rms_norm(x, w)


def test_backward_argument_errors():
    x = torch.randn(3, 8)
    _, rstd = tilegym_rms.rms_norm_forward(x, None)
    with pytest.raises(ValueError, match="dy must have the shape of x"):
        tilegym_rms.rms_norm_backward(x, torch.randn(3, 9), None, rstd)
    with pytest.raises(ValueError, match="one value per row"):
        tilegym_rms.rms_norm_backward(x, torch.randn(3, 8), None, rstd[:2])
    with pytest.raises(ValueError, match=r"rstd must be on the device of x \(cpu\), got meta"):
        tilegym_rms.rms_norm_backward(x, torch.randn(3, 8), None, rstd.to("meta"))


def test_kernel_backends_reject_float64_with_a_hint():
    from tilegym_rms.ops.common import _backend

    with pytest.raises(TypeError, match="backend='torch' for float64"):
        _backend(torch.randn(2, 4, dtype=torch.float64), "cutile")


def test_dispatch_cpu_defaults_to_torch():
    assert dispatch.resolve_backend(torch.device("cpu")) == "torch"


def test_dispatch_env_overrides_and_unavailable_backend_says_why(monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, "cutile")
    # The messages name the variable: the call itself named no backend.
    cannot = r"^backend 'cutile' \(TILEGYM_RMS_BACKEND=cutile\) cannot run on cpu: cuTile runs on CUDA devices"
    with pytest.raises(RuntimeError, match=cannot):
        tilegym_rms.rms_norm(torch.randn(2, 4))
    monkeypatch.setenv(dispatch.BACKEND_ENV, "bogus")
    dispatch._clear_cache()
    with pytest.raises(ValueError, match=r"^unknown backend 'bogus' \(TILEGYM_RMS_BACKEND=bogus\); choose one of"):
        tilegym_rms.rms_norm(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="^backend 'cutile' cannot run on cpu"):  # named by the call
        tilegym_rms.rms_norm(torch.randn(2, 4), backend="cutile")


def test_available_backends_reports_reasons():
    status = tilegym_rms.available_backends("cpu")
    assert set(status) == set(tilegym_rms.BACKENDS)
    assert status["torch"] == (True, "")
    ok, why = status["cutile"]
    assert not ok and "CUDA" in why


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu defines the npu device")
def test_available_backends_on_npu_without_torch_npu_says_why():
    """torch itself has no "npu" device: each backend gets the reason and the extra to install, not torch's
    error about device strings."""
    status = tilegym_rms.available_backends("npu")
    assert set(status) == set(tilegym_rms.BACKENDS)
    why = "torch has no device type 'npu': torch_npu is not installed (pip install 'tilegym_rms[ascend]')"
    assert all(reason == (False, why) for reason in status.values()), status


def test_dispatch_cuda_order(monkeypatch):
    """On CUDA: cutile where it can run, else triton, else torch."""
    calls = {}

    def fake(name, ok):
        def available(device):
            calls[name] = True
            return ok, "" if ok else f"{name} unavailable"

        return available

    import tilegym_rms._torch_backend as tb
    import tilegym_rms.cutile as cutile
    import tilegym_rms.triton as triton_backend

    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(cutile, "available", fake("cutile", True))
    assert dispatch.resolve_backend(cuda0) == "cutile"
    dispatch._clear_cache()
    monkeypatch.setattr(cutile, "available", fake("cutile", False))
    monkeypatch.setattr(triton_backend, "available", fake("triton", True))
    assert dispatch.resolve_backend(cuda0) == "triton"
    dispatch._clear_cache()
    monkeypatch.setattr(triton_backend, "available", fake("triton", False))
    monkeypatch.setattr(tb, "available", fake("torch", True))
    assert dispatch.resolve_backend(cuda0) == "torch"


def test_cutile_compute_capability_gate():
    from tilegym_rms.cutile import cc_supported

    assert all(cc_supported(cc) for cc in [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)])
    assert not any(cc_supported(cc) for cc in [(7, 5), (9, 1), (11, 0)])


def test_experimental_warning_fires_once_per_kernel(monkeypatch):
    monkeypatch.delenv(experimental.SILENCE_ENV, raising=False)
    experimental._reset_warnings()
    k1 = experimental.experimental_kernel(lambda: None)
    k2 = experimental.experimental_kernel(on=("npu",))(lambda: None)
    plain = lambda: None  # noqa: E731
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            experimental.notify_launch(k1, "cuda")
            experimental.notify_launch(k2, "cuda")  # experimental only on npu
            experimental.notify_launch(plain, "cuda")
        experimental.notify_launch(k2, "npu")
        experimental.notify_launch(k2, "npu")
    msgs = [str(w.message) for w in seen if issubclass(w.category, tilegym_rms.ExperimentalKernelWarning)]
    assert len(msgs) == 2 and "on cuda" in msgs[0] and "on npu" in msgs[1]
    assert issubclass(tilegym_rms.ExperimentalKernelWarning, UserWarning)


def test_experimental_warning_silenced_by_env(monkeypatch):
    monkeypatch.setenv(experimental.SILENCE_ENV, "1")
    experimental._reset_warnings()
    k = experimental.experimental_kernel(lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        experimental.notify_launch(k, "cuda")


def test_cutile_backward_kernels_are_marked_experimental():
    pytest.importorskip("cuda.tile")
    from tilegym_rms.cutile import kernels

    for k in (
        kernels.rms_norm_fwd_split,
        kernels.rms_norm_bwd_persistent,
        kernels.rms_norm_bwd_row_dot,
        kernels.rms_norm_bwd_column_chunk,
        kernels.rms_norm_dw_reduce,
        kernels.gated_rms_norm_fwd,
        kernels.gated_rms_norm_bwd,
    ):
        assert experimental.is_experimental(k, "cuda")


def test_cutile_launch_helper_warns_once_and_applies_compiler_hints(monkeypatch):
    """The one launch helper: experimental warning once per kernel; the hint picks a hinted copy."""
    ct = pytest.importorskip("cuda.tile")
    from tilegym_rms.cutile import kernels, launch

    seen = []
    monkeypatch.setattr(ct, "launch", lambda stream, grid, kernel, args: seen.append((stream, grid, kernel, args)))
    monkeypatch.setattr(launch, "_current_stream", lambda index: 1234 + index)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)  # device 0 current, as the launches below ask
    monkeypatch.delenv(experimental.SILENCE_ENV, raising=False)
    experimental._reset_warnings()
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for hints in ((), (("occupancy", 2),)):
            launch.launch(kernels.rms_norm_dw_reduce, (3,), (x, 1.5, 16), 0, hints)
    assert len([w for w in caught if issubclass(w.category, tilegym_rms.ExperimentalKernelWarning)]) == 1
    assert [s[:3] for s in seen][0] == (1234, (3,), kernels.rms_norm_dw_reduce)
    hinted = seen[1][2]
    assert hinted is not kernels.rms_norm_dw_reduce
    assert hinted is launch.with_hints(kernels.rms_norm_dw_reduce, (("occupancy", 2),))
    assert seen[1][3] == (x, 1.5, 16)


def test_cutile_host_hands_kernels_detached_tensors(monkeypatch):
    """DLPack refuses tensors that require grad: the host detaches x, weight and dy before launching."""
    pytest.importorskip("cuda.tile")
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import launch, tuning
    from tilegym_rms.cutile.host import common

    seen = []
    monkeypatch.setattr(launch, "num_sms", lambda index: 132)
    monkeypatch.setattr(tuning, "device_key", lambda index: "sm90_132sm")  # its table, without a GPU to ask
    monkeypatch.setattr(
        common, "launcher", lambda: lambda kernel, grid, args, dev, hints=(), built=None: seen.append(args)
    )
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    grad_leaf = lambda: torch.randn(4, 8, requires_grad=True)  # noqa: E731
    try:
        y, rstd = cutile.forward(x, w, 1e-6, 0.0, "llama")
        cutile.backward(x, grad_leaf(), w, rstd, 0.0, "llama")
        cutile.fused_add_forward(x, grad_leaf(), w, 1e-6, 0.0, "llama", mode="pre")
        cutile.fused_add_backward(x, grad_leaf(), grad_leaf(), w, rstd, 0.0, "llama")
    finally:
        cutile.clear_caches()
    tensors = [a for args in seen for a in args if isinstance(a, torch.Tensor)]
    # forward (x, w, y, rstd, residual, res_out) and, at 4 rows, the one-launch backward (dy, x, w, rstd, dx,
    # dw, dres); without the add, x and y stand in for residual and res_out, dx for dres
    assert len(seen) == 4 and len(tensors) == 26 and not any(t.requires_grad for t in tensors)


def test_module_rejects_offset_without_weight():
    with pytest.raises(ValueError, match="elementwise_affine=True"):
        tilegym_rms.RMSNorm(8, elementwise_affine=False, offset=1.0)
    y = tilegym_rms.RMSNorm(8, elementwise_affine=False)(torch.randn(2, 8))
    assert y.shape == (2, 8)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"casting_mode": "x"}, ValueError, "casting_mode must be one of 'torch', 'llama', 'gemma', 'none', got 'x'"),
        ({"backend": "cuda"}, ValueError, "unknown backend 'cuda'; choose one of 'cutile', 'triton', 'torch' or None"),
        ({"eps": -1}, ValueError, "eps must be a non-negative real number or None, got -1.0"),
        ({"eps": "1e-6"}, TypeError, r"eps must be a real number \(.*\) or None, got str: '1e-6'"),
        ({"offset": "1"}, TypeError, "offset must be a real number"),
    ],
)
def test_module_checks_its_arguments_where_it_is_built(kwargs, exc, match):
    """A norm built wrong fails in its constructor, in one line, rather than at its first call."""
    with pytest.raises(exc, match=match) as info:
        tilegym_rms.RMSNorm(8, **kwargs)
    assert "\n" not in str(info.value)


def test_module_takes_what_rms_norm_takes():
    norm = tilegym_rms.RMSNorm(8, eps=np.float32(0.25), offset=torch.tensor(1.0), casting_mode="gemma", backend="torch")
    assert norm.eps == 0.25 and norm.offset == 1.0
    x = torch.randn(2, 8)
    assert torch.equal(norm(x), tilegym_rms.rms_norm(x, norm.weight, 0.25, offset=1.0, casting_mode="gemma"))


@pytest.mark.parametrize("name", tilegym_rms.BACKENDS)
def test_backend_modules_satisfy_the_contract(name):
    """Each backend module has the members of dispatch.Backend with the protocol's parameter names,
    and its optional capabilities with theirs (ops calls them by keyword and position)."""
    import inspect

    module = dispatch.backend_module(name)
    assert isinstance(module, dispatch.Backend)

    def params(fn):
        return [p for p in inspect.signature(fn).parameters if p != "self"]

    for proto in (
        dispatch.Backend,
        dispatch.FusedAddBackend,
        dispatch.FusedAddBackwardBackend,
        dispatch.QKNormBackend,
        dispatch.GatedBackend,
        dispatch.WorkspaceBackend,
        dispatch.FP8Backend,
    ):
        members = [m for m in vars(proto) if not m.startswith("_") and callable(getattr(proto, m))]
        if proto is not dispatch.Backend and not isinstance(module, proto):
            continue
        for member in members:
            assert params(getattr(module, member)) == params(getattr(proto, member)), (name, member)
    assert all(isinstance(d, torch.dtype) for d in module.SUPPORTED_DTYPES)
    assert all(isinstance(k, str) for k in module.FORWARD_KERNELS)


def test_kernel_values_a_backend_does_not_know_are_rejected():
    with pytest.raises(ValueError, match="backend 'torch' has one forward kernel: kernel must be None"):
        tilegym_rms.rms_norm(torch.randn(2, 4), kernel="gather")
    with pytest.raises(ValueError, match="backend 'torch' has one forward kernel"):
        tilegym_rms.rms_norm_forward(torch.randn(2, 4), kernel="persistent")


def test_qk_norm_protocol_is_optional_and_cutile_has_it():
    """cutile takes q and k in one launch; torch and triton fall back to their plain norm on each."""
    assert {
        name for name in tilegym_rms.BACKENDS if isinstance(dispatch.backend_module(name), dispatch.QKNormBackend)
    } == {"cutile"}


def test_fused_add_capabilities_of_each_backend():
    """The optional fused-add protocols each backend satisfies: the contract test above skips a protocol a
    module lacks, so a lost capability would otherwise pass unnoticed (ops then falls back to torch adds)."""
    expected = {"cutile": (True, True), "triton": (True, False), "torch": (True, True)}
    for name, (fwd, bwd) in expected.items():
        module = dispatch.backend_module(name)
        assert isinstance(module, dispatch.FusedAddBackend) == fwd, name
        assert isinstance(module, dispatch.FusedAddBackwardBackend) == bwd, name
    assert dispatch.backend_module("cutile").FUSED_ADD_MIXED_DTYPES
    assert not dispatch.backend_module("triton").FUSED_ADD_MIXED_DTYPES
