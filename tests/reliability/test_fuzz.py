"""Fuzzing the frame decoder and the hello: no crash, no unbounded allocation.

10^5 seeded mutations of valid streams and hellos (see ``fuzzing.py``), plus
Hypothesis-built envelopes whose frames claim arbitrary sizes, flags and ids.
"""

from __future__ import annotations

import struct

import fuzzing
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rpcdist
from rpcdist._transport import _frames
from rpcdist._transport._frames import CALL, INTERNAL, P2P, REPLY, Frame, Reassembler, pack_envelope
from rpcdist._transport._tcp_dial import check_hello, parse_hello

_LEN = struct.Struct("<I")


def test_a_hundred_thousand_mutated_streams_and_hellos_crash_nothing():
    counts = fuzzing.run(100_000, seed=16)
    assert counts.inputs == 100_000
    assert counts.crashes == []
    # It did reach the decoder's depths: messages came out, others were refused.
    assert counts.messages_decoded > 1000 and counts.rejected > 10_000
    assert 0 < counts.largest_alloc <= fuzzing.LIMIT


_frame = st.builds(
    lambda i, kind, first, last, sizes, data, shm: Frame(
        id=i,
        kind=kind,
        first=first,
        last=last,
        method="m",
        buffer_sizes=tuple(sizes),
        data_len=data,
        shm_path=shm,
    ),
    st.integers(0, 3),
    st.sampled_from([CALL, REPLY, P2P, INTERNAL]),
    st.booleans(),
    st.booleans(),
    st.lists(st.one_of(st.integers(0, 64), st.integers(0, 1 << 44)), max_size=3),
    st.integers(0, 80),
    st.sampled_from(["", "/etc/passwd", "/dev/shm/rpcdist-msg-x"]),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.lists(_frame, max_size=6), payload=st.binary(max_size=300), extra=st.integers(0, 8)
)
def test_arbitrary_envelopes_are_reassembled_or_refused_within_bounds(frames, payload, extra):
    asked: list[int] = []
    real = _frames._fresh

    def fresh(n: int) -> memoryview:
        asked.append(n)
        return real(n)

    env = pack_envelope(frames)[4:]
    data = _LEN.pack(len(env) + extra) + env + payload
    reasm = Reassembler(max_message_bytes=1 << 16)
    _frames._fresh = fresh
    try:
        reasm.feed(data)
    except rpcdist.ProtocolError:
        pass
    finally:
        _frames._fresh = real
    assert all(n <= 1 << 16 for n in asked)
    assert reasm._held <= 2 << 16


_VALUES = st.one_of(
    st.none(),
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=20),
    st.binary(max_size=8),
    st.booleans(),
    st.floats(allow_nan=False),
)


@settings(max_examples=1000, deadline=None)
@given(hello=st.dictionaries(st.sampled_from(["rank", "name", "token", "sync", "other"]), _VALUES))
def test_any_hello_is_accepted_only_with_the_token_and_a_known_worker(hello):
    body = msgpack.packb(hello)
    parsed = parse_hello(body)
    why = check_hello(parsed, "t", lambda r, n: None if (r, n) == (1, "w1") else "unknown")
    if why is None:
        assert parsed["token"] == "t" and parsed["rank"] == 1 and parsed["name"] == "w1"


@pytest.mark.parametrize(
    "body", [b"", b"\xc1", b"\x92\x01", b"\xdf\xff\xff\xff\xff", b"\x91" * 5000]
)
def test_malformed_hellos_are_protocol_errors(body):
    with pytest.raises(rpcdist.ProtocolError, match="malformed handshake"):
        parse_hello(body)
