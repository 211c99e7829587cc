"""Input validation for the public API: every message says what was wrong and what is allowed."""

from __future__ import annotations

import math
import numbers

import torch

from .reference import CASTING_MODES, FP8_DTYPES, FP8_GROUP_SIZES, FUSED_ADD_MODES, GATE_ACTIVATIONS, compute_dtype

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_inputs(x, weight, eps, offset, casting_mode, names=("x", "weight")) -> tuple[float, float]:
    """Validates the arguments shared by every entry point; returns ``(eps, offset)`` as Python floats
    (``eps=None``: torch's default, the machine epsilon of the dtype the norm computes in). ``names``: what
    the messages call ``x`` and ``weight`` (``q`` and ``q_weight`` in qk_rms_norm).

    Runs on every call, so valid arguments pass one combined test each; the messages are built only
    for arguments that fail it."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or not x.is_floating_point():
        _explain_x(x, names[0])
    n = x.shape[-1]
    if weight is not None and (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 1
        or weight.shape[0] != n
        or not weight.is_floating_point()
        or weight.dtype.itemsize == 1  # the float8 types: no arithmetic on them
        or weight.device != x.device
    ):
        _explain_weight(weight, x, n, names)
    if type(eps) is not float or not eps >= 0.0:  # NaN fails ``>=``; other types take the slow path
        eps = torch.finfo(compute_dtype(x.dtype)).eps if eps is None else check_eps(eps)
    if type(offset) is not float:
        offset = check_offset(offset)
    if weight is None and offset != 0:
        raise ValueError(
            f"offset applies to the weight (y = x * rstd * (offset + weight)): with {names[1]}=None it must be 0"
        )
    if casting_mode not in CASTING_MODES:
        check_casting_mode(casting_mode)
    return eps, offset


def check_eps(eps) -> float:
    """``eps`` as a Python float: a real number ``>= 0`` (None, torch's default, is the caller's to resolve)."""
    eps = _real_scalar("eps", eps, " or None")
    if not eps >= 0.0:  # NaN fails ``>=``
        raise ValueError(f"eps must be a non-negative real number or None, got {eps!r}")
    return eps


def check_offset(offset) -> float:
    return _real_scalar("offset", offset)


def check_casting_mode(casting_mode) -> None:
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {', '.join(map(repr, CASTING_MODES))}, got {casting_mode!r}")


def _real_scalar(name: str, value, also: str = "") -> float:
    """A Python float from a real-number scalar: int, float, a numpy scalar or a 0-dim CPU tensor (``also``:
    what else the argument takes, for the message)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and value.device.type == "cpu" and not value.is_complex() and value.dtype != torch.bool:
            return float(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(
        f"{name} must be a real number (int, float, a numpy scalar or a 0-dim CPU tensor){also}, "
        f"got {type(value).__name__}: {value!r}"
    )


def _explain_x(x, name: str) -> None:
    check_tensor(name, x)
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (the normalized last dim); got a 0-dim tensor")
    raise TypeError(f"{name} must be a floating-point tensor ({_dtype_names(KERNEL_DTYPES)}), got {x.dtype}")


def _explain_weight(weight, x, n: int, names) -> None:
    x_name, w_name = names
    check_tensor(w_name, weight)
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"{w_name} must have shape ({n},) (the last dim of {x_name}), got {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"{w_name} must be a floating-point tensor, got {weight.dtype}")
    if weight.dtype.itemsize == 1:
        raise TypeError(
            f"{w_name} must be a float of 16 bits or more, got {weight.dtype}: cast it (e.g. to {x_name}'s dtype)"
        )
    raise ValueError(
        f"{x_name} and {w_name} must be on the same device, got {x_name} on {x.device}, {w_name} on {weight.device}"
    )


def check_dtype_for_backend(x, backend_name: str, supported, name: str = "x") -> None:
    if x.dtype not in supported:
        hint = " (use backend='torch' for float64)" if x.dtype == torch.float64 else ""
        raise TypeError(
            f"backend {backend_name!r} supports {name} of dtype {_dtype_names(supported)}, got {x.dtype}{hint}"
        )


def check_like(name: str, t, x) -> None:
    """``t`` must match ``x`` in shape and device and be floating point (dy, residual)."""
    check_tensor(name, t)
    if t.shape != x.shape:
        raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on the device of x ({x.device}), got {t.device}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_rstd(rstd, x) -> None:
    """``rstd`` as :func:`tilegym_rms.rms_norm_forward` returns it: one value per row of ``x``, on its
    device, fp32 (fp64 for fp64 ``x``). Any other dtype would be read as garbage by the kernels."""
    check_tensor("rstd", rstd)
    rows = math.prod(x.shape[:-1])
    if rstd.device != x.device:
        raise ValueError(f"rstd must be on the device of x ({x.device}), got {rstd.device}")
    if rstd.numel() != rows:
        raise ValueError(f"rstd must hold one value per row of x ({rows}), got shape {tuple(rstd.shape)}")
    if rstd.dtype != compute_dtype(x.dtype):
        raise TypeError(
            f"rstd must be {_dtype_names([compute_dtype(x.dtype)])} for x of dtype {_dtype_names([x.dtype])} "
            f"(as rms_norm_forward returns it), got {_dtype_names([rstd.dtype])}"
        )


def check_fused_mode(mode) -> None:
    if mode not in FUSED_ADD_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, FUSED_ADD_MODES))}, got {mode!r}")


