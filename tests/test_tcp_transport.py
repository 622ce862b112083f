"""The plain-socket transport on its own: two connections over a socket pair."""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np
import pytest
import rpc_funcs as rf

from rpcdist import ProtocolError, RpcOptions, WorkerLostError
from rpcdist._transport import Hooks
from rpcdist._transport._frames import CALL, P2P, REPLY, OutMessage
from rpcdist._transport._tcp import TcpLink


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        c = socket.create_connection(srv.getsockname())
        s, _ = srv.accept()
    return c, s


class _Pair:
    """``a`` and ``b`` joined by a socket pair; each records what it receives."""

    def __init__(self, loop: asyncio.AbstractEventLoop, alloc=None, **opts) -> None:
        options = RpcOptions(token=None, **opts)
        self.got: dict[str, list] = {"a": [], "b": []}
        self.arrived = asyncio.Event()
        s1, s2 = _tcp_pair()
        self.raw = s1
        self.a = TcpLink(
            loop, peer_rank=1, label="b", hooks=Hooks(on_message=self._sink("a")), options=options
        )
        self.b = TcpLink(
            loop,
            peer_rank=0,
            label="a",
            hooks=Hooks(on_message=self._sink("b"), alloc=alloc),
            options=options,
        )
        self.a.attach(s1)
        self.b.attach(s2)
        self.runs = [loop.create_task(c.run()) for c in (self.a, self.b)]

    def _sink(self, side: str):
        def on_message(conn, m) -> None:
            self.got[side].append(m)
            self.arrived.set()

        return on_message

    async def wait_for(self, side: str, n: int, timeout: float = 20) -> list:
        async with asyncio.timeout(timeout):
            while len(self.got[side]) < n:
                self.arrived.clear()
                await self.arrived.wait()
        return self.got[side]

    async def close(self) -> None:
        for t in self.runs:
            t.cancel()
        await asyncio.gather(*self.runs, return_exceptions=True)


def _msg(i: int, *bufs, kind=CALL, header=b"h", method="f") -> OutMessage:
    return OutMessage(kind, method, header, [memoryview(b) for b in bufs], id=i)


def test_small_messages_arrive_in_order_and_coalesced():
    async def go():
        p = _Pair(asyncio.get_running_loop())
        for i in range(1, 1001):
            p.a.send(_msg(i, struct.pack("<I", i)))
        got = await p.wait_for("b", 1000)
        assert [m.id for m in got] == list(range(1, 1001))
        assert [struct.unpack("<I", m.buffers[0])[0] for m in got] == list(range(1, 1001))
        assert p.a.messages_out < 100  # queued in one loop turn: few writes
        await p.close()

    asyncio.run(go())


def test_small_messages_sharing_batches_with_chunks_of_large_ones_arrive_whole_in_order():
    # Whole messages and chunks in one envelope; payloads split across reads.
    rng = np.random.default_rng(2)
    bufs = [rng.integers(0, 255, int(n), dtype=np.uint8) for n in rng.integers(0, 3000, 400)]
    bufs[100] = bufs[300] = rng.integers(0, 255, 300_000, dtype=np.uint8)

    async def go():
        p = _Pair(asyncio.get_running_loop(), chunk_bytes=20_000, batch_bytes=64 << 10)
        for i, b in enumerate(bufs, 1):
            p.a.send(_msg(i, b, header=struct.pack("<I", i)))
        got = await p.wait_for("b", len(bufs))
        assert [m.id for m in got] == list(range(1, len(bufs) + 1))
        assert [struct.unpack("<I", m.header)[0] for m in got] == [m.id for m in got]
        for m, b in zip(got, bufs):
            assert np.array_equal(np.frombuffer(m.buffers[0], np.uint8), b)
        assert p.b._reasm.pending() == 0
        await p.close()

    asyncio.run(go())


def test_large_payloads_both_ways_at_once_do_not_deadlock():
    # Far beyond the socket buffers: both writers park while both readers drain.
    x = np.random.default_rng(0).integers(0, 255, 48 << 20, dtype=np.uint8)
    y = x[::-1].copy()

    async def go():
        p = _Pair(asyncio.get_running_loop(), chunk_bytes=1 << 20, batch_bytes=1 << 20)
        p.a.send(_msg(1, x, np.arange(5)))
        p.b.send(_msg(2, y, kind=REPLY))
        (ma,) = await p.wait_for("a", 1, timeout=60)
        (mb,) = await p.wait_for("b", 1, timeout=60)
        assert np.array_equal(np.frombuffer(mb.buffers[0], np.uint8), x)
        assert np.array_equal(np.frombuffer(mb.buffers[1], np.int64), np.arange(5))
        assert np.array_equal(np.frombuffer(ma.buffers[0], np.uint8), y)
        got = np.frombuffer(mb.buffers[0], np.uint8)
        got[0] ^= 1  # a private, writable copy
        assert got[0] != x[0]
        await p.close()

    asyncio.run(go())


