"""TLS for the plain-socket transport (Python's ``ssl``), and the handshake I/O.

With ``RpcOptions.tls_cert_file`` (and key and CA) set, every peer
connection, TCP or same-host Unix socket, is wrapped in TLS before the hello:
TLS 1.2 or later, the peer's chain verified against ``tls_ca_file`` and its
certificate matched against the address it was dialled at; with
``tls_mutual`` (the default) the server also requires and verifies the
client's certificate. The job token is still checked in the hello, inside
the encrypted channel. Session tickets are off: connections are long-lived
and a ticket would show up as unexpected bytes on an idle blocking-call
connection.

**Deviation, on measurement: TLS runs over memory buffers, not an
``ssl.SSLSocket``.** An ``SSLSocket`` makes one ``send`` system call per
16 KiB TLS record and two ``recv`` calls per record received. :class:`TlsStream`
(the record layer: it moves ciphertext) drives an ``ssl.SSLObject`` through
``MemoryBIO`` buffers instead, moving ciphertext to and from the socket in
chunks of up to 256 KiB (sends) and 1 MiB (receives), which moves bulk
arrays faster. What remains is the sender's own work, in one thread:
encrypting, then copying into the kernel (docs/benchmarks.md, "TLS on the
plain-socket transport", has the figures). :class:`TlsStream` looks enough like a non-blocking socket (``recv_into``,
``send``, ``fileno``, ``shutdown``, ``close``; ``BlockingIOError`` when the
socket would block) for :class:`~._tcp.TcpLink` and the handshake helpers
to use it.

:func:`recv_exact` and :func:`send_all` move the handshake's bytes on a
non-blocking socket, plain or TLS, from the agent loop (asyncio's ``sock_*``
helpers do not understand TLS).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from typing import Any

from .._errors import ConfigError
from .._options import RpcOptions

__all__ = ["TlsContexts", "TlsStream", "handshake", "recv_exact", "send_all", "tls_contexts"]

#: Plaintext encrypted per ``send`` (the ciphertext then goes out in one call).
_SEND_CHUNK = 256 << 10
#: Ciphertext read from the socket per system call.
_RECV_CHUNK = 1 << 20


class TlsContexts:
    """The server and client ``SSLContext`` of one agent."""

    def __init__(self, server: ssl.SSLContext, client: ssl.SSLContext) -> None:
        self.server = server
        self.client = client


def tls_contexts(options: RpcOptions) -> TlsContexts | None:
    """Contexts for ``options``' certificates, or ``None`` without TLS.

    Raises:
        ConfigError: a certificate, key or CA file cannot be loaded.
    """
    if not options.tls:
        return None
    cert, key, ca = options.tls_cert_file or "", options.tls_key_file or "", options.tls_ca_file
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"cannot load the TLS certificate {cert!r} with key {key!r} "
                f"(RpcOptions.tls_cert_file/tls_key_file): {e}"
            ) from e
        try:
            ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"cannot load the TLS CA file {ca!r} (RpcOptions.tls_ca_file): {e}"
            ) from e
    server.verify_mode = ssl.CERT_REQUIRED if options.tls_mutual else ssl.CERT_NONE
    server.num_tickets = 0
    client.check_hostname = True
    client.verify_mode = ssl.CERT_REQUIRED
    return TlsContexts(server, client)


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, write: bool) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await fut
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


class TlsStream:
    """A TLS connection over a non-blocking socket, through memory buffers.

    Behaves as the non-blocking socket it wraps, with plaintext: ``recv_into``
    returns decrypted bytes (0 at the end), ``send`` takes plaintext, and both
    raise ``BlockingIOError`` when the socket would block. Ciphertext that the
    socket did not take yet is kept (:meth:`out_pending`) and goes out first
    on the next ``send`` or :meth:`flush`. Not thread-safe: the caller
    serialises reads and writes (``TcpLink`` holds its write lock).
    """

    def __init__(
        self,
        sock: socket.socket,
        ctx: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        self.raw = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(
            self._in, self._out, server_side=server_side, server_hostname=server_hostname
        )
        self._rbuf = bytearray(_RECV_CHUNK)
        self._rview = memoryview(self._rbuf)
        self._unsent = memoryview(b"")
        self._eof = False
        self.family = sock.family

    # -------------------------------------------------------- socket-like

    def fileno(self) -> int:
        return self.raw.fileno()

    def setblocking(self, flag: bool) -> None:
        self.raw.setblocking(flag)

    def setsockopt(self, *args: Any) -> None:
        self.raw.setsockopt(*args)

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()

    def version(self) -> str | None:
        return self.obj.version()

    def pending(self) -> int:
        """Bytes decrypted or received but not read yet (they wake no poll)."""
        return self.obj.pending() + self._in.pending

    def out_pending(self) -> int:
        """Ciphertext the socket has not taken yet."""
        return self._unsent.nbytes + self._out.pending

    # --------------------------------------------------------------- I/O

    def _fill(self) -> bool:
        """Move ciphertext from the socket into TLS; False at EOF.

        Raises:
            BlockingIOError: nothing to read now.
        """
        if self._eof:
            return False
        n = self.raw.recv_into(self._rview)
        if n == 0:
            self._eof = True
            self._in.write_eof()
            return False
        self._in.write(self._rview[:n])
        return True

    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        """Read decrypted bytes into ``buf``; 0 when the peer closed.

        Raises:
            BlockingIOError: nothing can be read now.
            ssl.SSLError: TLS failed.
        """
        want = nbytes or len(buf)
        while True:
            try:
                return int(self.obj.read(want, buf))
            except ssl.SSLWantReadError:
                if not self._fill():
                    return 0
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    def flush(self) -> None:
        """Send the ciphertext already made.

        Raises:
            BlockingIOError: the socket is full; the rest waits.
        """
        while True:
            if not self._unsent:
                if not self._out.pending:
                    return
                self._unsent = memoryview(self._out.read())
            n = self.raw.send(self._unsent)
            self._unsent = self._unsent[n:]

    def send(self, data: Any) -> int:
        """Encrypt up to 256 KiB of ``data`` and send it; the plaintext bytes taken.

        Raises:
            BlockingIOError: earlier ciphertext still fills the socket.
            ssl.SSLError: TLS failed.
        """
        self.flush()
        view = memoryview(data).cast("B")[:_SEND_CHUNK]
        n = int(self.obj.write(view))
        try:
            self.flush()
        except BlockingIOError:
            pass  # kept for the next send or flush
        return n

    def send_queued(self, unsent: deque[memoryview]) -> None:
        """Send the buffers of ``unsent`` (one :meth:`send` each: TLS has no
        ``sendmsg``), dropping what went out, then the ciphertext still held.

        Raises:
            BlockingIOError: the socket is full; the rest stays in ``unsent``.
            OSError: the connection or TLS failed.
        """
        try:
            while unsent:
                first = unsent[0]
                n = self.send(first)
                if n >= first.nbytes:
                    unsent.popleft()
                else:
                    unsent[0] = first[n:]
            self.flush()
        except ssl.SSLError as e:
            raise OSError(f"TLS: {e}") from e

    # ---------------------------------------------------------- handshake

    def handshake_step(self) -> str | None:
        """Advance the handshake: ``None`` when done, else ``"read"`` or
        ``"write"``, what to wait for before calling again.

        Raises:
            ssl.SSLError: the handshake failed.
            ConnectionResetError: the peer closed during it.
        """
        try:
            self.obj.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        try:
            self.flush()
        except BlockingIOError:
            return "write"
        if done:
            return None
        try:
            if not self._fill():
                raise ConnectionResetError("connection closed during the TLS handshake")
        except BlockingIOError:
            return "read"
        return self.handshake_step()


async def handshake(loop: asyncio.AbstractEventLoop, stream: TlsStream) -> None:
    """Run a TLS handshake on ``stream`` to completion (the caller bounds it).

    Raises:
        ssl.SSLError: the handshake failed (certificate, protocol).
        OSError: the connection failed.
    """
    while (step := stream.handshake_step()) is not None:
        await _ready(loop, stream.fileno(), step == "write")


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: Any, n: int) -> bytes:
    """Receive exactly ``n`` bytes from a non-blocking socket or :class:`TlsStream`.

    Raises:
        ConnectionResetError: the peer closed the connection first.
        OSError: the connection failed.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            await _ready(loop, sock.fileno(), False)
            continue
        if k == 0:
            raise ConnectionResetError("connection closed during the handshake")
        got += k
    return bytes(buf)


async def send_all(loop: asyncio.AbstractEventLoop, sock: Any, data: bytes) -> None:
    """Send all of ``data`` on a non-blocking socket or :class:`TlsStream`.

    Raises:
        OSError: the connection failed.
    """
    view = memoryview(data)
    while True:
        try:
            if view:
                view = view[sock.send(view) :]
            elif isinstance(sock, TlsStream) and sock.out_pending():
                sock.flush()
            else:
                return
        except (BlockingIOError, InterruptedError):
            await _ready(loop, sock.fileno(), True)
