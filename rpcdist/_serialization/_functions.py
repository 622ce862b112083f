"""Functions travel by name: ``"module:qualname"``, resolved on the receiver."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

from .._errors import SerializationError

__all__ = ["function_name", "resolve_function"]


def _label(fn: object) -> str:
    name = getattr(fn, "__qualname__", None)
    if isinstance(name, str):
        return repr(name)
    text = repr(fn)
    return text if len(text) <= 80 else text[:77] + "..."


def function_name(fn: Callable[..., Any]) -> str:
    """Return the name under which ``fn`` can be found on another worker.

    Module-level functions, static methods and class methods (``C.f``) and
    builtins such as ``operator.add`` or ``math.sqrt`` have such a name.

    Args:
        fn: The function to name.

    Returns:
        ``"module:qualname"``.

    Raises:
        SerializationError: ``fn`` is a lambda, a closure or nested function,
            a bound method of an instance, has no ``__module__``/``__qualname__``,
            or its name does not lead back to ``fn``.
    """
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    prefix = f"cannot send function {_label(fn)} by name"
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise SerializationError(f"{prefix}: it has no __module__ and __qualname__")
    if "<lambda>" in qualname:
        raise SerializationError(
            f"{prefix}: lambdas cannot be found on another worker; use a module-level def"
        )
    if "<locals>" in qualname:
        raise SerializationError(
            f"{prefix}: it is defined inside another function (a closure or nested "
            "function); define it at module level"
        )
    if isinstance(fn, types.MethodType) and not isinstance(fn.__self__, type):
        raise SerializationError(
            f"{prefix}: it is a method bound to an instance; send the instance's data "
            "and call a module-level function instead"
        )
    name = f"{module}:{qualname}"
    target: object = sys.modules.get(module)
    try:
        for part in qualname.split("."):
            target = getattr(target, part)
        same = target is fn or bool(target == fn)
    except Exception:
        same = False
    if not same:
        raise SerializationError(
            f"{prefix}: the name '{name}' does not lead back to it "
            "(was it decorated, replaced or created dynamically?)"
        )
    return name


def resolve_function(name: str) -> Callable[..., Any]:
    """Find the function called ``name`` (``"module:qualname"``), importing its module.

    Args:
        name: A name made by :func:`function_name`.

    Returns:
        The callable.

    Raises:
        SerializationError: the module cannot be imported, the attribute path
            does not exist, or it is not callable.
    """
    module_name, _, qualname = name.partition(":")
    prefix = f"function '{name}' not found on this worker"
    if not module_name or not qualname:
        raise SerializationError(f"{prefix}: expected 'module:qualname'")
    target: object = sys.modules.get(module_name)
    if target is None:
        try:
            target = importlib.import_module(module_name)
        except Exception as exc:
            raise SerializationError(
                f"{prefix}: cannot import module '{module_name}': {exc}"
            ) from exc
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise SerializationError(f"{prefix}: {exc}") from exc
    if not callable(target):
        raise SerializationError(f"{prefix}: {type(target).__qualname__} object is not callable")
    return target
