"""Malformed input only ever raises SerializationError (or CallPolicyError for a
name the policy refuses), so a worker keeps serving."""

from __future__ import annotations

import warnings
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rpcdist._errors import CallPolicyError, SerializationError
from rpcdist._serialization import decode, encode

from ._helpers import values

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXT = msgpack.ExtType


def decode_or_refuse(header: Any, buffers: Any, **kw: Any) -> None:
    """Decode; a SerializationError is fine, and so is a CallPolicyError (a
    mutated function name the policy refuses); anything else fails the test."""
    try:
        decode(header, buffers, **kw)
    except (SerializationError, CallPolicyError):
        pass


@FUZZ
@given(st.binary(max_size=300), st.lists(st.binary(max_size=40), max_size=3))
def test_random_bytes(header: bytes, buffers: list[bytes]) -> None:
    decode_or_refuse(header, buffers)


@FUZZ
@given(values, st.data())
def test_mutated_headers(value: object, data: st.DataObject) -> None:
    header, buffers = encode(value)
    raw = bytearray(header)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        action = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if action == "flip" and raw:
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "set" and raw:
            raw[at] = data.draw(st.integers(0, 255))
        elif action == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        elif action == "delete":
            del raw[at : at + data.draw(st.integers(1, 4))]
        else:
            del raw[at:]
    decode_or_refuse(bytes(raw), [bytearray(b) for b in buffers])


@FUZZ
@given(values, st.data())
def test_truncated_headers(value: object, data: st.DataObject) -> None:
    header, buffers = encode(value)
    cut = data.draw(st.integers(0, max(len(header) - 1, 0)))
    decode_or_refuse(header[:cut], buffers)


@FUZZ
@given(values, st.data())
def test_buffer_count_or_size_mismatch_is_refused(value: object, data: st.DataObject) -> None:
    header, buffers = encode(value)
    changed: list[Any] = [bytes(b) for b in buffers]
    action = data.draw(st.sampled_from(["add", "drop", "grow", "shrink"]))
    if action == "add":
        changed.insert(data.draw(st.integers(0, len(changed))), b"\x00" * 8)
    else:
        assume(changed)
        at = data.draw(st.integers(0, len(changed) - 1))
        if action == "drop":
            del changed[at]
        elif action == "grow":
            changed[at] += b"\x00" * data.draw(st.integers(1, 16))
        else:
            assume(changed[at])
            changed[at] = changed[at][: data.draw(st.integers(0, len(changed[at]) - 1))]
    with pytest.raises(SerializationError):
        decode(header, changed)


