"""The HF RMSNorm formulas this integration knows, and how :func:`tilegym_rms.rms_norm` computes each.

=========  ===================================================  ======  ============  ================
kind       HF forward (x: input, w: weight, r: fp32 rstd)       offset  casting_mode  output dtype
=========  ===================================================  ======  ============  ================
llama      ``w * (x.float() * r).to(x.dtype)``                 0       ``"llama"``   promote(w, x)
gemma      ``((x.float() * r) * (1 + w.float())).to(x.dtype)``  1       ``"gemma"``   x's
olmo2      ``(w * (x.float() * r)).to(x.dtype)``                0       ``"gemma"``   x's
=========  ===================================================  ======  ============  ================

llama: Llama, Mistral, Qwen2, Qwen3 (also its ``q_norm``/``k_norm`` over ``head_dim``), Phi3.
gemma: Gemma, Gemma2, Gemma3 (weight initialised to zeros). olmo2: Olmo2.

dtype handling (llama kind): HF multiplies by the weight *after* rounding to the input dtype, so the
result has the promoted dtype of weight and input. When that is the input dtype (the usual case: a
bf16 model, or an fp32 model) one fused kernel call gives it. When it is not (fp32 weights with bf16
activations, as under autocast or with an fp32 master copy), the kernel normalizes without weight
(``x * rstd`` rounded to the input dtype, as HF rounds it) and the weight product is one torch
multiply in the promoted dtype, exactly HF's expression. The gemma and olmo2 kinds always return the
input dtype, as HF does, whatever the weight dtype.

A new formula is a row of :data:`KINDS` (and, where the existing fields cannot express it, a field
that :func:`hf_rms_norm` reads): recognition (:mod:`.recognize`), the module swap, the class patch
and the kernels layer all go through this table.
"""

from __future__ import annotations

import dataclasses

import torch

from ...ops import rms_norm


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


LLAMA = NormKind("llama", 0.0, "llama", "variance_epsilon", True, ("forward",), "llama", "LlamaRMSNorm")
GEMMA = NormKind("gemma", 1.0, "gemma", "eps", False, ("forward", "_norm"), "gemma", "GemmaRMSNorm")
OLMO2 = NormKind("olmo2", 0.0, "gemma", "variance_epsilon", False, ("forward",), "olmo2", "Olmo2RMSNorm")
KINDS = (LLAMA, GEMMA, OLMO2)
KINDS_BY_NAME = {k.name: k for k in KINDS}


def hf_rms_norm(x, weight, eps, kind: NormKind, backend, norm=None):
    """What an HF norm of ``kind`` computes, through :func:`tilegym_rms.rms_norm` on ``backend`` (None
    chooses per device). Recognition checks a class against this same formula by passing ``norm``, a
    function of rms_norm's signature on :mod:`tilegym_rms.reference`."""
    norm = rms_norm if norm is None else norm
    if kind.weight_promotes and torch.promote_types(weight.dtype, x.dtype) != x.dtype:
        # HF rounds x * rstd to x's dtype and then multiplies by a wider weight: the kernel does the
        # first part, the multiply stays HF's own expression so that dtype and values are HF's.
        return weight * norm(x, None, eps, casting_mode="llama", backend=backend)
    return norm(x, weight, eps, offset=kind.offset, casting_mode=kind.casting_mode, backend=backend)
