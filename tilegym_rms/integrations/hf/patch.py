""":func:`patch_transformers`: the ``forward`` of the families' RMSNorm classes, replaced and restored.

Models built afterwards (``from_pretrained``, ``from_config``) and existing instances run the kernels;
modules and parameters stay HF's. :func:`unpatch_transformers` and :func:`patched_transformers` (a
context manager) undo it.
"""

from __future__ import annotations

import contextlib

import torch

from .kinds import NormKind, hf_rms_norm
from .recognize import FAMILIES, ORIGINAL_ATTR, family_class, kind_of, require_transformers

_MISSING = object()
_CLASS_PATCHES: dict[type, object] = {}  # patched class -> its own forward before (or _MISSING)


def _class_forward(kind: NormKind, backend, original):
    eps_attr = kind.eps_attr

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hf_rms_norm(hidden_states, self.weight, getattr(self, eps_attr), kind, backend)

    setattr(forward, ORIGINAL_ATTR, original)
    forward.__doc__ = f"tilegym_rms kernels, {kind.name!r} kind (patched by tilegym_rms.patch_transformers)"
    return forward


def _resolve_families(families) -> list[type]:
    """Classes named by ``families``: None (every family this transformers has), family names, classes."""
    require_transformers()
    if families is None:
        return [c for c in (family_class(f) for f in FAMILIES) if c is not None]
    if isinstance(families, (str, type)):
        families = [families]
    classes = []
    for fam in families:
        if isinstance(fam, type):
            classes.append(fam)
            continue
        if fam not in FAMILIES:
            raise ValueError(f"unknown family {fam!r}; known: {', '.join(FAMILIES)} (or pass an RMSNorm class)")
        cls = family_class(fam)
        if cls is None:
            raise ValueError(
                f"transformers {require_transformers().__version__} has no {FAMILIES[fam][1]} (family {fam!r})"
            )
        classes.append(cls)
    return classes


def patch_transformers(families=None, *, backend=None) -> list[str]:
    """Makes the RMSNorm classes of ``families`` run tilegym_rms kernels by replacing their ``forward``.

    Models built afterwards (``from_pretrained``, ``from_config``) and existing instances of those classes
    (and of subclasses that do not override ``forward``) use the kernels; modules and parameters stay
    HF's. ``families``: None for all of ``FAMILIES`` that this transformers has, or names from it,
    or RMSNorm classes (a class must compute a known kind). Idempotent; calling it again with another
    ``backend`` switches the backend. Returns the names of the patched classes.
    """
    classes = _resolve_families(families)
    patched = []
    for cls in classes:
        kind = kind_of(cls)
        if kind is None:
            raise ValueError(f"{cls.__qualname__} does not compute a known RMSNorm kind; it cannot be patched")
        original = _CLASS_PATCHES.get(cls, cls.__dict__.get("forward", _MISSING))
        if cls not in _CLASS_PATCHES:
            _CLASS_PATCHES[cls] = original
        inherited = original if original is not _MISSING else cls.forward
        cls.forward = _class_forward(kind, backend, getattr(inherited, ORIGINAL_ATTR, inherited))
        patched.append(cls.__name__)
    return patched


def unpatch_transformers(families=None) -> list[str]:
    """Restores the ``forward`` of classes patched by :func:`patch_transformers` (all of them for None).
    Returns the names of the classes restored."""
    classes = list(_CLASS_PATCHES) if families is None else _resolve_families(families)
    restored = []
    for cls in classes:
        original = _CLASS_PATCHES.pop(cls, None)
        if original is None:
            continue
        if original is _MISSING:
            del cls.forward
        else:
            cls.forward = original
        restored.append(cls.__name__)
    return restored


@contextlib.contextmanager
def patched_transformers(families=None, *, backend=None):
    """:func:`patch_transformers` for the duration of a ``with`` block; restores only the classes that
    were not patched before it. Yields the names of the patched classes."""
    before = set(_CLASS_PATCHES)
    names = patch_transformers(families, backend=backend)
    try:
        yield names
    finally:
        unpatch_transformers([c for c in list(_CLASS_PATCHES) if c not in before])
