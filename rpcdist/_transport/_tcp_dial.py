"""Plain-socket transport: the handshake, dialling, the server and the transport.

A peer connection starts (after the TLS handshake, when TLS is configured)
with a magic string and a msgpack hello (rank, name, job token, whether one
blocking call at a time will use it); the server answers ok or a reason and
closes. Nothing is parsed as a frame before that, so a wrong token is a
``ConnectError`` naming it and nothing runs. Same-host peers are dialled on
their abstract Unix socket first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import secrets
import socket
import ssl
import struct
from collections.abc import Awaitable
from typing import Any

import msgpack

from .._errors import ConnectError, ProtocolError, RpcdistError
from .._options import RpcOptions
from ._base import Accept, Hooks, Link, Peer, TransportBase, Validate, segment_writer
from ._tcp import MAGIC, TcpLink
from ._tls import TlsContexts, TlsStream, handshake, recv_exact, send_all, tls_contexts

__all__ = [
    "TcpServer",
    "TcpTransport",
    "Unreachable",
    "check_hello",
    "parse_hello",
    "split_address",
    "tcp_connect",
]

_log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_HELLO_MAX = 64 << 10
_HANDSHAKE_TIMEOUT = 30.0

# ------------------------------------------------------------------ handshake


_recv_exact = recv_exact


async def _send_msg(loop: asyncio.AbstractEventLoop, sock: socket.socket, obj: Any) -> None:
    body = msgpack.packb(obj)
    await send_all(loop, sock, _LEN.pack(len(body)) + body)


async def _recv_msg(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(await _recv_exact(loop, sock, 4))
    if n > _HELLO_MAX:
        raise ProtocolError(f"handshake message of {n} bytes is too large")
    return parse_hello(await _recv_exact(loop, sock, n))


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` to ``(host, port)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def parse_hello(body: bytes) -> Any:
    """Decode a handshake message (pure; at most ``_HELLO_MAX`` bytes).

    Raises:
        ProtocolError: it is not msgpack.
    """
    try:
        return msgpack.unpackb(body)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise ProtocolError(f"malformed handshake message: {type(e).__name__}: {e}") from e


def check_hello(hello: Any, token: str | None, validate: Validate) -> str | None:
    """Why a decoded hello is refused, or ``None`` to accept it (pure).

    ``token`` is the job secret the hello must carry (``None``: any).
    """
    if not isinstance(hello, dict):
        return "malformed hello (not a map)"
    if token is not None:
        got = hello.get("token")
        if not isinstance(got, str) or not hmac.compare_digest(
            got.encode("utf-8", "surrogatepass"), token.encode()
        ):
            return "missing or wrong rpcdist job token"
    rank, name = hello.get("rank"), hello.get("name")
    if isinstance(rank, bool) or not isinstance(rank, int) or not isinstance(name, str):
        return "malformed hello (rank and name required)"
    return validate(rank, name)


class Unreachable(ConnectError):
    """The peer's Unix socket could not be connected to (nothing was
    exchanged): the caller dials TCP instead, so users never see this type."""


async def tcp_connect(
    address: str,
    label: str,
    *,
    options: RpcOptions,
    my_rank: int,
    my_name: str,
    unix: str | None = None,
    sync: bool = False,
    tls: TlsContexts | None = None,
) -> socket.socket:
    """Connect to a peer's :class:`TcpServer` and present our identity and token.

    ``address`` is ``host:port``; with ``unix`` (the name of the peer's
    abstract Unix socket), that socket is dialled instead. ``sync`` tells the
    peer that one blocking call at a time will use the connection. With
    ``tls``, the connection is wrapped in TLS first (the peer's certificate
    must name the host of ``address``).

    Raises:
        Unreachable: ``unix`` was given and that socket cannot be reached.
        ConnectError: the peer cannot be reached over TCP, the handshake
            failed, or the peer refused us (e.g. our job token), with its reason.
    """
    loop = asyncio.get_running_loop()
    target: Any
    host = split_address(address)[0]
    if unix is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target = "\0" + unix
    else:
        host, port = split_address(address)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        target = (host, port)
    sock.setblocking(False)
    try:
        try:
            await loop.sock_connect(sock, target)
        except OSError as e:
            kind = ConnectError if unix is None else Unreachable
            raise kind(f"could not connect to {label}: {e}") from e
        try:
            async with asyncio.timeout(_HANDSHAKE_TIMEOUT):
                if tls is not None:
                    stream = TlsStream(sock, tls.client, server_side=False, server_hostname=host)
                    await handshake(loop, stream)
                    sock = stream  # type: ignore[assignment]
                await send_all(loop, sock, MAGIC)
                hello = {"rank": my_rank, "name": my_name, "token": options.token}
                if sync:
                    hello["sync"] = True
                await _send_msg(loop, sock, hello)
                reply = await _recv_msg(loop, sock)
        except ssl.SSLError as e:
            raise ConnectError(f"TLS handshake with {label} failed: {e}") from e
        except (OSError, TimeoutError, ProtocolError) as e:
            what = "timed out" if isinstance(e, TimeoutError) else str(e)
            raise ConnectError(f"handshake with {label} failed: {what}") from e
        if not isinstance(reply, dict) or reply.get("error"):
            why = reply.get("error") if isinstance(reply, dict) else repr(reply)
            raise ConnectError(f"{label} refused the connection: {why}")
    except BaseException:
        sock.close()
        raise
    return sock


class TcpServer:
    """Accepts peer sockets, checks their hello and job token, then hands
    them to ``accept`` with a factory that wraps the socket in a link."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        options: RpcOptions,
        segments: Any,
        tls: TlsContexts | None = None,
    ) -> None:
        self._loop = loop
        self._options = options
        self._segments = segments
        self._tls = tls
        self._validate: Validate | None = None
        self._accept: Accept | None = None
        self._listeners: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        #: Name of the abstract Unix socket also listened on (``None``: none).
        self.unix_name: str | None = None

    async def start(self, validate: Validate, accept: Accept) -> int:
        """Listen on ``listen_host`` at a port the OS picks (and on an abstract
        Unix socket for same-host peers, when ``options.unix_sockets``).

        Raises:
            ConnectError: the address cannot be bound.
        """
        self._validate, self._accept = validate, accept
        host = self._options.listen_host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))
            sock.listen(512)
        except OSError as e:
            sock.close()
            raise ConnectError(f"cannot listen on {host}: {e}") from e
        self.port = sock.getsockname()[1]
        self._listen(sock)
        if self._options.unix_sockets:
            # The abstract namespace: no file to clean up, gone with the socket.
            name = f"rpcdist-{os.getpid()}-{secrets.token_hex(8)}"
            usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                usock.bind("\0" + name)
                usock.listen(512)
            except OSError as e:  # not fatal: peers dial TCP instead
                usock.close()
                _log.debug("no Unix socket for same-host peers: %s", e)
            else:
                self.unix_name = name
                self._listen(usock)
        return self.port

    def _listen(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._listeners.append(sock)
        self._accepting.append(self._loop.create_task(self._accept_loop(sock)))

    async def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = await self._loop.sock_accept(listener)
            except OSError as e:
                _log.warning("accept failed: %s", e)
                await asyncio.sleep(0.05)
                continue
            task = self._loop.create_task(self._serve(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = self._loop
        sock.setblocking(False)
        try:
            async with asyncio.timeout(_HANDSHAKE_TIMEOUT):
                if self._tls is not None:
                    stream = TlsStream(sock, self._tls.server, server_side=True)
                    await handshake(loop, stream)
                    sock = stream  # type: ignore[assignment]
                if await _recv_exact(loop, sock, len(MAGIC)) != MAGIC:
                    raise ProtocolError("not an rpcdist peer (bad magic)")
                hello = await _recv_msg(loop, sock)
                why = self._check(hello)
                if why is not None:
                    _log.warning(
                        "refused a connection claiming to be %s: %s", _claimed_name(hello), why
                    )
                    await _send_msg(loop, sock, {"error": why})
                    sock.close()
                    return
                await _send_msg(loop, sock, {"ok": True})
        except (OSError, TimeoutError, ProtocolError) as e:  # ssl.SSLError is an OSError
            _log.debug("refused an incoming connection: %s", e)
            sock.close()
            return
        except BaseException:
            sock.close()
            raise
        rank, name = int(hello["rank"]), str(hello["name"])

        def make(hooks: Hooks, *, threaded: bool = False, same_host: bool = False) -> Link:
            segments = self._segments if same_host else None
            link = TcpLink(
                loop,
                peer_rank=rank,
                label=f"worker {name!r}",
                hooks=hooks,
                options=self._options,
                segments=segments,
            )
            link.attach(sock, threaded=threaded)
            return link

        assert self._accept is not None
        try:
            await self._accept(rank, name, hello.get("sync") is True, make)
        except RpcdistError as e:  # the link broke: the agent has dealt with it
            _log.debug("connection from worker %r ended: %s", name, e)

    def _check(self, hello: Any) -> str | None:
        assert self._validate is not None
        return check_hello(hello, self._options.token, self._validate)

    def set_token(self, token: str) -> None:
        self._options = dataclasses.replace(self._options, token=token)

    async def stop(self) -> None:
        """Stop accepting and end every connection this server handed out."""
        for task in self._accepting:
            task.cancel()
        await asyncio.gather(*self._accepting, return_exceptions=True)
        self._accepting = []
        for sock in self._listeners:
            sock.close()
        self._listeners = []
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _claimed_name(hello: Any) -> str:
    if isinstance(hello, dict):
        return f"rank {hello.get('rank')!r} ({hello.get('name')!r})"
    return "an unknown peer"


class TcpTransport(TransportBase):
    """Plain sockets: TCP between hosts, abstract Unix sockets on one host."""

    name = "tcp"

    def __init__(
        self, loop: asyncio.AbstractEventLoop, options: RpcOptions, *, rank: int, name: str
    ) -> None:
        super().__init__(loop, options, rank=rank, name=name)
        self.segments = segment_writer(options)
        self._tls = tls_contexts(options)
        self._server = TcpServer(loop, options, self.segments, self._tls)

    def set_token(self, token: str) -> None:
        """Present and require ``token`` from now on (the job secret made at
        rendezvous when the user set none)."""
        super().set_token(token)
        self._server.set_token(token)

    @property
    def unix_name(self) -> str | None:
        """The abstract Unix socket also listened on (``None``: none)."""
        return self._server.unix_name

    async def serve(self, validate: Validate, accept: Accept) -> dict[str, Any]:
        port = await self._server.start(validate, accept)
        host = self._options.peer_host()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return {"addr": address, "unix": self._server.unix_name}

    def link(self, peer: Peer, hooks: Hooks) -> tuple[Link, Awaitable[None]]:
        segments = self.segments if peer.same_host else None
        link = TcpLink(
            self._loop,
            peer_rank=peer.rank,
            label=peer.label,
            hooks=hooks,
            options=self._options,
            segments=segments,
        )
        return link, self._run(link, peer)

    async def _run(self, link: TcpLink, peer: Peer) -> None:
        link.attach(await self.dial(peer))
        await link.run()

    def threaded_link(self, peer: Peer, hooks: Hooks) -> TcpLink:
        """A link for one thread to drive (see :meth:`TcpLink.attach`), not yet attached."""
        return TcpLink(
            self._loop,
            peer_rank=peer.rank,
            label=peer.label,
            hooks=hooks,
            options=self._options,
            segments=self.segments if peer.same_host else None,
        )

    async def dial(self, peer: Peer, *, sync: bool = False) -> socket.socket:
        """Connect to ``peer``: its same-host Unix socket first, if any, then TCP.

        ``sync``: one blocking call at a time will use the connection.

        Raises:
            ConnectError: it cannot be reached, or refused us.
        """
        unix = peer.info.get("unix") if peer.same_host and self._options.unix_sockets else None
        while True:
            try:
                return await tcp_connect(
                    str(peer.info["addr"]),
                    peer.label,
                    options=self._options,
                    my_rank=self._rank,
                    my_name=self._name,
                    unix=unix,
                    sync=sync,
                    tls=self._tls,
                )
            except Unreachable as e:  # e.g. another network namespace
                _log.debug("dialling %s over TCP: %s", peer.label, e)
                unix = None

    async def stop(self, grace: float) -> None:
        del grace  # links are closed by their owners first
        await self._server.stop()
        if self.segments is not None:
            await self.segments.aclean()
