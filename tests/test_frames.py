"""Framing: chunking, coalescing and reassembly, without sockets."""

import time
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcdist import ProtocolError
from rpcdist._transport._frames import (
    _LEN,
    CALL,
    P2P,
    Frame,
    OutMessage,
    Reassembler,
    pack_batch,
    pack_envelope,
    parse_envelope,
)


def _pump(q, batch=4096, chunk=1024):
    r, out, n = Reassembler(), [], 0
    while q:
        out += r.feed(pack_batch(q, batch, chunk))
        n += 1
    assert r.pending() == 0
    return out, n


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.binary(max_size=5000), max_size=4), min_size=1, max_size=8))
def test_messages_round_trip_in_order(payloads):
    q = deque(
        OutMessage(CALL, f"m{i}", bytes([i]), [memoryview(b) for b in bufs], id=i + 1)
        for i, bufs in enumerate(payloads)
    )
    out, _ = _pump(q)
    assert [m.id for m in out] == list(range(1, len(payloads) + 1))
    for m, bufs in zip(out, payloads):
        assert [bytes(b) for b in m.buffers] == bufs
        assert m.header == bytes([m.id - 1])


def test_small_messages_are_coalesced():
    q = deque(OutMessage(CALL, "f", b"h", [], id=i) for i in range(1, 101))
    out, n = _pump(q, batch=1 << 20)
    assert len(out) == 100 and n == 1


def test_large_buffer_is_chunked_and_other_messages_interleave():
    big = np.arange(100_000, dtype=np.int64)
    q = deque([OutMessage(CALL, "big", b"", [memoryview(big)], id=1)])
    r = Reassembler()
    first = pack_batch(q, 1 << 16, 1 << 14)
    assert len(first) < (1 << 16) + 1024 and q  # bounded by the batch budget, still queued
    q.append(OutMessage(CALL, "small", b"", [], id=2))
    got = r.feed(first)
    while q:
        got += r.feed(pack_batch(q, 1 << 16, 1 << 14))
    assert [m.method for m in got] == ["big", "small"]
    arr = np.frombuffer(got[0].buffers[0], dtype=np.int64)
    assert np.array_equal(arr, big)
    arr[0] = -1  # received arrays are writable
    assert big[0] == 0


def _staged(msg):
    """``msg`` packed as one stream message: its single frame, and the bytes after the envelope."""
    data = memoryview(bytearray(pack_batch(deque([msg]), 1 << 20, 1 << 20)))
    (n,) = _LEN.unpack_from(data, 0)
    (frame,) = parse_envelope(data[4 : 4 + n])
    return frame, data[4 + n :]


def test_a_whole_message_with_buffers_is_taken_from_the_staged_bytes_as_a_copy():
    bufs = [b"abc", b"", b"defgh"]
    frame, staged = _staged(OutMessage(CALL, "f", b"h", [memoryview(b) for b in bufs], id=7))
    r = Reassembler()
    m = r.whole(frame, staged)
    assert m is not None and (m.id, m.method, m.header) == (7, "f", b"h")
    assert [bytes(b) for b in m.buffers] == bufs
    staged[:] = b"\0" * len(staged)  # the link reuses its staging buffer
    assert [bytes(b) for b in m.buffers] == bufs
    assert r.pending() == 0


def test_a_whole_message_not_all_staged_takes_the_frame_by_frame_path():
    frame, staged = _staged(OutMessage(CALL, "f", b"h", [memoryview(b"x" * 100)], id=1))
    r = Reassembler()
    assert r.whole(frame, staged[:99]) is None
    assert r.whole(frame) is None
    assert Reassembler(max_message_bytes=99).whole(frame, staged) is None  # (refused there)


def test_a_whole_staged_message_fills_its_posted_receive_buffer():
    src = np.arange(10.0)
    dest = np.zeros_like(src)
    r = Reassembler(
        alloc=lambda kind, key, total: memoryview(dest).cast("B") if kind == P2P else None
    )
    frame, staged = _staged(OutMessage(P2P, "k", b"", [memoryview(src)], id=1))
    m = r.whole(frame, staged)
    assert np.array_equal(dest, src)
    assert np.shares_memory(np.frombuffer(m.buffers[0]), dest)
    small = Reassembler(alloc=lambda kind, key, total: memoryview(bytearray(8)))
    with pytest.raises(ProtocolError, match="posted receive buffer has 8 bytes"):
        small.whole(frame, staged)


def test_posted_buffer_receives_chunks_directly():
    src = np.random.default_rng(0).random(50_000)
    dest = np.zeros_like(src)
    r = Reassembler(
        alloc=lambda kind, key, total: memoryview(dest).cast("B") if kind == P2P else None
    )
    q = deque([OutMessage(P2P, "k", b"", [memoryview(src)], id=1)])
    out = []
    while q:
        out += r.feed(pack_batch(q, 1 << 16, 1 << 15))
    assert np.array_equal(dest, src)
    assert np.shares_memory(np.frombuffer(out[0].buffers[0]), dest)


