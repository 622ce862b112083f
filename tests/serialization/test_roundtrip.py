"""Round trips: every supported type comes back with its type and value."""

from __future__ import annotations

import collections
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rpcdist._serialization as serialization
from rpcdist._errors import SerializationError
from rpcdist._serialization import CODEC_VERSION, decode, encode
from rpcdist._serialization._extensions import DecodeState, EncodeState
from rpcdist._worker import WorkerInfo

from ._helpers import FUNCTIONS, Pair, Point, arrays, roundtrip, same, values

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(values)
def test_any_value_round_trips(value: object) -> None:
    assert same(roundtrip(value), value)


@SETTINGS
@given(values)
def test_decoding_the_encoders_own_buffers_round_trips(value: object) -> None:
    header, buffers = encode(value)
    assert isinstance(header, bytes)
    assert all(isinstance(b, memoryview) for b in buffers)
    assert same(decode(memoryview(header), buffers), value)


@SETTINGS
@given(arrays())
def test_arrays_keep_dtype_shape_and_bits(a: Any) -> None:
    out = roundtrip(a)
    assert same(out, a)
    if isinstance(a, np.ndarray):
        assert isinstance(out, np.ndarray)
        assert out.dtype == a.dtype  # byte order included
        assert out.flags.c_contiguous or out.flags.f_contiguous


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -1,
        2**63 - 1,
        2**64 - 1,
        -(2**63),
        2**64,
        -(2**63) - 1,
        10**100,
        -(10**100),
        0.0,
        -0.0,
        math.inf,
        -math.inf,
        math.nan,
        1 + 2j,
        complex(math.nan, -0.0),
        "",
        "héllo ✓",
        "\ud800 lone surrogates \udfff",  # e.g. from os.fsdecode
        {"\udcff": np.str_("\ud800")},
        b"",
        b"\x00\xff",
        [],
        (),
        [(), [()]],
        ((1,), [1]),
        {},
        {1: "int", None: "none", False: "bool", (1, "a"): "tuple", b"k": "bytes"},
        {frozenset({1}): {(): []}},
        set(),
        {1, "a", (2, 3)},
        frozenset(),
        frozenset({frozenset({1})}),
        WorkerInfo("worker1", 3),
        collections.OrderedDict([("b", np.ones(2)), (1, [None]), ((2,), "tuple key")]),
        collections.OrderedDict(),
        slice(None),
        slice(1, -1, 2),
        range(0),
        range(-3, 10**20, 7),
        Ellipsis,
        (Ellipsis, slice(None, 2)),
        np.dtype(">f4"),
        np.dtype("<M8[ns]"),
        np.dtype("|S3"),
        np.float32(1.5),
        np.float16(-0.0),
        np.int64(-(2**63)),
        np.uint64(2**64 - 1),
        np.bool_(True),
        np.complex64(1 - 1j),
        np.longdouble("1.1"),
        np.datetime64("2024-01-02T03:04:05", "s"),
        np.timedelta64(7, "ms"),
        np.array(5),
        np.zeros((0, 3, 0)),
        np.arange(12, dtype=">f4").reshape(3, 4)[::2, ::-1],
        np.asfortranarray(np.arange(6, dtype=np.complex128).reshape(2, 3)),
        np.array([np.nan, -0.0], dtype=np.longdouble),
        Point(np.arange(3), Pair([1], {"k": (2,)})),
        *FUNCTIONS,
        ValueError("boom", 3),
        (("worker1", 3, {"a": 1.5}), {}),
    ],
    ids=repr,
)
def test_examples_round_trip(value: object) -> None:
    assert same(roundtrip(value), value)


def test_tuple_keys_and_frozen_sets_rebuild_before_hashing() -> None:
    value = {(1, (2, 3)): {frozenset({(4,)}): "x"}}
    out = roundtrip(value)
    assert same(out, value)
    assert out[(1, (2, 3))][frozenset({(4,)})] == "x"  # type: ignore[index]


def test_bytearray_and_memoryview_arrive_as_bytes() -> None:
    # msgpack's packer writes them as bin before any hook runs (documented).
    assert roundtrip([bytearray(b"ab"), memoryview(b"cd")]) == [b"ab", b"cd"]


def test_exception_inside_a_structure_keeps_type_args_and_traceback() -> None:
    try:
        raise KeyError("missing")
    except KeyError as exc:
        error = exc
    out = roundtrip({"error": error})
    assert isinstance(out, dict)
    got = out["error"]
    assert type(got) is KeyError and got.args == ("missing",)
    assert "raise KeyError" in got.remote_traceback


@given(st.integers())
def test_ints_of_any_size(n: int) -> None:
    assert same(roundtrip(n), n)


def test_public_names_are_documented() -> None:
    assert serialization.__all__ == sorted(serialization.__all__, key=lambda n: (n.upper() != n, n))
    for name in serialization.__all__:
        obj = getattr(serialization, name)
        if callable(obj):
            assert obj.__doc__, name
    assert isinstance(CODEC_VERSION, int)


def _general_header(value: object) -> bytes:
    """``value``'s header as msgpack and the extension hooks write it."""
    state = EncodeState(False, None)
    return msgpack.packb(value, default=state.default, strict_types=True)  # type: ignore[no-any-return]


def test_the_no_argument_call_and_none_keep_the_general_wire_format() -> None:
    """The fast paths' constant headers are the bytes the hooks write, so a
    peer decoding them the general way (an older worker) reads the same values."""
    for value in [((), {}), None]:
        header, buffers = encode(value)
        assert header == _general_header(value) and buffers == []
        state = DecodeState([], False, None)
        general = msgpack.unpackb(header, ext_hook=state.ext_hook, list_hook=state.list_hook)
        assert same(decode(header, []), value) and same(general, value)


def test_near_misses_of_the_no_argument_call_take_the_general_path() -> None:
    for value in [((1,), {}), ((), {"a": 1}), ([], {}), ((), collections.OrderedDict()), ((),)]:
        assert same(roundtrip(value), value)
        assert encode(value)[0] == _general_header(value)
    assert type(roundtrip(Pair((), {}))) is Pair  # a registered tuple subclass keeps its type


def test_each_no_argument_call_decodes_to_its_own_kwargs() -> None:
    header, _ = encode(((), {}))
    first = decode(header, [])
    assert isinstance(first, tuple)
    first[1]["x"] = 1  # a handler may keep or change the dict it was given
    assert decode(memoryview(header), []) == ((), {})


def test_a_fast_path_header_with_buffers_is_refused() -> None:
    for value in [((), {}), None]:
        header, _ = encode(value)
        with pytest.raises(SerializationError, match="out-of-band buffers"):
            decode(header, [memoryview(b"x")])
