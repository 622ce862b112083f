"""RPC across worker processes (spawned, hard timeouts, always cleaned up)."""

from __future__ import annotations

import asyncio
import os

import grpc
import grpc.aio
import mp_workers
import pytest
import rpc_funcs as rf

import rpcdist
from rpcdist._transport import _grpc, _tcp, _tcp_dial
from rpcdist._transport._frames import CALL, REPLY, OutMessage, pack_batch, parse_envelope
from rpcdist.testing import local_agents, run_workers

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(120)
def test_three_processes_call_each_other_and_shut_down():
    results = run_workers(mp_workers.ring_and_shutdown, 3, timeout=90)
    pids = {r[1] for r in results}
    assert len(pids) == 3 and os.getpid() not in pids
    assert [r[0] for r in results] == [100, 101, 102]
    assert [r[2] for r in results] == [1, 2, 3]


@pytest.mark.timeout(120)
def test_dead_peer_gives_typed_error_within_deadline():
    (outcome, elapsed, after) = run_workers(
        mp_workers.survive_dead_peer, 2, timeout=90, allow_exit={1}
    )[0]
    assert outcome in ("WorkerLostError", "ConnectError")
    assert elapsed < 20
    assert after in ("WorkerLostError", "ConnectError")


@pytest.mark.timeout(120)
def test_an_immediate_shutdown_of_the_store_host_lets_the_others_finish_init():
    assert run_workers(mp_workers.init_and_shutdown_at_once, 4, timeout=90) == ["initialised"] * 4


@pytest.mark.timeout(120)
def test_duplicate_names_fail_on_every_worker():
    msgs = run_workers(mp_workers.duplicate_name, 2, timeout=90)
    assert all("'same'" in m and "unique" in m for m in msgs)


def _raw_stream(agent_addr: str, token: str | None, frames: list[bytes]):
    async def go():
        async with grpc.aio.insecure_channel(agent_addr) as ch:
            md = [(_grpc.MD_RANK, "1"), (_grpc.MD_NAME, "worker1")]
            if token is not None:
                md.append((_grpc.MD_TOKEN, token))
            call = ch.stream_stream(_grpc.STREAM_METHOD)(metadata=tuple(md))
            try:
                await call.initial_metadata()
                for f in frames:
                    await call.write(f)
                await call.done_writing()
                return "ok", [m async for m in call]
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                # A write can fail before the status arrives; the call's own
                # final status says why it ended.
                return await call.code(), await call.details()

    return asyncio.run(go())


def _record_call(value: str) -> bytes:
    from collections import deque

    from rpcdist._serialization import encode

    header, bufs = encode(((value,), {}))
    q = deque([OutMessage(CALL, "rpc_funcs:record", header, bufs, id=1)])
    return pack_batch(q, 1 << 20, 1 << 20)


def _raw_tcp(
    agent_addr: str,
    token: str | None,
    frames: list[bytes],
    want_reply: bool = False,
    unix: str | None = None,
    sync: bool = False,
):
    """Speak the plain-socket transport by hand: hello, then ``frames``.

    Dials the agent's abstract Unix socket named ``unix`` instead of TCP when
    given; ``sync`` asks for a connection served by a thread of its own (as
    blocking calls use).
    Returns ``("refused", reason)`` or ``("ok", bytes the agent sent back)``:
    one reply envelope when ``want_reply``, else everything until the agent closes.
    """
    import socket
    import struct

    import msgpack

    if unix is not None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect("\0" + unix)
    else:
        s = socket.create_connection(_tcp_dial.split_address(agent_addr), timeout=10)
    with s:
        hello = {"rank": 1, "name": "worker1", "token": token}
        if sync:
            hello["sync"] = True
        body = msgpack.packb(hello)
        s.sendall(_tcp.MAGIC + struct.pack("<I", len(body)) + body)
        (n,) = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))
        answer = msgpack.unpackb(s.recv(n, socket.MSG_WAITALL))
        if answer.get("error"):
            return "refused", answer["error"]
        for f in frames:
            s.sendall(f)
        if want_reply:
            (n,) = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))
            return "ok", s.recv(n, socket.MSG_WAITALL)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(1 << 16):
            got += chunk
        return "ok", got


@pytest.mark.parametrize("transport", ["tcp", "unix", "tcp-sync", "grpc"])
def test_unauthenticated_peer_is_rejected_and_nothing_runs(transport):
    opts = rpcdist.RpcOptions(
        token="s3cret",
        transport="grpc" if transport == "grpc" else "tcp",
        local_sockets=transport == "unix",
    )
    sync = transport == "tcp-sync"
    with local_agents(2, options=opts) as (a, b):
        assert a.rpc_async(1, rf.no_args).wait(10) == "ok"  # the right token works
        unix = a.links.transport.unix_name if transport == "unix" else None
        assert (unix is not None) == (transport == "unix")
        before = rf.records()
        for token in (None, "wrong"):
            if transport == "grpc":
                code, _ = _raw_stream(a.links.address(0), token, [_record_call("intruder")])
                assert code == grpc.StatusCode.UNAUTHENTICATED
            else:
                outcome, why = _raw_tcp(
                    a.links.address(0), token, [_record_call("intruder")], unix=unix, sync=sync
                )
                assert outcome == "refused" and "token" in why
        assert rf.records() == before
        if transport != "grpc":  # the same hand-made call with the token does run
            outcome, env = _raw_tcp(
                a.links.address(0), "s3cret", [_record_call("friend")], True, unix=unix, sync=sync
            )
            frames = parse_envelope(memoryview(env))
            assert outcome == "ok" and [(f.kind, f.id) for f in frames] == [(REPLY, 1)]
            assert rf.records() == [*before, "friend"]


@pytest.mark.parametrize("transport", ["tcp", "tcp-sync", "grpc"])
def test_fuzzed_frames_are_rejected_and_the_worker_keeps_serving(transport):
    # (Every job authenticates its links: without a token of the user's own it
    # makes a secret at rendezvous, so the hand-made peer needs the token.)
    opts = rpcdist.RpcOptions(token="t", transport=transport.removesuffix("-sync"))
    with local_agents(2, options=opts) as (a, b):
        for junk in (b"", b"\x00", b"\xff" * 40, _record_call("x")[:-3], os.urandom(64)):
            if transport == "grpc":
                code, _ = _raw_stream(a.links.address(0), "t", [junk])
                assert code in (grpc.StatusCode.INVALID_ARGUMENT, "ok")
            else:
                outcome, reply = _raw_tcp(
                    a.links.address(0), "t", [junk], sync=transport == "tcp-sync"
                )
                assert outcome == "ok" and reply == b""  # closed, nothing ran
        assert b.rpc_async(0, rf.add, args=(2, 2)).wait(10) == 4
