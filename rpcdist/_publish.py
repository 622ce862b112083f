"""Public faces report themselves as the home of what they re-export."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy", "publish"]


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


def lazy(package: str, scope: dict[str, Any], where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``where[name]`` (a module path
    relative to ``package``) on first use of ``name``, publishes it and keeps
    it in ``scope``: names that need heavier layers stay off import time."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        obj = getattr(importlib.import_module(module, package), name)
        publish(package, [name], {name: obj})
        scope[name] = obj
        return obj

    return __getattr__
