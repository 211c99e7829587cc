"""Which :class:`~.kinds.NormKind` an HF RMSNorm class computes, read from its code, not its name.

A class is of a kind when the code of its ``forward`` (and Gemma's ``_norm``) is the same bytecode as
the reference class's (LlamaRMSNorm, GemmaRMSNorm, Olmo2RMSNorm): subclasses that do not override
them qualify, and so do the many generated copies in transformers (``# Copied from``, modular). With
``match_copies=False`` only the classes of :data:`FAMILIES` and their subclasses do. Each reference is
checked once per process against :mod:`tilegym_rms.reference` on a small CPU probe, so a transformers
release that changes a formula turns the kind off rather than computing something else (with
transformers 4.51, Olmo2RMSNorm still computes the llama formula: it is then recognised as llama).
"""

from __future__ import annotations

import functools
import importlib

import torch

from ... import reference
from .kinds import KINDS, NormKind, hf_rms_norm

INSTALL_HINT = "pip install 'tilegym_rms[hf]'"

# family -> (module under transformers.models, its RMSNorm class): what patch_transformers patches and
# what match_copies=False accepts. The kind is read from each class's code (in transformers 5: llama for
# the first five, gemma for the Gemmas, olmo2 for Olmo2, which in 4.51 still had Llama's formula).
FAMILIES = {
    "llama": ("llama", "LlamaRMSNorm"),
    "mistral": ("mistral", "MistralRMSNorm"),
    "qwen2": ("qwen2", "Qwen2RMSNorm"),
    "qwen3": ("qwen3", "Qwen3RMSNorm"),
    "phi3": ("phi3", "Phi3RMSNorm"),
    "gemma": ("gemma", "GemmaRMSNorm"),
    "gemma2": ("gemma2", "Gemma2RMSNorm"),
    "gemma3": ("gemma3", "Gemma3RMSNorm"),
    "olmo2": ("olmo2", "Olmo2RMSNorm"),
}

# On a forward that patch_transformers put on a class: the function it replaced, whose code is what
# recognition reads.
ORIGINAL_ATTR = "__tilegym_original__"


def require_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"tilegym_rms.integrations.hf needs Hugging Face transformers: {INSTALL_HINT}") from e
    return transformers


def _load_class(module: str, name: str):
    require_transformers()
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(mod, name)


def family_class(family: str):
    """The family's RMSNorm class, or None when this transformers does not have the family."""
    module, name = FAMILIES[family]
    try:
        return _load_class(module, name)
    except (ImportError, AttributeError):
        return None


def _method_code(cls, name):
    """The code object behind ``cls.<name>`` (what it was before patch_transformers), or None."""
    try:
        fn = getattr(cls, name)
    except AttributeError:
        return None
    fn = getattr(fn, ORIGINAL_ATTR, fn)
    return getattr(fn, "__code__", None)


def _code_key(code):
    return (
        code.co_code,
        code.co_consts,
        code.co_names,
        code.co_varnames,
        code.co_argcount,
        code.co_kwonlyargcount,
        code.co_flags,
    )


@functools.cache
def _reference_keys(kind: NormKind):
    """Code keys of the kind's reference methods, or None when it is absent or fails the probe."""
    try:
        cls = _load_class(kind.reference_module, kind.reference_class)
    except (ImportError, AttributeError):
        return None
    codes = [_method_code(cls, m) for m in kind.methods]
    if any(c is None for c in codes):
        return None
    if not _probe(kind, cls):
        # This transformers computes another formula there (Olmo2 had Llama's before): the kind is off,
        # and classes that match no other kind are reported by apply_to_model like any unknown class.
        return None
    return tuple(_code_key(c) for c in codes)


def _reference_norm(x, weight, eps, *, offset=0.0, casting_mode, backend):
    """:func:`tilegym_rms.rms_norm`'s signature, on :mod:`tilegym_rms.reference` (no backend)."""
    del backend
    return reference.rms_norm_forward(x, weight, eps, offset, casting_mode)[0]


def _probe(kind: NormKind, cls) -> bool:
    """Runs the reference class's original forward on inputs whose rounding tells the formulas apart
    and compares with the kind's formula on :mod:`tilegym_rms.reference` exactly (values and dtype).

    Rows of +-1 have a mean square of exactly 1, so every formula computes the same ``rstd`` bit for
    bit; an eps of 0.21 makes ``x * rstd`` inexact in bf16, so rounding before or after the weight
    multiply changes many outputs, and the offset changes all of them."""
    n, eps = 256, 0.21
    # Explicit device and dtype: a torch.device(...) context or another default dtype must not move it.
    gen = torch.Generator().manual_seed(0)
    x = (torch.randint(0, 2, (4, n), generator=gen, device="cpu") * 2 - 1).to(torch.bfloat16)
    w32 = torch.randn(n, generator=gen, device="cpu", dtype=torch.float32) * 0.5
    forward = getattr(cls.forward, ORIGINAL_ATTR, cls.forward)
    with torch.no_grad():
        for w in (w32.to(torch.bfloat16), w32):
            module = cls.__new__(cls)
            torch.nn.Module.__init__(module)
            module.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
            setattr(module, kind.eps_attr, eps)
            try:
                got = forward(module, x)
            except Exception:
                return False
            want = hf_rms_norm(x, w, eps, kind, None, norm=_reference_norm)
            if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
                return False
    return True


def kind_of(cls, match_copies: bool = True) -> NormKind | None:
    """The :class:`~.kinds.NormKind` that ``cls`` computes, or None."""
    if not match_copies and not _is_family_subclass(cls):
        return None
    for kind in KINDS:
        keys = _reference_keys(kind)
        if keys is None:
            continue
        codes = [_method_code(cls, m) for m in kind.methods]
        if all(c is not None for c in codes) and tuple(_code_key(c) for c in codes) == keys:
            return kind
    return None


def _is_family_subclass(cls) -> bool:
    for family in FAMILIES:
        base = family_class(family)
        if base is not None and issubclass(cls, base):
            return True
    return False
