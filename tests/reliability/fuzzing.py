"""Fuzzing the frame decoder and the hello (used by the tests and the benchmark).

Inputs are seeded mutations of valid streams (calls, replies, chunked arrays,
one-way messages, heartbeats): bit flips, random bytes, truncations, lengths
set to huge or random values, splices and pure noise. Each stream goes
through the plain-socket reader (:class:`~rpcdist._transport._tcp.TcpLink`'s
own read path, fed in random chunk sizes by a fake socket), through the
gRPC-path :class:`~rpcdist._transport._frames.Reassembler`, and every whole
message out of them through the codec, as a worker would decode it. Hellos
go through :func:`~rpcdist._transport._tcp_dial.parse_hello` and
``check_hello``.

A *crash* is any exception other than the typed ones the worker handles
(``ProtocolError`` ends the link, ``SerializationError`` answers the call),
or an error logged with a traceback. Allocation is bounded: every payload
buffer the decoder asks for is checked against the link's limit, and the
staging buffer against the input's size.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

import rpcdist
from rpcdist._serialization import decode, encode
from rpcdist._transport import _frames, _tcp
from rpcdist._transport._base import Hooks
from rpcdist._transport._frames import (
    CALL,
    HEARTBEAT,
    P2P,
    REPLY,
    OutMessage,
    Reassembler,
    pack_batch,
)
from rpcdist._transport._tcp_dial import check_hello, parse_hello

LIMIT = 1 << 20  # max_message_bytes of the fuzzed links
_LEN = struct.Struct("<I")
#: msgpack items an envelope's fields could be swapped for: arrays, maps and
#: bins claiming 4 GiB, int64's least and uint64's greatest value, a bool.
_HEADS = (
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\xc3",
)
_HANDLED = (rpcdist.ProtocolError, rpcdist.SerializationError, rpcdist.WorkerLostError)


@dataclass
class Counts:
    streams: int = 0
    grpc_messages: int = 0
    hellos: int = 0
    messages_decoded: int = 0
    rejected: int = 0
    largest_alloc: int = 0
    crashes: list[str] = field(default_factory=list)

    @property
    def inputs(self) -> int:
        return self.streams + self.grpc_messages + self.hellos


def corpus() -> list[bytes]:
    """Valid stream messages to mutate."""
    out = []

    def record(*msgs: OutMessage, chunk: int = 1 << 20) -> None:
        q = deque(msgs)
        while q:
            out.append(pack_batch(q, 1 << 20, chunk))

    def msg(kind: int, method: str, value: Any, i: int, **kw: Any) -> OutMessage:
        header, bufs = encode(value)
        return OutMessage(kind, method, header, bufs, id=i, **kw)

    record(msg(CALL, "rel_funcs:add", ((1, 2), {}), 1, deadline=None))
    record(msg(REPLY, "rel_funcs:add", 3, 1, meta={"ad": 5}))
    record(msg(CALL, "rel_funcs:echo", ((np.arange(300, dtype=np.float32),), {}), 2), chunk=256)
    record(msg(CALL, "rel_funcs:echo", (({"a": [1, "x", None, 2.5]}, b"raw"), {}), 3))
    big = np.arange(40000, dtype=np.int32)  # 160 KB: the direct-receive path
    record(msg(REPLY, "rel_funcs:echo", big, 5), chunk=96 << 10)
    record(msg(CALL, "rel_funcs:apply", ((rpcdist.WorkerInfo("w", 1), (1, 2)), {}), 4))
    record(OutMessage(P2P, HEARTBEAT, b"", [], id=0), OutMessage(P2P, "k", b"h", [], id=9))
    record(*(msg(CALL, "rel_funcs:add", ((i, i), {}), 10 + i) for i in range(5)))
    return out


def mutate(rnd: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.choice((1, 1, 2, 3, 8))):
        op = rnd.randrange(8)
        if op == 0 and b:  # flip bits
            i = rnd.randrange(len(b))
            b[i] ^= 1 << rnd.randrange(8)
        elif op == 1 and b:  # random bytes
            i = rnd.randrange(len(b))
            b[i : i + rnd.randrange(1, 9)] = rnd.randbytes(rnd.randrange(1, 9))
        elif op == 2:  # truncate
            b = b[: rnd.randrange(len(b) + 1)]
        elif op == 3 and len(b) >= 4:  # a length prefix: huge, random, off by a bit
            n = rnd.choice(
                (0xFFFFFFFF, 1 << 31, rnd.randrange(1 << 32), len(b) + rnd.randrange(-8, 8))
            )
            b[0:4] = _LEN.pack(n & 0xFFFFFFFF)
        elif op == 4:  # splice another message in
            other = rnd.choice(pool)
            i = rnd.randrange(len(b) + 1)
            b[i:i] = other[rnd.randrange(len(other) + 1) :]
        elif op == 5:  # repeat a piece
            i = rnd.randrange(len(b) + 1)
            b[i:i] = b[i : i + rnd.randrange(64)] * rnd.randrange(1, 4)
        elif op == 6 and b:  # msgpack heads: a huge array, map or bin; extreme integers
            i = rnd.randrange(len(b))
            b[i : i + rnd.randrange(1, 10)] = rnd.choice(_HEADS)
        else:  # noise
            b = bytearray(rnd.randbytes(rnd.randrange(64)))
    return bytes(b)


class _FakeSock:
    """Hands ``data`` out in random chunks, then EOF."""

    family = socket.AF_UNIX

    def __init__(self, data: bytes, rnd: random.Random) -> None:
        self._data = memoryview(data)
        self._rnd = rnd

    def recv_into(self, buf: Any, n: int = 0) -> int:
        want = min(len(buf), n or len(buf), self._rnd.choice((1, 7, 64, 4096, 1 << 20)))
        k = min(want, len(self._data))
        buf[:k] = self._data[:k]
        self._data = self._data[k:]
        if k == 0:
            return 0
        return k

    def fileno(self) -> int:
        return -1

    def close(self) -> None:
        pass


class _Watch(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def _decode_all(msgs: list[Any], counts: Counts) -> None:
    for m in msgs:
        counts.messages_decoded += 1
        try:
            decode(m.header, m.buffers)
        except (rpcdist.SerializationError, rpcdist.CallPolicyError):
            pass


def run(n: int, seed: int = 0, *, progress: Callable[[int], None] | None = None) -> Counts:
    """Fuzz with ``n`` inputs: 60% streams, 20% gRPC messages, 20% hellos."""
    rnd = random.Random(seed)
    pool = corpus()
    counts = Counts()
    opts = rpcdist.RpcOptions(token=None, max_message_bytes=LIMIT)
    loop = asyncio.new_event_loop()
    watch = _Watch()
    logger = logging.getLogger("rpcdist")
    logger.addHandler(watch)
    propagate, logger.propagate = logger.propagate, False  # 10^5 warnings: keep them here
    real_fresh = _frames._fresh

    def fresh(size: int) -> memoryview:
        counts.largest_alloc = max(counts.largest_alloc, size)
        if size > LIMIT:
            raise AssertionError(f"decoder asked for {size} bytes, above the limit {LIMIT}")
        return real_fresh(size)

    _frames._fresh = fresh
    try:
        for i in range(n):
            kind = i % 5
            data = mutate(rnd, rnd.choice(pool), pool)
            try:
                if kind < 3:
                    _stream(data, rnd, loop, opts, counts)
                elif kind == 3:
                    counts.grpc_messages += 1
                    try:
                        _decode_all(Reassembler(max_message_bytes=LIMIT).feed(data), counts)
                    except _HANDLED:
                        counts.rejected += 1
                else:
                    _hello(rnd, counts)
            except Exception as e:  # anything else is a crash
                counts.crashes.append(f"input {i}: {type(e).__name__}: {e}")
            if watch.records:
                counts.crashes.extend(f"input {i}: logged {r}" for r in watch.records)
                watch.records.clear()
            if progress is not None and i % 10000 == 0:
                progress(i)
    finally:
        _frames._fresh = real_fresh
        logger.removeHandler(watch)
        logger.propagate = propagate
        loop.close()
    return counts


def _stream(data: bytes, rnd: random.Random, loop: Any, opts: Any, counts: Counts) -> None:
    counts.streams += 1
    got: list[Any] = []
    link = _tcp.TcpLink(
        loop, peer_rank=1, label="fuzz", hooks=Hooks(lambda _, m: got.append(m)), options=opts
    )
    link._sock = _FakeSock(data, rnd)  # type: ignore[assignment]
    for _ in range(len(data) + 2):
        if link._sock is None:
            break
        link._read()
    if link.closed is not None and not isinstance(link.closed, _HANDLED):
        raise AssertionError(f"link ended with {link.closed!r}")
    if isinstance(link.closed, rpcdist.ProtocolError):
        counts.rejected += 1
    if len(link._stage) > max(256 << 10, 4 * len(data)):  # grows only as bytes come
        raise AssertionError(f"staging buffer grew to {len(link._stage)} for {len(data)} bytes")
    _decode_all(got, counts)


def _hello(rnd: random.Random, counts: Counts) -> None:
    counts.hellos += 1
    good = {"rank": 1, "name": "worker1", "token": "s3cret"}
    choice = rnd.randrange(3)
    if choice == 0:
        body = mutate(rnd, msgpack.packb(good), [msgpack.packb(good)])
    elif choice == 1:
        value: Any = dict(good)
        value[rnd.choice(("rank", "name", "token", "sync", "x"))] = rnd.choice(
            (None, -1, 2**64 - 1, 1.5, "", "w" * 300, b"\x00", [1], {"a": 1}, True, "s3cret")
        )
        body = msgpack.packb(value)
    else:
        body = rnd.randbytes(rnd.randrange(40))
    try:
        hello = parse_hello(body)
    except rpcdist.ProtocolError:
        counts.rejected += 1
        return
    why = check_hello(hello, "s3cret", lambda r, n: None if (r, n) == (1, "worker1") else "no")
    if why is not None:
        counts.rejected += 1
    elif hello.get("token") != "s3cret" or hello.get("rank") != 1:
        raise AssertionError(f"accepted a bad hello {hello!r}")
