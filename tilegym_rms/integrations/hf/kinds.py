"""The HF RMSNorm formulas this integration knows, and how :func:`tilegym_rms.rms_norm` computes each.

===========  ===================================================  ======  ============  ==============
kind         HF forward (x: input, w: weight, r: fp32 rstd)       offset  casting_mode  output dtype
===========  ===================================================  ======  ============  ==============
llama        ``w * (x.float() * r).to(x.dtype)``                 0       ``"llama"``   promote(w, x)
gemma        ``((x.float() * r) * (1 + w.float())).to(x.dtype)``  1       ``"gemma"``   x's
olmo2        ``(w * (x.float() * r)).to(x.dtype)``                0       ``"gemma"``   x's
centered     ``((x.float() * r) * (1 + w).float()).to(x.dtype)``  1       ``"gemma"``   x's
deepseek_v4  ``x * r.to(x.dtype)`` (no weight)                    0       ``"none"``    x's
===========  ===================================================  ======  ============  ==============

llama: Llama, Mistral, Qwen2, Qwen3 (also its ``q_norm``/``k_norm`` over ``head_dim``), Phi3, Llama4
(``(x.float() * r).type_as(x) * w``, the same rounding), xLSTM. gemma: Gemma, Gemma2, Gemma3 (weight
initialised to zeros), Qwen3-Next, Qwen4Exp. olmo2: Olmo2, Helium, NemotronH, Moshi, and the fp32
norm of Gemma3n, Gemma4 and their relatives. centered: the zero-centred weight added to 1 in the weight's own
dtype (MuseSpark's text norm), so a bf16 weight rounds ``1 + w`` before the fp32 product. deepseek_v4:
DeepSeek-V4's and GLM-5-Next's weightless norm, which rounds ``r`` to the input dtype and multiplies in it
(the ``"none"`` casting mode).

Every kind computes with or without a weight; whether a module has one, recognition reads from the module
(:mod:`.recognize`). Without a weight llama, gemma, olmo2 and centered are the same ``(x.float() *
r).to(x.dtype)``: such modules (Gemma4's with ``with_scale=False``, NanoChat's, FalconMamba's, ...) are
given the first, llama.

dtype handling (llama kind): HF multiplies by the weight *after* rounding to the input dtype, so the
result has the promoted dtype of weight and input. When that is the input dtype (the usual case: a
bf16 model, or an fp32 model) one fused kernel call gives it. When it is not (fp32 weights with bf16
activations, as under autocast or with an fp32 master copy), the kernel normalizes without weight
(``x * rstd`` rounded to the input dtype, as HF rounds it) and the weight product is one torch
multiply in the promoted dtype, exactly HF's expression. The gemma and olmo2 kinds always return the
input dtype, as HF does, whatever the weight dtype.

Gated norms (Qwen3-Next, Mamba2, FalconH1, Kimi-Linear, Bailing-hybrid, GLM-5-Next and their copies;
``forward(hidden_states, gate=None)``) are a kind for the roundings (llama: the normalized value rounded, then
times the weight, as Qwen3-Next and Mamba2; olmo2: fp32 throughout, as FalconH1 and the sigmoid-gated ones), the
gate's activation (silu, or sigmoid) before or after the norm and a group size, computed by
:func:`hf_gated_rms_norm` through :func:`tilegym_rms.gated_rms_norm`. Without a gate they compute the class's plain
norm (per group).

A new formula is a row of :data:`KINDS` (and, where the existing fields cannot express it, a field
that :func:`hf_rms_norm` reads): recognition (:mod:`.recognize`), the module swap, the class patch
and the kernels layer all go through this table.
"""

from __future__ import annotations

import dataclasses

import torch

from ... import reference
from ...ops import gated_rms_norm, rms_norm


@dataclasses.dataclass(frozen=True)
class NormKind:
    """One HF RMSNorm formula and the tilegym_rms configuration that computes it."""

    name: str
    offset: float
    casting_mode: str
    eps_attr: str  # where HF keeps eps on the module
    # The weight multiplies after the cast to the input dtype, so the output takes the promoted dtype.
    weight_promotes: bool
    methods: tuple[str, ...]  # the methods whose code defines the formula
    reference_module: str  # transformers.models.<this>.modeling_<this>
    reference_class: str
    # ``offset + w`` is taken in the weight's dtype (rounded there), not in fp32.
    offset_in_weight_dtype: bool = False


LLAMA = NormKind("llama", 0.0, "llama", "variance_epsilon", True, ("forward",), "llama", "LlamaRMSNorm")
GEMMA = NormKind("gemma", 1.0, "gemma", "eps", False, ("forward", "_norm"), "gemma", "GemmaRMSNorm")
OLMO2 = NormKind("olmo2", 0.0, "gemma", "variance_epsilon", False, ("forward",), "olmo2", "Olmo2RMSNorm")
CENTERED = NormKind(
    "centered", 1.0, "gemma", "eps", False, ("forward", "_norm"), "muse_spark", "MuseSparkTextCenteredRMSNorm", True
)
DEEPSEEK_V4 = NormKind(
    "deepseek_v4", 0.0, "none", "eps", False, ("forward",), "deepseek_v4", "DeepseekV4UnweightedRMSNorm"
)
KINDS = (LLAMA, GEMMA, OLMO2, CENTERED, DEEPSEEK_V4)
KINDS_BY_NAME = {k.name: k for k in KINDS}


