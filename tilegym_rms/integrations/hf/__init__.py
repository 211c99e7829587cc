"""Hugging Face transformers: run the RMSNorm modules of HF models on tilegym_rms kernels.

Three ways in:

* :func:`apply_to_model` (:mod:`.swap`) patches a built model in place: every RMSNorm module of a
  supported kind is replaced by a :class:`TilegymHFRMSNorm` (a gated one by a :class:`TilegymHFGatedRMSNorm`)
  that holds the *same* ``weight`` Parameter, so ``state_dict()`` keys and values, optimizer state, tied
  weights and PEFT wrappers are unchanged.
* :func:`patch_transformers` (:mod:`.patch`, or the :func:`patched_transformers` context manager)
  replaces the ``forward`` of the families' RMSNorm classes, so that models built afterwards
  (``from_pretrained``, ``from_config``) and existing instances run the kernels;
  :func:`unpatch_transformers` undoes it.
* :func:`kernelize_model` (:mod:`.hub`) goes through the HF ``kernels`` package (``kernels.kernelize``)
  with a layer from this package (:class:`TilegymKernelsRepository`): nothing is fetched from the Hub.
  It needs ``pip install kernels``; :func:`kernels_mapping` gives the mapping for callers of ``kernelize``.

What a norm computes is recognised from its code and behaviour, not its name (:mod:`.recognize`), as one of
the HF formulas in :mod:`.kinds` (llama, gemma, olmo2, centered, deepseek_v4; with or without a weight; gated
or not), each mapped onto a :func:`tilegym_rms.rms_norm` (or :func:`tilegym_rms.gated_rms_norm`)
configuration that gives HF's values and output dtype. All three ways compute through that table.
:mod:`.catalog` lists the RMSNorm classes of the installed transformers and what happens to each
(``python -m tilegym_rms.integrations.hf.catalog``).

Known differences: float64 inputs are computed in float64 (HF computes in float32 and casts back);
fp64 needs ``backend="torch"``.

Importing this package does not import transformers; the functions do, on first use.
"""

from __future__ import annotations

# Public beside __all__ (the redundant aliases say so): the formulas, the install hint, the kernels layer name.
from .hub import KERNELS_LAYER_NAME as KERNELS_LAYER_NAME
from .hub import TilegymKernelsRepository, TilegymKernelsRMSNorm, kernelize_model, kernels_mapping
from .kinds import CENTERED as CENTERED
from .kinds import DEEPSEEK_V4 as DEEPSEEK_V4
from .kinds import GEMMA as GEMMA
from .kinds import KINDS as KINDS
from .kinds import LLAMA as LLAMA
from .kinds import OLMO2 as OLMO2
from .kinds import NormKind as NormKind
from .patch import patch_transformers, patched_transformers, unpatch_transformers
from .recognize import FAMILIES
from .recognize import INSTALL_HINT as INSTALL_HINT
from .swap import TilegymHFGatedRMSNorm, TilegymHFRMSNorm, apply_to_model

__all__ = [
    "FAMILIES",
    "TilegymKernelsRMSNorm",
    "TilegymKernelsRepository",
    "kernelize_model",
    "kernels_mapping",
    "TilegymHFRMSNorm",
    "TilegymHFGatedRMSNorm",
    "apply_to_model",
    "patch_transformers",
    "patched_transformers",
    "unpatch_transformers",
]
