"""The RMSNorm classes of the installed transformers, and what :func:`~.swap.apply_to_model` does with each.

``python -m tilegym_rms.integrations.hf.catalog`` prints the list. A class is built with its ``__init__``'s
defaults at a width of 64 (and, where its ``__init__`` takes them, without its weight, with the gate before
and after the norm and over several groups), and each such module is read as ``apply_to_model`` reads it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

from .recognize import match_module, require_transformers, why_left_alone

WIDTH = 64
GROUP_SIZE = 16  # four groups of the width, for classes that take a group size
_WIDTH_ARGS = ("hidden_size", "dim", "num_features", "normalized_shape", "d_model")
# Settings whose other values change the formula: each class that takes one is built with each value.
_VARIED = {"with_scale": (True, False), "norm_before_gate": (True, False), "n_groups": (1, 4)}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One way of building an RMSNorm class, and what apply_to_model does with such a module."""

    model: str  # transformers.models.<model>.modeling_<model>
    cls: type
    settings: tuple  # the (argument, value) pairs given to __init__ beside its defaults
    action: str  # "swapped: ..." or "left alone: <reason>"

    @property
    def swapped(self) -> bool:
        return self.action.startswith("swapped")


def rmsnorm_classes() -> list[tuple[str, type]]:
    """``(model, class)`` for every class named ``*RMSNorm*`` defined in a ``modeling_<model>.py`` of the
    installed transformers (modules that fail to import, for a missing optional dependency, are skipped)."""
    transformers = require_transformers()
    found = []
    for info in pkgutil.iter_modules(transformers.models.__path__):
        try:
            module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # noqa: BLE001 (an optional dependency of one model must not hide the others)
            continue
        for name, obj in sorted(vars(module).items()):
            if isinstance(obj, type) and "RMSNorm" in name and obj.__module__ == module.__name__:
                found.append((info.name, obj))
    return found


def build(cls, settings: dict):
    """An instance of ``cls`` from its ``__init__``'s defaults, the width for its width argument, a group size
    for a required ``group_size``, a default config of the width for a ``config`` and ``settings``; or the name
    of an argument it needs that this cannot give."""
    args = {}
    for p in list(inspect.signature(cls.__init__, eval_str=True).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in settings:
            args[p.name] = settings[p.name]
        elif p.name in _WIDTH_ARGS:
            args[p.name] = WIDTH
        elif p.name == "group_size" and p.default is p.empty:
            args[p.name] = GROUP_SIZE
        elif p.name == "config" and isinstance(p.annotation, type):
            args[p.name] = p.annotation(hidden_size=WIDTH)
        elif p.default is p.empty:
            return p.name
    return cls(**args)


def variants(cls) -> list[dict]:
    """The settings to build ``cls`` with: every combination of the :data:`_VARIED` arguments it takes, and a
    group size where ``group_size`` is optional."""
    params = inspect.signature(cls.__init__).parameters
    combos = [{}]
    for name, values in _VARIED.items():
        if name in params:
            combos = [{**c, name: v} for c in combos for v in values]
    if "group_size" in params and params["group_size"].default is None:
        combos += [{**c, "group_size": GROUP_SIZE} for c in combos]
    return combos


def describe(module) -> str:
    match = match_module(module)
    if match is None:
        return f"left alone: {why_left_alone(module)}"
    what = f"swapped: {match.kind.name}" + ("" if match.weighted else ", no weight")
    if match.norm_before_gate is not None:
        order = "norm, then gate" if match.norm_before_gate else "gate, then norm"
        what += f", {match.activation}-gated ({order})"
    if match.group_size is not None:
        what += f", group_size={match.group_size}"
    return what


def catalog() -> list[Entry]:
    """Every RMSNorm class of the installed transformers, built each way :func:`variants` gives."""
    entries = []
    for model, cls in rmsnorm_classes():
        for settings in variants(cls):
            built = build(cls, settings)
            action = describe(built) if not isinstance(built, str) else f"left alone: its __init__ needs {built}"
            entries.append(Entry(model, cls, tuple(settings.items()), action))
    return entries


def main() -> None:
    entries = catalog()
    for e in entries:
        settings = ", ".join(f"{k}={v}" for k, v in e.settings)
        print(f"{e.cls.__name__}{f'({settings})' if settings else ''}: {e.action}")
    classes = {e.cls for e in entries}
    swapped = {e.cls for e in entries if e.swapped}
    print(f"{len(swapped)} of {len(classes)} classes swapped (in at least one setting)")


if __name__ == "__main__":
    main()