def test_on_packed_fires_after_the_bytes_are_copied():
    src = bytearray(b"abc" * 1000)
    fired = []
    q = deque(
        [OutMessage(P2P, "k", b"", [memoryview(src)], id=1, on_packed=lambda: fired.append(1))]
    )
    data = pack_batch(q, 1 << 16, 1 << 16)
    assert fired == [1]
    src[:3] = b"zzz"
    (m,) = Reassembler().feed(data)
    assert bytes(m.buffers[0][:3]) == b"abc"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_is_a_protocol_error_never_a_crash(data):
    r = Reassembler()
    try:
        r.feed(data)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_truncated_or_mutated_messages_are_protocol_errors(data):
    q = deque([OutMessage(CALL, "f", b"hdr", [memoryview(b"x" * 100)], id=5)])
    raw = bytearray(pack_batch(q, 1 << 16, 1 << 16))
    cut = data.draw(st.integers(0, len(raw) - 1))
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= data.draw(st.integers(1, 255))
    for candidate in (bytes(raw[:cut]), bytes(raw)):
        try:
            Reassembler().feed(candidate)
        except ProtocolError:
            pass


def test_a_deadline_travels_as_the_time_left():
    q = deque([OutMessage(CALL, "f", b"h", [], id=3, deadline=time.monotonic() + 5.0)])
    (frame,) = _envelope(pack_batch(q, 1 << 16, 1 << 16))
    assert 4_000_000 < frame.timeout_us <= 5_000_000
    q = deque([OutMessage(CALL, "f", b"h", [], id=4, deadline=time.monotonic() - 5.0)])
    assert _envelope(pack_batch(q, 1 << 16, 1 << 16))[0].timeout_us == 1


def _envelope(data):
    (n,) = _LEN.unpack_from(data, 0)
    return parse_envelope(memoryview(data)[4 : 4 + n])


def test_whole_messages_among_chunks_of_a_large_one_arrive_whole_and_in_order():
    big = bytes(range(256)) * 40
    q = deque(
        [
            OutMessage(CALL, "a", b"1", [memoryview(b"xyz")], id=1),
            OutMessage(CALL, "big", b"2", [memoryview(big)], id=2),
            OutMessage(CALL, "c", b"3", [], id=3),
        ]
    )
    r, got = Reassembler(), []
    while q:
        got += r.feed(pack_batch(q, 1 << 16, 4096))
    assert [(m.method, [bytes(b) for b in m.buffers]) for m in got] == [
        ("a", [b"xyz"]),
        ("big", [big]),
        ("c", []),
    ]
    assert r.pending() == 0


def test_a_whole_message_reusing_the_id_of_one_being_received_is_a_protocol_error():
    frames = [
        Frame(id=9, kind=CALL, first=True, method="f", buffer_sizes=(8,), data_len=4),
        Frame(id=9, kind=CALL, first=True, last=True, method="g"),
    ]
    with pytest.raises(ProtocolError, match="started twice"):
        Reassembler().feed(pack_envelope(frames) + b"abcd")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ((9, CALL, True, True, "f", b"", (), 0, -4, "", b""), "negative"),
        ((9, CALL, True, True, "f", b"", (8, -1), 0, 0, "", b""), "buffer sizes"),
        ((9, CALL, True, True, "f", b"", ("8",), 0, 0, "", b""), "buffer sizes"),
        ((9, CALL, 1, True, "f", b"", (), 0, 0, "", b""), "'int', 'bool'"),
        ((True, CALL, True, True, "f", b"", (), 0, 0, "", b""), "'bool', 'int'"),
        ((9, CALL, True, True, b"f", b"", (), 0, 0, "", b""), "'bytes', 'bytes'"),
        ((9, CALL, True, True, "f", b"", (), 0, 0, ""), "fields are"),
        ((9, CALL, True, True, "f", b"", (), 0, 0, "", b"", 0), "fields are"),
        ({"id": 9}, "fields are"),
    ],
)
def test_an_envelope_field_of_the_wrong_type_or_sign_is_refused_naming_it(fields, named):
    with pytest.raises(ProtocolError, match=f"malformed frame 1 .*{named}"):
        parse_envelope(memoryview(pack_envelope([Frame(1, CALL), fields])[4:]))


@pytest.mark.parametrize("env", [b"\x93\x01\x02\x03", b"\x81\xa1a\x01", b"\xc1", b"\xdd\xff\xff"])
def test_an_envelope_that_is_no_array_of_frames_is_refused(env):
    with pytest.raises(ProtocolError, match="malformed frame"):
        parse_envelope(memoryview(env))


def test_every_field_of_a_frame_survives_the_envelope():
    frames = [
        Frame(2**64 - 1, P2P, True, False, "k\u00e9", b"\x00h", (0, 1 << 40), 7, 3, "/p", b"\x80"),
        Frame(0, CALL),
    ]
    assert parse_envelope(memoryview(pack_envelope(frames)[4:])) == frames
