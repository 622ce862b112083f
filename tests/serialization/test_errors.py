"""Refusals name the type and where it sat; pickle is opt-in."""

from __future__ import annotations

import dataclasses
import enum
import gc
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np
import pytest

from rpcdist._errors import RRefError, SerializationError
from rpcdist._serialization import decode, encode, register_extension
from rpcdist._serialization._extensions import DECODERS
from rpcdist._serialization._plugins import unregister_extension

from ._helpers import Point, roundtrip, same


class Opaque:
    """A type the codec does not know (module level, so pickle can find it)."""

    def __init__(self, payload: Any = None) -> None:
        self.payload = payload

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and same(self.payload, other.payload)

    __hash__ = None  # type: ignore[assignment]


class Sealed:
    """A hashable type the codec does not know (classes themselves travel by name)."""


@pytest.mark.parametrize(
    ("value", "where", "path"),
    [
        (Opaque(), "value", "value"),
        (("x", {"opt": Opaque()}), "args", "args[1]['opt']"),
        ([1, [2, [3, Opaque()]]], "value", "value[1][1][1]"),
        ({"k": (0, {5, frozenset({Sealed()})})}, "kwargs", "kwargs['k'][1]<item "),
        (Point(1, [Opaque()]), "value", "value.y[0]"),
        ({Sealed(): 1}, "value", "value<key "),
    ],
)
def test_refusal_names_type_and_path(value: object, where: str, path: str) -> None:
    with pytest.raises(SerializationError) as info:
        encode(value, where=where)
    message = str(info.value)
    kind = "Sealed" if "<item" in path or "<key" in path else "Opaque"
    assert message.startswith(f"cannot serialize value of type '{kind}' at {path}")
    assert "register_type" in message


def test_the_first_bad_value_in_packing_order_is_named() -> None:
    lock = threading.Lock()
    with pytest.raises(SerializationError, match=r"'lock' at args\[1\]"):
        encode((1, lock, Opaque()), where="args")


@pytest.mark.parametrize(
    "value",
    [
        enum.IntEnum("Color", "RED")(1),
        type("MyStr", (str,), {})("s"),
        type("MyList", (list,), {})([1]),
        np.arange(3).astype(object),
    ],
    ids=["IntEnum", "str-subclass", "list-subclass", "object-array"],
)
def test_subclasses_and_object_arrays_are_refused(value: object) -> None:
    with pytest.raises(SerializationError, match=r"at value\[0\]"):
        encode([value])


def test_unregistered_dataclass_and_namedtuple_get_a_hint() -> None:
    @dataclasses.dataclass
    class Loose:
        a: int

    class LooseTuple(NamedTuple):
        a: int

    for value in (Loose(1), LooseTuple(1)):
        with pytest.raises(SerializationError, match="is not registered; decorate it"):
            encode({"v": value})


def test_reference_cycles_are_reported_not_crashed() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(SerializationError, match="nested too deeply"):
        encode({"c": cycle})


def test_a_refused_value_is_freed_with_its_error() -> None:
    # The refusal must not leave a reference cycle behind (exception ->
    # traceback -> the encoder's state -> exception) holding the value until
    # the garbage collector runs: an owner whose early copy of a new value
    # failed kept that value alive that way.
    value = [np.zeros(4), Opaque()]
    ref = weakref.ref(value[1])
    gc.disable()
    try:
        try:
            encode(value)
        except SerializationError:
            pass
        else:
            raise AssertionError("an unknown type was encoded")
        del value
        assert ref() is None, "the refused value outlived its error"
    finally:
        gc.enable()


def test_unknown_types_are_pickled_when_allowed_with_buffers_out_of_band() -> None:
    value = {"o": Opaque(np.arange(100_000, dtype=np.float64))}
    header, buffers = encode(value, allow_pickle=True)
    assert sum(b.nbytes for b in buffers) == 800_000  # the array did not go in-band
    assert len(header) < 1000
    assert decode(header, buffers, allow_pickle=True) == value


def test_pickled_payload_is_refused_unless_allowed() -> None:
    header, buffers = encode([Opaque(1)], allow_pickle=True)
    with pytest.raises(SerializationError, match="pickle is disabled"):
        decode(header, buffers)


def test_known_types_are_never_pickled() -> None:
    header, _ = encode((1, np.float32(2)), allow_pickle=True)
    assert same(decode(header, []), (1, np.float32(2)))


def test_rpcdist_errors_from_extension_encoders_propagate_unchanged() -> None:
    class Handle:
        pass

    def refuse(obj: object, context: object) -> object:
        raise RRefError("the owner is gone")

    free = next(c for c in range(63, 31, -1) if DECODERS[c] is DECODERS[0])
    register_extension(Handle, free, refuse, lambda s, c: None)
    try:
        with pytest.raises(RRefError, match="owner is gone"):
            encode([Handle()])
    finally:
        unregister_extension(Handle)


def test_roundtrip_helper_sanity() -> None:
    assert same(roundtrip((1, [2])), (1, [2]))
