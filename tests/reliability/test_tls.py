"""TLS on the plain-socket transport (Python's ssl): TLS, mutual TLS, refusals."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import ssl
import struct

import msgpack
import numpy as np
import pytest
import rel_funcs as rf
from certs import HAVE_OPENSSL, make_ca, make_cert

import rpcdist
from rpcdist._store import GrpcTls, StoreClient
from rpcdist._transport import _tcp, _tcp_dial
from rpcdist._transport._tcp_dial import tcp_connect
from rpcdist._transport._tls import TlsStream, tls_contexts
from rpcdist.testing import as_current, local_agents

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL, reason="the openssl command line is missing")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "rogue-ca")
    return {
        "worker": make_cert(d, "ca", "worker"),
        "rogue": make_cert(d, "rogue-ca", "rogue"),
        "dir": d,
    }


@pytest.mark.parametrize("local_sockets", [True, False], ids=["unix", "tcp"])
def test_calls_and_arrays_travel_over_tls(pki, local_sockets):
    opts = rpcdist.RpcOptions(token="t", local_sockets=local_sockets, **pki["worker"])
    assert opts.validated().data_transport == "tcp"  # TLS no longer means gRPC
    # (large payloads stay in the encrypted stream, not in same-host segments)
    assert opts.validated().payload_shm_threshold is None
    assert rpcdist.RpcOptions(token="t", shm_threshold_bytes="auto").payload_shm_threshold
    with local_agents(2, options=opts) as (a, b):
        assert a.rpc_sync(1, rf.add, args=(20, 22)) == 42  # a thread-driven connection
        big = np.random.default_rng(0).random(1 << 20)  # 8 MB: chunked, received in place
        got = a.rpc_async(1, rf.echo, args=(big,)).wait(30)
        np.testing.assert_array_equal(got, big)
        direct = a.statistics()["direct_sync_calls"]
        with as_current(a):  # the same both ways on a thread-driven connection
            np.testing.assert_array_equal(rpcdist.rpc_sync(1, rf.echo, args=(big,)), big)
        assert a.statistics()["direct_sync_calls"] == direct + 1
        futs = [b.rpc_async(0, rf.add, args=(i, i)) for i in range(200)]  # coalesced writes
        assert [f.wait(30) for f in futs] == [2 * i for i in range(200)]
        with as_current(a):
            rref = rpcdist.remote(1, rf.ones, args=(5,))
            assert rref.to_here(10).sum() == 5
            del rref
        link = a.links.get(1)
        assert link is not None and isinstance(link._sock, TlsStream)  # type: ignore[attr-defined]
        assert link._sock.version() in ("TLSv1.2", "TLSv1.3")  # type: ignore[attr-defined]


def _dial(agent, options) -> str:
    """Dial ``agent``'s worker 0 as worker 1 with ``options`` (TLS from them)."""

    async def go() -> str:
        try:
            sock = await tcp_connect(
                agent.links.address(0),
                "w0",
                options=options,
                my_rank=1,
                my_name="worker1",
                tls=tls_contexts(options),
            )
        except rpcdist.ConnectError as e:
            return str(e)
        sock.close()
        return "connected"

    return agent.run(go())


def test_mutual_tls_refuses_a_certificate_of_another_ca_and_a_client_without_one(pki):
    opts = rpcdist.RpcOptions(token="t", local_sockets=False, **pki["worker"])
    with local_agents(2, options=opts) as (a, _):
        assert _dial(a, opts) == "connected"
        ca = pki["worker"]["tls_ca_file"]
        rogue = rpcdist.RpcOptions(token="t", **{**pki["rogue"], "tls_ca_file": ca})
        assert "handshake" in _dial(a, rogue)  # its certificate is not of the job's CA
        assert _raw_tls_hello(a, pki, with_cert=False) == "refused by TLS"
        assert _plaintext_hello(a) == "no answer"
        assert a.rpc_sync(1, rf.add, args=(1, 1)) == 2  # serving on


def test_without_mutual_tls_the_token_still_guards_the_door(pki):
    opts = rpcdist.RpcOptions(token="t", local_sockets=False, tls_mutual=False, **pki["worker"])
    with local_agents(2, options=opts) as (a, _):
        assert a.rpc_sync(1, rf.add, args=(1, 1)) == 2
        assert _raw_tls_hello(a, pki, with_cert=False, token="t") == "accepted"
        assert "token" in _raw_tls_hello(a, pki, with_cert=False, token="nope")


def test_a_client_that_does_not_trust_the_servers_ca_refuses_it(pki):
    opts = rpcdist.RpcOptions(token="t", local_sockets=False, **pki["worker"])
    with local_agents(2, options=opts) as (a, _):
        ca = pki["rogue"]["tls_ca_file"]
        wrong_ca = rpcdist.RpcOptions(token="t", **{**pki["worker"], "tls_ca_file": ca})
        assert "certificate verify failed" in _dial(a, wrong_ca)


def test_tls_files_that_cannot_be_loaded_are_a_config_error(pki, tmp_path):
    bad = rpcdist.RpcOptions(
        token="t",
        tls_cert_file=str(tmp_path / "missing.pem"),
        tls_key_file=str(tmp_path / "missing.key"),
        tls_ca_file=pki["worker"]["tls_ca_file"],
    )
    with pytest.raises(rpcdist.ConfigError, match="missing.pem"):
        tls_contexts(bad)


