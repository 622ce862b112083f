"""Registered user types and extensions from other rpcdist modules."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import msgpack
import numpy as np
import pytest

from rpcdist._errors import ConfigError, SerializationError
from rpcdist._serialization import decode, encode, register_extension, register_type
from rpcdist._serialization._extensions import DECODERS
from rpcdist._serialization._plugins import unregister_extension

from ._helpers import Pair, Point, roundtrip, same


@register_type
@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    a: int
    b: tuple[int, ...] = ()
    derived: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "derived", self.a * 10)


@register_type(name="custom-name")
@dataclasses.dataclass
class Renamed:
    values: Any


def test_registered_dataclasses_and_namedtuples_round_trip() -> None:
    value = [
        Point(np.arange(4).reshape(2, 2).T, {"p": Pair(1, (2,))}),
        Frozen(3, (1, 2)),
        Renamed([Pair(None, b"x")]),
    ]
    out = roundtrip(value)
    assert same(out, value)
    assert out[1].derived == 30  # type: ignore[index]


def test_register_type_returns_the_class_and_uses_the_name() -> None:
    header, _ = encode(Renamed(1))
    assert b"custom-name" in header
    assert register_type(Renamed, name="custom-name") is Renamed


def test_only_dataclasses_and_namedtuples_can_be_registered() -> None:
    with pytest.raises(ConfigError, match="dataclasses and NamedTuples"):
        register_type(dict)
    with pytest.raises(ConfigError, match="expects a class"):
        register_type(Point(1))  # type: ignore[call-overload]


def test_a_name_cannot_be_taken_twice() -> None:
    @dataclasses.dataclass
    class Other:
        x: int

    with pytest.raises(ConfigError, match="already registered"):
        register_type(Other, name="custom-name")


def test_a_redefined_class_replaces_the_old_one() -> None:
    def define() -> type:
        class Again(NamedTuple):
            x: int

        return register_type(Again, name="again")

    first, second = define(), define()
    out = roundtrip(second(1))
    assert type(out) is second and type(out) is not first


def test_unknown_registered_name_on_the_receiver() -> None:
    header = msgpack.packb([msgpack.ExtType(12, b""), "nobody:Nothing", 1])
    with pytest.raises(SerializationError, match="'nobody:Nothing', which is not registered"):
        decode(header, [])


def test_wrong_field_count_is_refused() -> None:
    header = msgpack.packb([msgpack.ExtType(12, b""), "custom-name", 1, 2])
    with pytest.raises(SerializationError, match="expects 1 fields"):
        decode(header, [])


# ------------------------------------------------------------- extensions


class Handle:
    """Stands in for an RRef: encodes to a descriptor that may hold arrays."""

    def __init__(self, owner: int, data: np.ndarray[Any, Any]) -> None:
        self.owner, self.data = owner, data


class SubHandle(Handle):
    pass


def _encode_handle(obj: Handle, context: Any) -> object:
    context.append("encoded")
    return {"owner": obj.owner, "data": obj.data, "subclass": type(obj) is SubHandle}


def _decode_handle(structure: Any, context: Any) -> Handle:
    context.append("decoded")
    return Handle(structure["owner"], structure["data"])


@pytest.fixture
def code() -> Iterator[int]:
    """Register Handle under a free plugin code for one test."""
    free = next(c for c in range(63, 31, -1) if DECODERS[c] is DECODERS[0])
    register_extension(Handle, free, _encode_handle, _decode_handle)
    yield free
    unregister_extension(Handle)


def test_extensions_round_trip_with_context_and_out_of_band_arrays(code: int) -> None:
    log: list[str] = []
    data = np.arange(5.0)
    header, buffers = encode((Handle(2, data), SubHandle(3, data)), context=log)
    assert len(buffers) == 2 and np.shares_memory(np.frombuffer(buffers[0], np.uint8), data)
    out = decode(header, buffers, context=log)
    assert isinstance(out, tuple)
    first, second = out
    assert log == ["encoded", "encoded", "decoded", "decoded"]
    assert type(first) is Handle and first.owner == 2 and same(first.data, data)
    assert second.owner == 3  # the subclass used its base's extension


@pytest.mark.parametrize("bad", [0, 31, 64, -1, "40"])
def test_extension_codes_outside_the_plugin_range_are_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"32\.\.63"):
        register_extension(SubHandle, bad, _encode_handle, _decode_handle)


def test_an_extension_code_belongs_to_one_class(code: int) -> None:
    with pytest.raises(ConfigError, match="already used by Handle"):
        register_extension(SubHandle, code, _encode_handle, _decode_handle)
    other = next(c for c in range(32, 64) if c != code and DECODERS[c] is DECODERS[0])
    with pytest.raises(ConfigError, match=f"already has extension code {code}"):
        register_extension(Handle, other, _encode_handle, _decode_handle)


def test_extension_decoder_failures_become_serialization_errors(code: int) -> None:
    header = msgpack.packb([msgpack.ExtType(code, b""), {"no": "owner"}])
    with pytest.raises(
        SerializationError, match=rf"cannot decode Handle \(extension code {code}\)"
    ):
        decode(header, [], context=[])


def test_unregistered_extension_codes_are_refused(code: int) -> None:
    header, buffers = encode(Handle(1, np.zeros(1)), context=[])
    unregister_extension(Handle)
    with pytest.raises(SerializationError, match="unexpected extension"):
        decode(header, buffers, context=[])


def test_a_bad_value_inside_an_extension_payload_is_located(code: int) -> None:
    with pytest.raises(SerializationError, match=r"'object' at args\[0\]<encoded>\['data'\]"):
        encode((Handle(1, object()),), context=[], where="args")  # type: ignore[arg-type]


def test_a_family_extension_takes_the_values_its_test_accepts_and_owns_its_code(code: int) -> None:
    from rpcdist._serialization._plugins import register_family

    with pytest.raises(ConfigError, match="already used by Handle"):
        register_family(lambda v: False, code, _encode_handle, _decode_handle, "nothing")
    with pytest.raises(ConfigError, match=r"32\.\.63"):
        register_family(lambda v: False, 7, _encode_handle, _decode_handle, "nothing")
    # (rpcdist.torch's return types are one: tests/torch_interop/test_values.py)