def _nd(dtype: Any, shape: Any, index: Any = 0, order: Any = 0) -> bytes:
    return msgpack.packb([EXT(7, b""), dtype, shape, index, order])  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("header", "buffers"),
    [
        (b"", []),
        (b"\xc1", []),  # never-used byte
        (b"\x91", []),  # array missing its item
        (b"\xdd\xff\xff\xff\xff", []),  # array of 4G items in 5 bytes
        (b"\x91" * 3000 + b"\x00", []),  # too deep
        (msgpack.packb(EXT(99, b"")), []),
        (msgpack.packb([EXT(1, b"junk")]), []),
        (msgpack.packb([1, EXT(1, b"")]), []),  # stray marker
        (msgpack.packb({"k": EXT(2, b"")}), []),
        (msgpack.packb(EXT(1, b"")), []),
        (msgpack.packb([EXT(2, b""), [1]]), []),  # unhashable set item
        (msgpack.packb({"a": 1}) + b"\x00", []),  # trailing data
        (b"\xa2\xff\xfe", []),  # invalid UTF-8
        (msgpack.packb([EXT(5, b""), 1]), []),
        (msgpack.packb([EXT(6, b""), "x"]), []),
        (msgpack.packb([EXT(8, b""), "<f4", b"\x00"]), []),
        (msgpack.packb([EXT(9, b""), 1, "w"]), []),
        (msgpack.packb([EXT(10, b""), "not a dict"]), []),
        (msgpack.packb([EXT(11, b""), "os"]), []),
        (msgpack.packb([EXT(13, b""), b"x", []]), []),  # pickle, not allowed
        (msgpack.packb([EXT(15, b""), "<f4", [1], 0, 0]), [b"\x00" * 4]),
        (msgpack.packb([EXT(16, b""), ["odd"]]), []),  # OrderedDict: keys and values
        (msgpack.packb([EXT(16, b""), "not a list"]), []),
        (msgpack.packb([EXT(16, b""), [[1], 2]]), []),  # unhashable key
        (msgpack.packb([EXT(17, b""), 1, 2]), []),  # slice: three fields
        (msgpack.packb([EXT(18, b""), 1, 2, 0]), []),  # range step 0
        (msgpack.packb([EXT(18, b""), 1.5, 2, 1]), []),
        (msgpack.packb([EXT(19, b""), 1]), []),  # Ellipsis has no fields
        (msgpack.packb([EXT(20, b""), "O"]), []),  # dtypes: as arrays may have
        (msgpack.packb([EXT(20, b""), "a8"]), []),  # (NumPy would warn)
        (msgpack.packb([EXT(20, b""), "<f8,<f8"]), []),
        (msgpack.packb([EXT(20, b""), 4]), []),
        (_nd("O", [1]), [b"\x00" * 8]),
        (_nd("V8", [1]), [b"\x00" * 8]),
        (_nd("<U0", [1]), [b""]),
        (_nd("<M8[bogus]", [1]), [b"\x00" * 8]),
        (_nd("a8", [1]), [b"\x00" * 8]),  # NumPy's deprecated alias of S8: it warns
        (_nd("f8", [1]), [b"\x00" * 8]),  # not what dtype.str gives
        (_nd("<f8,<f8", [1]), [b"\x00" * 16]),
        (_nd("(2,)<f4", [1]), [b"\x00" * 8]),
        (_nd(["<f8"], [1]), [b"\x00" * 8]),
        (_nd("<f8", [-1]), [b""]),
        (_nd("<f8", [1] * 65), [b"\x00" * 8]),
        (_nd("<f8", [2**62, 2**62]), [b""]),
        (_nd("<f8", [1], 1), [b"\x00" * 8]),
        (_nd("<f8", [1], True), [b"\x00" * 8]),
        (_nd("<f8", [1], 0, 2), [b"\x00" * 8]),
        (_nd("<f8", [1]), [b"\x00" * 7]),
        (_nd("<f8", [1]), None),
        (msgpack.packb([_nd_list := [EXT(7, b""), "<f8", [1], 0, 0], _nd_list]), [b"\x00" * 8]),
        (None, []),
    ],
)
def test_malformed_examples(header: Any, buffers: Any) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SerializationError):
            decode(header, buffers)
    assert not caught, caught[0].message  # refused quietly: a peer cannot fill the log


def test_non_contiguous_buffer_is_refused() -> None:
    header, _ = encode(np.zeros(2, dtype=np.uint8))
    strided = memoryview(bytearray(4))[::2]
    with pytest.raises(SerializationError, match="not contiguous"):
        decode(header, [strided])


@pytest.mark.parametrize("payload", [1, None, [1, 2, 3, 4], {"a": 1}, b"xx"])
def test_a_plugin_marker_outside_an_rpc_is_refused(payload):
    """A mutated header can spell another rpcdist module's marker (an RRef's,
    found by the fuzz test above); decoded with no RPC around it, that is
    malformed input like any other (it raised RRefError before). A plugin of
    plain data (``rpcdist.torch``'s shapes, when the torch tests ran first)
    may also find a well-formed value in it: one of its own class."""
    import rpcdist._rref._rref  # noqa: F401  (registers the RRef marker)
    from rpcdist._serialization._extensions import PLUGINS

    assert PLUGINS, "no plugin registered"
    for cls, (code, _) in list(PLUGINS.items()):
        try:
            got = decode(msgpack.packb([EXT(code, b""), payload]), [])
        except SerializationError:
            continue
        assert isinstance(got, cls), f"{cls.__qualname__} decoded {payload!r} as {got!r}"