def test_certificates_can_come_from_the_environment(pki, monkeypatch):
    monkeypatch.setenv("RPCDIST_TLS_CERT", pki["worker"]["tls_cert_file"])
    monkeypatch.setenv("RPCDIST_TLS_KEY", pki["worker"]["tls_key_file"])
    monkeypatch.setenv("RPCDIST_TLS_CA", pki["worker"]["tls_ca_file"])
    opts = rpcdist.RpcOptions(token="t")
    assert opts.tls and opts.tls_cert_file == pki["worker"]["tls_cert_file"]


def test_grpc_transport_keeps_tls_with_or_without_client_certificates(pki):
    for mutual in (True, False):
        opts = rpcdist.RpcOptions(token="t", transport="grpc", tls_mutual=mutual, **pki["worker"])
        with local_agents(2, options=opts) as (a, _):
            assert a.rpc_async(1, rf.add, args=(2, 3)).wait(10) == 5


def test_the_rendezvous_store_is_served_over_tls_too(pki):
    """The job token travels in every store request: with certificates the
    store speaks only TLS, and (mutual) only to clients with one of the CA's."""
    opts = rpcdist.RpcOptions(token="t", **pki["worker"])
    rogue = rpcdist.RpcOptions(token="t", **pki["rogue"])
    with local_agents(2, options=opts) as (a, _):
        address = a.store.address

        async def reach(tls: GrpcTls | None) -> str:
            client = StoreClient(address, token="t", timeout=1.0, tls=tls)
            try:
                await client.connect()
                await client.set("test/tls", b"v")
                return "ok" if await client.get("test/tls", timeout=1.0) == b"v" else "lost"
            except rpcdist.ConnectError as e:
                return str(e)
            finally:
                await client.close()

        assert a.run(reach(GrpcTls.of(opts))) == "ok"
        # plaintext gRPC is not served; nor is a certificate of another CA
        assert "this rank must have them too" in a.run(reach(None))
        assert "same CA" in a.run(reach(GrpcTls.of(rogue)))
        # the CA's own certificate is not enough without the key to match
        bare = dataclasses.replace(GrpcTls.of(opts), cert=b"", key=b"")
        assert a.run(reach(bare)) != "ok"


# ----------------------------------------------------------------- raw peers


def _exact(sock, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise ConnectionResetError("closed")
        got += chunk
    return got


def _hello(sock, token: str | None) -> dict:
    body = msgpack.packb({"rank": 1, "name": "worker1", "token": token})
    sock.sendall(_tcp.MAGIC + struct.pack("<I", len(body)) + body)
    (n,) = struct.unpack("<I", _exact(sock, 4))
    return msgpack.unpackb(_exact(sock, n))


def _raw_tls_hello(agent, pki, *, with_cert: bool, token: str = "t") -> str:
    host, port = _tcp_dial.split_address(agent.links.address(0))
    ctx = ssl.create_default_context(cafile=pki["worker"]["tls_ca_file"])
    if with_cert:
        ctx.load_cert_chain(pki["worker"]["tls_cert_file"], pki["worker"]["tls_key_file"])
    with socket.create_connection((host, port), timeout=10) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname=host) as s:
                answer = _hello(s, token)
        except (ssl.SSLError, OSError, struct.error):
            return "refused by TLS"
    return "accepted" if answer.get("ok") else str(answer.get("error"))


def _plaintext_hello(agent) -> str:
    host, port = _tcp_dial.split_address(agent.links.address(0))
    with socket.create_connection((host, port), timeout=10) as s:
        try:
            answer = _hello(s, "t")
        except (OSError, struct.error, ValueError, msgpack.UnpackException):
            return "no answer"
    return repr(answer)


def test_tls_stream_moves_bytes_both_ways_over_a_socket_pair(pki):
    """TlsStream on its own: handshake, then 3 MB each way (partial sends,
    ciphertext kept back, reads in pieces), then the end."""
    from rpcdist._transport._tls import handshake, recv_exact, send_all

    ctxs = tls_contexts(rpcdist.RpcOptions(token="t", **pki["worker"]))
    assert ctxs is not None
    data = np.random.default_rng(1).bytes(3 << 20)

    async def go() -> tuple[bytes, bytes, int]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        sa = TlsStream(a, ctxs.server, server_side=True)
        sb = TlsStream(b, ctxs.client, server_side=False, server_hostname="127.0.0.1")
        await asyncio.gather(handshake(loop, sa), handshake(loop, sb))
        _, there = await asyncio.gather(send_all(loop, sb, data), recv_exact(loop, sa, len(data)))
        _, back = await asyncio.gather(send_all(loop, sa, data), recv_exact(loop, sb, len(data)))
        b.shutdown(socket.SHUT_WR)
        try:
            await recv_exact(loop, sa, 1)
            end = "more bytes"
        except ConnectionResetError:
            end = "closed"
        sa.close()
        sb.close()
        return there, back, end

    there, back, end = asyncio.run(go())
    assert there == data and back == data and end == "closed"
