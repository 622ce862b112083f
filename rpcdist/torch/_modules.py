"""``torch.nn.Module`` objects on the wire, without pickle.

PyTorch RPC pickles everything. rpcdist keeps pickle off and sends a module
as its class's name and its attributes: ``["pkg.mod:Class", [[name, value],
...]]``, each value an ordinary codec value (tensors out-of-band, nested
modules the same way, functions by name). ``OrderedDict``, ``dict``,
``list`` and ``tuple`` attributes (``_parameters``, ``_buffers``,
``_modules``, the hook tables) keep their type, and a tensor met twice in one
module's attributes arrives as one object (``nn.LSTM``'s flat weights are its
parameters); tensors shared between two modules arrive as copies. The receiver resolves the class under its callable policy
(the same check a call of the class would pass), insists that it is a
``torch.nn.Module`` subclass, makes it with ``cls.__new__`` and hands the
attributes to its ``__setstate__`` (what unpickling does, and how
``nn.LSTM`` rebuilds its flat weights), so no code runs that a call of the
class could not run anyway. An attribute the codec cannot send (a lock, a
lambda hook) fails the call with a message naming it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .._errors import SerializationError
from .._serialization import register_extension, resolve_function
from .._serialization._functions import function_name, policy_of

__all__ = ["MODULE_CODE", "install"]

#: Codec extension code of torch modules (RRefs 32, rpcdist tensors 33).
MODULE_CODE = 34


def _pack(value: Any, memo: dict[int, int]) -> list[Any]:
    kind = type(value)
    if kind is OrderedDict or kind is dict:
        pairs = [[k, _pack(v, memo)] for k, v in value.items()]
        return ["o" if kind is OrderedDict else "d", pairs]
    if kind is list or kind is tuple:
        return ["l" if kind is list else "t", [_pack(v, memo) for v in value]]
    if isinstance(value, torch.Tensor):
        seen = memo.get(id(value))
        if seen is not None:
            return ["r", seen]  # the same tensor again (nn.LSTM's flat weights)
        memo[id(value)] = len(memo)
    return ["v", value]


def _unpack(item: Any, table: list[Any]) -> Any:
    if not (isinstance(item, list) and len(item) == 2 and item[0] in _KINDS):
        raise SerializationError("malformed torch module payload")
    kind, value = item
    if kind == "v":
        if isinstance(value, torch.Tensor):
            table.append(value)
        return value
    if kind == "r":
        if type(value) is not int or not 0 <= value < len(table):
            raise SerializationError("malformed torch module payload: bad tensor reference")
        return table[value]
    if kind in ("l", "t"):
        items = [_unpack(v, table) for v in value]
        return items if kind == "l" else tuple(items)
    pairs = [(k, _unpack(v, table)) for k, v in value]
    return OrderedDict(pairs) if kind == "o" else dict(pairs)


_KINDS = ("o", "d", "l", "t", "r", "v")


def _encode(module: torch.nn.Module, wire: Any) -> list[Any]:
    name = function_name(type(module))
    getstate = getattr(module, "__getstate__", None)
    attrs = getstate() if getstate is not None else module.__dict__
    if not isinstance(attrs, dict):
        raise SerializationError(
            f"cannot send torch module {name}: its __getstate__ returned a "
            f"{type(attrs).__name__}, not a dict"
        )
    memo: dict[int, int] = {}
    return [name, [[k, _pack(v, memo)] for k, v in attrs.items()]]


def _decode(payload: Any, wire: Any) -> torch.nn.Module:
    if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[0], str)):
        raise SerializationError("malformed torch module payload")
    name, items = payload
    cls = resolve_function(name, policy_of(wire))
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise SerializationError(f"received a torch module of {name}, which is not an nn.Module")
    table: list[Any] = []
    attrs = {k: _unpack(v, table) for k, v in items}
    module: torch.nn.Module = cls.__new__(cls)  # type: ignore[call-overload]  # (without torch)
    module.__setstate__(attrs)  # type: ignore[no-untyped-call]
    return module


def install() -> None:
    """Teach the codec torch modules (idempotent)."""
    register_extension(torch.nn.Module, MODULE_CODE, _encode, _decode)