def hf_rms_norm(x, weight, eps, kind: NormKind, backend, norm=None, *, group_size=None):
    """What an HF norm of ``kind`` computes, through :func:`tilegym_rms.rms_norm` on ``backend`` (None
    chooses per device); ``weight`` None for a module without one; ``group_size``: each group of that many
    columns normalized apart (Qwen4Exp's hyper-connection norms). Recognition checks a class against this
    same formula by passing ``norm``, a function of rms_norm's signature on :mod:`tilegym_rms.reference`."""
    norm = rms_norm if norm is None else norm
    if group_size is not None:
        return _weight_after_group_norm(x, None, weight, eps, kind, group_size, backend, norm)
    if weight is None:
        return norm(x, None, eps, casting_mode=kind.casting_mode, backend=backend)
    if kind.offset_in_weight_dtype:
        # HF rounds 1 + w in a 16-bit weight's dtype; autograd carries dw through the add.
        return norm(x, kind.offset + weight, eps, casting_mode=kind.casting_mode, backend=backend)
    if kind.weight_promotes and torch.promote_types(weight.dtype, x.dtype) != x.dtype:
        # HF rounds x * rstd to x's dtype and then multiplies by a wider weight: the kernel does the
        # first part, the multiply stays HF's own expression so that dtype and values are HF's.
        return weight * norm(x, None, eps, casting_mode="llama", backend=backend)
    return norm(x, weight, eps, offset=kind.offset, casting_mode=kind.casting_mode, backend=backend)


def _group_norm(x, eps, group_size, casting_mode, backend, norm):
    """The weightless norm of each group of ``group_size`` columns of ``x`` (None: the row), in ``x``'s shape."""
    if group_size is None:
        return norm(x, None, eps, casting_mode=casting_mode, backend=backend)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    return norm(groups, None, eps, casting_mode=casting_mode, backend=backend).reshape(x.shape)


def _weight_after_group_norm(x, gate, weight, eps, kind: NormKind, group_size, backend, norm, activation="silu"):
    """The norm of each group without weight, then HF's own expression for the weight (and, with ``gate``, the
    gate of ``activation`` after a rounded norm times the weight): the kernels take a weight of one group's width
    only."""
    if kind.casting_mode in ("llama", "none"):
        y = _group_norm(x, eps, group_size, kind.casting_mode, backend, norm)
        y = y if weight is None else weight * y
        return y if gate is None else (y * reference.gate(gate.float(), activation)).to(x.dtype)
    # fp32 throughout: the fp32 norm times offset + w in fp32 (in the weight's dtype for the centered kind),
    # rounded once.
    y = _group_norm(x.float(), eps, group_size, kind.casting_mode, backend, norm)
    if weight is not None:
        if kind.offset_in_weight_dtype:
            w = (kind.offset + weight).float()
        else:
            w = weight.float() + kind.offset if kind.offset else weight.float()
        y = y * w
    return y.to(x.dtype)


def hf_gated_rms_norm(
    x, gate, weight, eps, kind: NormKind, backend, *, norm_before_gate, group_size=None, activation="silu", norm=None,
    gated_norm=None,
):  # fmt: skip
    """What an HF gated norm of ``kind`` computes (``gate`` None: its plain norm), the gate of ``activation``
    (``"silu"`` or ``"sigmoid"``) before or after the norm, over groups of ``group_size`` columns (None: the
    row), through :func:`tilegym_rms.gated_rms_norm`
    (``gated_norm``) and :func:`tilegym_rms.rms_norm` (``norm``); recognition passes their
    :mod:`tilegym_rms.reference` twins."""
    norm = rms_norm if norm is None else norm
    gated_norm = gated_rms_norm if gated_norm is None else gated_norm
    if gate is None:
        return hf_rms_norm(x, weight, eps, kind, backend, norm, group_size=group_size)
    promoted = weight is not None and kind.weight_promotes and torch.promote_types(weight.dtype, x.dtype) != x.dtype
    if promoted and norm_before_gate:
        return _weight_after_group_norm(x, gate, weight, eps, kind, group_size, backend, norm, activation)
    y = gated_norm(
        x, gate, None if promoted else weight, eps, group_size=group_size, norm_before_gate=norm_before_gate,
        casting_mode=kind.casting_mode, activation=activation, backend=backend,
    )  # fmt: skip
    # A wider weight multiplies HF's rounded norm in the promoted dtype, the last step when the gate comes first.
    return weight * y if promoted else y