def test_header_larger_than_the_staging_buffer():
    header = bytes(range(256)) * 8192  # 2 MiB of inline (non-array) data

    async def go():
        p = _Pair(asyncio.get_running_loop())
        p.a.send(_msg(1, header=header))
        p.a.send(_msg(2, b"after"))
        got = await p.wait_for("b", 2)
        assert got[0].header == header and bytes(got[1].buffers[0]) == b"after"
        await p.close()

    asyncio.run(go())


def test_posted_receive_buffer_is_filled_in_place():
    src = np.random.default_rng(1).random(1 << 20)
    posted = np.zeros_like(src)

    def alloc(kind, key, total):
        assert (kind, key, total) == (P2P, "k", src.nbytes)
        return memoryview(posted).cast("B")

    async def go():
        p = _Pair(asyncio.get_running_loop(), alloc=alloc)
        sent = asyncio.Event()
        m = _msg(1, src, kind=P2P, method="k")
        m.on_packed = sent.set
        p.a.send(m)
        await asyncio.wait_for(sent.wait(), 20)
        await p.wait_for("b", 1)
        assert np.array_equal(posted, src)
        await p.close()

    asyncio.run(go())


def test_peer_going_away_closes_the_link_with_a_lost_worker_error():
    async def go():
        p = _Pair(asyncio.get_running_loop())
        p.a.send(_msg(1))
        await p.wait_for("b", 1)  # both links are up and running
        p.runs[0].cancel()  # "a" goes away: its socket is closed
        await asyncio.gather(p.runs[0], return_exceptions=True)
        await asyncio.wait_for(p.runs[1], 10)  # "b" sees a clean EOF and ends
        assert isinstance(p.b.closed, WorkerLostError)
        with pytest.raises(WorkerLostError):
            p.b.send(_msg(1))

    asyncio.run(go())


@pytest.mark.parametrize(
    "junk, error",
    [
        (struct.pack("<I", 3) + b"\xff\xff\xff", ProtocolError),  # not an envelope
        (struct.pack("<I", 100) + b"x" * 10, WorkerLostError),  # truncated, then EOF
    ],
)
def test_bad_bytes_end_the_connection_with_a_typed_error(junk, error):
    async def go():
        loop = asyncio.get_running_loop()
        s1, s2 = _tcp_pair()
        got = []
        conn = TcpLink(
            loop,
            peer_rank=0,
            label="peer",
            hooks=Hooks(on_message=lambda c, m: got.append(m)),
            options=RpcOptions(token=None),
        )
        conn.attach(s2)
        s1.sendall(junk)
        s1.shutdown(socket.SHUT_WR)
        with pytest.raises(error):
            await asyncio.wait_for(conn.run(), 10)
        assert got == [] and isinstance(conn.closed, error)
        s1.close()

    asyncio.run(go())


def _family(agent, dst: int) -> int:
    return agent.links.get(dst)._sock.family


def test_same_host_workers_talk_over_a_unix_socket_unless_turned_off():
    from rpcdist.testing import local_agents

    with local_agents(2, options=RpcOptions(token=None, local_sockets=True)) as (a, b):
        assert a.rpc_async(1, rf.add, args=(1, 2)).wait(10) == 3
        assert b.rpc_async(0, rf.add, args=(3, 4)).wait(10) == 7
        assert _family(a, 1) == _family(b, 0) == socket.AF_UNIX
    with local_agents(2, options=RpcOptions(token=None, local_sockets=False)) as (a, b):
        assert a.links.transport.unix_name is None
        assert a.rpc_async(1, rf.add, args=(1, 2)).wait(10) == 3
        assert _family(a, 1) == socket.AF_INET


def test_a_unix_socket_that_cannot_be_reached_falls_back_to_tcp():
    """Same host id but another network namespace looks like this: the
    abstract name does not answer, so the worker dials TCP instead."""
    from rpcdist.testing import local_agents

    with local_agents(2, options=RpcOptions(token=None, local_sockets=True)) as (a, b):
        a.links.peer(1).info["unix"] = "rpcdist-nobody-listens-here"
        big = np.arange(300_000, dtype=np.float64)
        assert np.array_equal(a.rpc_async(1, rf.echo, args=(big,)).wait(10), big)
        assert _family(a, 1) == socket.AF_INET
