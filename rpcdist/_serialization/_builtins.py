"""Extensions for Python builtins (and ``OrderedDict``), WorkerInfo,
exceptions, and functions and classes (by name).

msgpack packs ``None``, ``bool``, 64-bit ``int``, ``float``, ``str``, ``bytes``,
``list`` and ``dict`` itself (the packer runs with ``strict_types``, so
subclasses of these come here, and are refused unless registered). It also
writes ``bytearray`` and ``memoryview`` as msgpack bin before consulting any
hook, so those arrive as ``bytes``: keeping them apart would need a Python walk
of every list and dict on the hot path.
"""

from __future__ import annotations

import collections
import types
from typing import Any, Final

import numpy as np

from .._errors import ConfigError, SerializationError
from .._worker import WorkerInfo
from ._exceptions import exception_from_wire, exception_to_wire
from ._extensions import (
    BIGINT,
    COMPLEX,
    ELLIPSIS,
    EXCEPTION,
    FINDERS,
    FROZENSET,
    FUNCTION,
    MARKS,
    ORDEREDDICT,
    RANGE,
    SET,
    SLICE,
    TUPLE,
    WORKERINFO,
    DecodeState,
    EncodeState,
    Handler,
    define,
)
from ._functions import name_of, policy_of, resolve

__all__: list[str] = []

_TUPLE: Final = MARKS[TUPLE]
_SET: Final = MARKS[SET]
_FROZENSET: Final = MARKS[FROZENSET]


def _malformed(what: str) -> SerializationError:
    return SerializationError(f"malformed {what} payload in message header")


def _encode_tuple(state: EncodeState, obj: tuple[Any, ...]) -> list[Any]:
    return [_TUPLE, *obj]


def _decode_tuple(state: DecodeState, items: list[Any]) -> object:
    return tuple(items[1:])


def _encode_set(state: EncodeState, obj: set[Any]) -> list[Any]:
    return [_SET, *obj]


def _decode_set(state: DecodeState, items: list[Any]) -> object:
    return set(items[1:])


def _encode_frozenset(state: EncodeState, obj: frozenset[Any]) -> list[Any]:
    return [_FROZENSET, *obj]


def _decode_frozenset(state: DecodeState, items: list[Any]) -> object:
    return frozenset(items[1:])


def _encode_complex(state: EncodeState, obj: complex) -> list[Any]:
    return [MARKS[COMPLEX], obj.real, obj.imag]


def _decode_complex(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 3 or type(items[1]) is not float or type(items[2]) is not float:
        raise _malformed("complex")
    return complex(items[1], items[2])


def _encode_bigint(state: EncodeState, obj: int) -> list[Any]:
    # Only reached for ints outside msgpack's 64-bit range.
    size = obj.bit_length() // 8 + 1
    return [MARKS[BIGINT], obj.to_bytes(size, "big", signed=True)]


def _decode_bigint(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 2 or type(items[1]) is not bytes:
        raise _malformed("int")
    return int.from_bytes(items[1], "big", signed=True)


def _encode_ordered(state: EncodeState, obj: collections.OrderedDict[Any, Any]) -> list[Any]:
    # (keys and values alternate, in order: a state_dict is an OrderedDict)
    return [MARKS[ORDEREDDICT], [x for item in obj.items() for x in item]]


def _decode_ordered(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 2 or type(items[1]) is not list or len(items[1]) % 2:
        raise _malformed("OrderedDict")
    flat = items[1]
    try:
        return collections.OrderedDict(zip(flat[::2], flat[1::2], strict=True))
    except TypeError as e:  # an unhashable key
        raise _malformed(f"OrderedDict ({e})") from e


def _encode_slice(state: EncodeState, obj: slice) -> list[Any]:
    return [MARKS[SLICE], obj.start, obj.stop, obj.step]


def _decode_slice(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 4:
        raise _malformed("slice")
    return slice(items[1], items[2], items[3])


def _encode_range(state: EncodeState, obj: range) -> list[Any]:
    return [MARKS[RANGE], obj.start, obj.stop, obj.step]


def _decode_range(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 4 or any(type(v) is not int for v in items[1:]) or items[3] == 0:
        raise _malformed("range")
    return range(items[1], items[2], items[3])


def _encode_ellipsis(state: EncodeState, obj: object) -> list[Any]:
    return [MARKS[ELLIPSIS]]


def _decode_ellipsis(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 1:
        raise _malformed("Ellipsis")
    return Ellipsis


def _encode_worker(state: EncodeState, obj: WorkerInfo) -> list[Any]:
    return [MARKS[WORKERINFO], obj.name, obj.id]


def _decode_worker(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 3 or type(items[1]) is not str or type(items[2]) is not int:
        raise _malformed("WorkerInfo")
    try:
        return WorkerInfo(items[1], items[2])
    except ConfigError as exc:  # (a peer's bad name is a bad message, not our configuration)
        raise SerializationError(f"malformed WorkerInfo payload in message header: {exc}") from None


def _encode_exception(state: EncodeState, obj: BaseException) -> list[Any]:
    return [MARKS[EXCEPTION], exception_to_wire(obj)]


def _decode_exception(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 2:
        raise _malformed("exception")
    return exception_from_wire(items[1])


def _find_exception(obj: object) -> Handler | None:
    return _encode_exception if isinstance(obj, BaseException) else None


def _encode_function(state: EncodeState, obj: Any) -> list[Any]:
    return [MARKS[FUNCTION], name_of(obj)]


def _find_class(obj: object) -> Handler | None:
    """Classes of other metaclasses (``abc.ABCMeta``, ``enum.EnumMeta``,
    torch's tensor class) travel by name as classes of ``type`` do."""
    return _encode_function if isinstance(obj, type) else None


def _decode_function(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 2 or type(items[1]) is not str:
        raise _malformed("function")
    return resolve(items[1], policy_of(state.context))


define(TUPLE, [tuple], _encode_tuple, _decode_tuple)
define(SET, [set], _encode_set, _decode_set)
define(FROZENSET, [frozenset], _encode_frozenset, _decode_frozenset)
define(COMPLEX, [complex], _encode_complex, _decode_complex)
define(BIGINT, [int], _encode_bigint, _decode_bigint)
define(ORDEREDDICT, [collections.OrderedDict], _encode_ordered, _decode_ordered)
define(SLICE, [slice], _encode_slice, _decode_slice)
define(RANGE, [range], _encode_range, _decode_range)
define(ELLIPSIS, [type(Ellipsis)], _encode_ellipsis, _decode_ellipsis)
define(WORKERINFO, [WorkerInfo], _encode_worker, _decode_worker)
define(EXCEPTION, [], _encode_exception, _decode_exception)
define(
    FUNCTION,
    [
        types.FunctionType,
        types.BuiltinFunctionType,
        types.MethodType,
        np.ufunc,
        types.MethodDescriptorType,
        types.WrapperDescriptorType,
        type,
    ],  # (str.upper, int.__add__; classes, by name as functions are)
    _encode_function,
    _decode_function,
)
FINDERS.append(_find_exception)
FINDERS.append(_find_class)
