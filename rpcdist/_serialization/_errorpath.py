"""Slow path of a failed encode: find where in the value the failure sat.

The walk visits values in the order msgpack packs them, so the first
occurrence of the value that failed is the one that made the encode fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from ._types import fields_of

__all__ = ["locate"]

_LIMIT: Final = 1000
Step = tuple[str, object]


def _key(key: object) -> str:
    text = repr(key)
    return text if len(text) <= 40 else text[:37] + "..."


def _dict_children(node: dict[Any, Any], path: str) -> Iterator[Step]:
    for key, value in node.items():
        yield f"{path}<key {_key(key)}>", key
        yield f"{path}[{_key(key)}]", value


def _children(node: Any, path: str, expanded: dict[int, object] | None) -> Iterator[Step] | None:
    kind = type(node)
    if kind is list or kind is tuple:
        return ((f"{path}[{i}]", item) for i, item in enumerate(node))
    if kind is dict:
        return _dict_children(node, path)
    if kind is set or kind is frozenset:
        return ((f"{path}<item {i}>", item) for i, item in enumerate(node))
    fields = fields_of(kind)
    if fields is not None:
        return ((f"{path}.{name}", getattr(node, name)) for name in fields)
    if expanded is not None and id(node) in expanded:
        return iter([(f"{path}<encoded>", expanded[id(node)])])
    return None


def locate(
    root: object, where: str, target: object | None, expanded: dict[int, object] | None
) -> str | None:
    """Return the path to ``target`` inside ``root`` (by identity), named from ``where``.

    With ``target=None``, return the path of the first container nested deeper
    than the packer allows instead. None if not found.
    """
    stack: list[Iterator[Step]] = [iter([(where, root)])]
    while stack:
        step = next(stack[-1], None)
        if step is None:
            stack.pop()
            continue
        path, node = step
        if target is not None and node is target:
            return path
        children = _children(node, path, expanded)
        if children is None:
            continue
        if len(stack) > _LIMIT:
            if target is None:
                return path
            continue
        stack.append(children)
    return None
