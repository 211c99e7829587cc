"""Integrations with other libraries.

:mod:`tilegym_rms.integrations.dtensor`: how the custom ops of :mod:`tilegym_rms.ops` declare their
sharding rules for ``torch.distributed.tensor``, and their registration.

:mod:`tilegym_rms.integrations.hf` (Hugging Face transformers, ``pip install 'tilegym_rms[hf]'``):
:func:`~tilegym_rms.integrations.hf.apply_to_model` swaps the RMSNorm modules of a loaded model for
tilegym_rms ones, :func:`~tilegym_rms.integrations.hf.patch_transformers` patches the RMSNorm classes
before a model is built, :func:`~tilegym_rms.integrations.hf.kernelize_model` goes through the HF
``kernels`` package with a local layer (no Hub access).

Importing this package (or :mod:`tilegym_rms`, which imports it for ``dtensor``) never imports
transformers: the names below are loaded from ``hf`` on first use.
"""

from __future__ import annotations

import importlib

_HF_NAMES = (
    "TilegymHFRMSNorm",
    "apply_to_model",
    "kernelize_model",
    "kernels_mapping",
    "patch_transformers",
    "patched_transformers",
    "unpatch_transformers",
)

__all__ = list(_HF_NAMES)


def __getattr__(name: str):
    if name in _HF_NAMES:
        return getattr(importlib.import_module(".hf", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
