"""Public faces report themselves as the home of what they re-export."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["publish"]


def publish(namespace: str, names: Iterable[str], scope: Mapping[str, Any]) -> None:
    """Set ``__module__`` of the classes and functions ``names`` in ``scope``
    that live in private modules to the public ``namespace`` (as trio does),
    so that reprs, docs and pickles name where users import them from."""
    for name in names:
        obj = scope[name]
        mod = getattr(obj, "__module__", None)
        if not (callable(obj) and isinstance(mod, str)):
            continue
        if any(part.startswith("_") for part in mod.split(".")):
            try:
                obj.__module__ = namespace
            except (AttributeError, TypeError):  # builtins, some C types
                pass
