"""``torch.nn.Module`` objects on the wire, without pickle.

PyTorch RPC pickles everything. rpcdist keeps pickle off and sends a module
as its class's name and its attributes: ``["pkg.mod:Class", [[name, value],
...]]``, each value an ordinary codec value (tensors out-of-band, nested
modules the same way, functions by name). ``OrderedDict`` and ``dict``
attributes (``_parameters``, ``_buffers``, ``_modules``, the hook tables)
keep their type. The receiver resolves the class under its callable policy
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
from .._rpc._context import WireContext
from .._serialization import register_extension, resolve_function
from .._serialization._functions import DEFAULT_POLICY, function_name

__all__ = ["MODULE_CODE", "install"]

#: Codec extension code of torch modules (RRefs 32, rpcdist tensors 33).
MODULE_CODE = 34


def _pack(value: Any) -> list[Any]:
    kind = type(value)
    if kind is OrderedDict:
        return ["o", [[k, _pack(v)] for k, v in value.items()]]
    if kind is dict:
        return ["d", [[k, _pack(v)] for k, v in value.items()]]
    return ["v", value]


def _unpack(item: Any) -> Any:
    if not (isinstance(item, list) and len(item) == 2 and item[0] in ("o", "d", "v")):
        raise SerializationError("malformed torch module payload")
    kind, value = item
    if kind == "v":
        return value
    pairs = [(k, _unpack(v)) for k, v in value]
    return OrderedDict(pairs) if kind == "o" else dict(pairs)


def _encode(module: torch.nn.Module, wire: Any) -> list[Any]:
    name = function_name(type(module))
    getstate = getattr(module, "__getstate__", None)
    attrs = getstate() if getstate is not None else module.__dict__
    if not isinstance(attrs, dict):
        raise SerializationError(
            f"cannot send torch module {name}: its __getstate__ returned a "
            f"{type(attrs).__name__}, not a dict"
        )
    return [name, [[k, _pack(v)] for k, v in attrs.items()]]


def _decode(payload: Any, wire: Any) -> torch.nn.Module:
    if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[0], str)):
        raise SerializationError("malformed torch module payload")
    name, items = payload
    policy = wire.agent.policy if isinstance(wire, WireContext) else DEFAULT_POLICY
    cls = resolve_function(name, policy)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise SerializationError(f"received a torch module of {name}, which is not an nn.Module")
    attrs = {k: _unpack(v) for k, v in items}
    module = cls.__new__(cls)
    module.__setstate__(attrs)  # type: ignore[no-untyped-call]
    return module


def install() -> None:
    """Teach the codec torch modules (idempotent)."""
    register_extension(torch.nn.Module, MODULE_CODE, _encode, _decode)