def check_qk_pair(q, k) -> None:
    """``k`` beside ``q`` in :func:`tilegym_rms.qk_rms_norm`: one head dim, dtype and device (the head
    counts and leading dims may differ)."""
    check_tensor("k", k)
    if not k.is_floating_point():
        raise TypeError(f"k must be a floating-point tensor ({_dtype_names(KERNEL_DTYPES)}), got {k.dtype}")
    if k.dim() == 0 or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have the head dim of q (last dim {q.shape[-1]}), got shape {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"q and k must have one dtype, got q {q.dtype}, k {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"q and k must be on one device, got q on {q.device}, k on {k.device}")


def check_gated(x, z, group_size, norm_before_gate, activation) -> None:
    """The gate ``z`` beside ``x`` (its shape and device, any floating dtype), ``group_size`` (None or a positive
    int dividing the last dim of ``x``), ``norm_before_gate`` (a bool) and ``activation`` of
    :func:`tilegym_rms.gated_rms_norm`."""
    check_like("z", z, x)
    check_group_size(group_size, x.shape[-1])
    if not isinstance(norm_before_gate, bool):
        raise TypeError(f"norm_before_gate must be True or False, got {type(norm_before_gate).__name__}")
    check_activation(activation)


def check_activation(activation) -> None:
    if not isinstance(activation, str) or activation not in GATE_ACTIVATIONS:
        allowed = ", ".join(map(repr, GATE_ACTIVATIONS))
        raise ValueError(f"activation must be one of {allowed}, got {activation!r}")


def check_group_size(group_size, n: int) -> None:
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size <= 0:
        raise ValueError(f"group_size must be None or a positive int dividing the last dim ({n}), got {group_size!r}")
    if n % group_size:
        raise ValueError(f"group_size must divide the last dim ({n}) into groups, got {group_size}")


def check_fp8_args(x, scale, group_size, scale_ub, out_dtype, use_ue8m0) -> None:
    """The quantization arguments of :func:`tilegym_rms.rms_norm_fp8` (and the fused add's)."""
    if out_dtype not in FP8_DTYPES:
        raise TypeError(f"out_dtype must be one of {_dtype_names(FP8_DTYPES)}, got {out_dtype}")
    for name, t in (("scale", scale), ("scale_ub", scale_ub)):
        if t is not None and (
            not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32 or t.device != x.device
        ):
            got = (
                f"{t.dtype} of {t.numel()} elements on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            )
            raise ValueError(f"{name} must be a one-element float32 tensor on the device of x ({x.device}), got {got}")
    if group_size is not None and (type(group_size) is not int or group_size not in FP8_GROUP_SIZES):
        raise ValueError(f"group_size must be None (one scale per row) or one of {FP8_GROUP_SIZES}, got {group_size!r}")
    if not isinstance(use_ue8m0, bool):
        raise TypeError(f"use_ue8m0 must be True or False, got {use_ue8m0!r}")
    if scale is not None:
        given = [
            name for name, v in (("group_size", group_size), ("scale_ub", scale_ub), ("use_ue8m0", use_ue8m0)) if v
        ]
        if given:
            raise ValueError(f"{given[0]} applies to dynamic scales; with a static scale it must be left unset")
    elif scale_ub is not None and group_size is not None:
        raise ValueError("scale_ub bounds per-row scales; with group_size it must be None")
