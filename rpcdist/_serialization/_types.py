"""User types on the wire: registered dataclasses and NamedTuples, sent by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final, TypeVar, overload

from .._errors import ConfigError, SerializationError
from ._extensions import DECODERS, ENCODERS, MARKS, REGISTERED, DecodeState, EncodeState

__all__ = ["fields_of", "register_type"]

_T = TypeVar("_T", bound=type)
_MARK: Final = MARKS[REGISTERED]


@dataclasses.dataclass(frozen=True)
class _Spec:
    cls: type
    name: str
    fields: tuple[str, ...]
    init: tuple[bool, ...] | None  # per field, for dataclasses; None for NamedTuples

    def build(self, values: list[Any]) -> object:
        if len(values) != len(self.fields):
            raise SerializationError(
                f"registered type {self.name!r} expects {len(self.fields)} fields, "
                f"message has {len(values)}"
            )
        try:
            if self.init is None:
                return self.cls(*values)
            kwargs = {f: v for f, v, i in zip(self.fields, values, self.init) if i}
            obj = self.cls(**kwargs)
            for f, v, i in zip(self.fields, values, self.init):
                if not i:
                    object.__setattr__(obj, f, v)
            return obj
        except Exception as exc:
            raise SerializationError(
                f"cannot rebuild registered type {self.name!r}: {exc}"
            ) from exc


_by_name: dict[str, _Spec] = {}
_by_class: dict[type, _Spec] = {}


def fields_of(cls: type) -> tuple[str, ...] | None:
    """Return the field names sent for a registered type, or None if unregistered."""
    spec = _by_class.get(cls)
    return None if spec is None else spec.fields


def _spec_for(cls: type, name: str) -> _Spec:
    if dataclasses.is_dataclass(cls):
        fields = dataclasses.fields(cls)
        return _Spec(cls, name, tuple(f.name for f in fields), tuple(f.init for f in fields))
    if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return _Spec(cls, name, tuple(cls._fields), None)  # type: ignore[attr-defined]
    raise ConfigError(
        f"register_type supports dataclasses and NamedTuples, not {cls.__qualname__!r}"
    )


@overload
def register_type(cls: _T, *, name: str | None = None) -> _T: ...
@overload
def register_type(cls: None = None, *, name: str | None = None) -> Callable[[_T], _T]: ...
def register_type(cls: _T | None = None, *, name: str | None = None) -> _T | Callable[[_T], _T]:
    """Let a dataclass or NamedTuple be sent; it travels by name and its fields.

    Register it on every worker, under the same name. Usable as a decorator,
    with or without arguments: ``@register_type`` or ``@register_type(name="x")``.

    Args:
        cls: The class.
        name: Its wire name; defaults to ``"module:qualname"``.

    Returns:
        ``cls`` itself (or, without ``cls``, a decorator).

    Raises:
        ConfigError: ``cls`` is neither a dataclass nor a NamedTuple, or
            ``name`` is taken by a different class.
    """
    if cls is None:
        return lambda c: register_type(c, name=name)
    if not isinstance(cls, type):
        raise ConfigError(f"register_type expects a class, got {cls!r}")
    wire_name = f"{cls.__module__}:{cls.__qualname__}" if name is None else name
    if not isinstance(wire_name, str) or not wire_name:
        raise ConfigError(f"register_type needs a non-empty str name, got {name!r}")
    spec = _spec_for(cls, wire_name)
    taken = _by_name.get(wire_name)
    if taken is not None and taken.cls is not cls:
        old = taken.cls
        if (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ConfigError(
                f"type name {wire_name!r} is already registered for {old.__module__}."
                f"{old.__qualname__}"
            )
        del _by_class[old]  # the class was redefined (module reloaded): replace it
        ENCODERS.pop(old, None)
    previous = _by_class.get(cls)
    if previous is not None:
        _by_name.pop(previous.name, None)
    _by_name[wire_name] = _by_class[cls] = spec
    ENCODERS[cls] = (
        _namedtuple_handler(wire_name) if spec.init is None else _dataclass_handler(spec)
    )
    return cls


register_type.__module__ = "rpcdist"  # public as rpcdist.register_type


def _namedtuple_handler(name: str) -> Callable[[EncodeState, Any], list[Any]]:
    def handle(state: EncodeState, obj: tuple[Any, ...]) -> list[Any]:
        return [_MARK, name, *obj]

    return handle


def _dataclass_handler(spec: _Spec) -> Callable[[EncodeState, Any], list[Any]]:
    name, fields = spec.name, spec.fields

    def handle(state: EncodeState, obj: object) -> list[Any]:
        return [_MARK, name, *[getattr(obj, f) for f in fields]]

    return handle


def _decode_registered(state: DecodeState, items: list[Any]) -> object:
    name = items[1] if len(items) > 1 else None
    spec = _by_name.get(name) if type(name) is str else None
    if spec is None:
        raise SerializationError(
            f"received a value of type {name!r}, which is not registered on this worker "
            "(call rpcdist.register_type for it on every worker)"
        )
    return spec.build(items[2:])


DECODERS[REGISTERED] = _decode_registered
