"""gRPC (aio) transport: one server per agent, one bidirectional stream per peer.

All objects here live on the agent's event loop. gRPC errors are translated
into rpcdist errors in :func:`translate_rpc_error`, the only place that does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from .._errors import (
    ClosedError,
    ConnectError,
    ProtocolError,
    RpcdistError,
    RpcTimeoutError,
    TransportError,
    WorkerLostError,
)
from .._options import RpcOptions
from ._conn import BaseConnection
from ._frames import pack_batch

__all__ = ["Connection", "Server", "connect", "translate_rpc_error"]

_log = logging.getLogger(__name__)

STREAM_METHOD = "/rpcdist.v1.Worker/Stream"
MD_TOKEN = "rpcdist-token"
MD_RANK = "rpcdist-rank"
MD_NAME = "rpcdist-name"

_COMMON_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    # Large HTTP/2 frames and a wide flow-control window: measured +30-50%
    # throughput for multi-megabyte arrays on loopback (docs/design.md).
    ("grpc.http2.max_frame_size", (16 << 20) - 1),
    ("grpc.http2.lookahead_bytes", 16 << 20),
]
CHANNEL_OPTIONS = [*_COMMON_OPTIONS, ("grpc.keepalive_permit_without_calls", 1)]
SERVER_OPTIONS = [
    *_COMMON_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


def translate_rpc_error(e: BaseException, what: str, *, reached: bool) -> RpcdistError:
    """Map a gRPC (or OS) error on the stream to ``what`` to an rpcdist error."""
    if isinstance(e, RpcdistError):
        return e
    if isinstance(e, grpc.aio.AioRpcError):
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return ConnectError(f"{what} rejected this worker's job token: {details}")
        if code == grpc.StatusCode.UNAVAILABLE:
            if reached:
                return WorkerLostError(f"lost the connection to {what}: {details}")
            return ConnectError(f"could not connect to {what}: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RpcTimeoutError(f"deadline exceeded talking to {what}: {details}")
        if code == grpc.StatusCode.CANCELLED:
            return WorkerLostError(f"the stream to {what} was cancelled: {details}")
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL):
            return ProtocolError(f"{what} reported a protocol error ({code.name}): {details}")
        return TransportError(f"stream to {what} failed ({code.name}): {details}")
    if isinstance(e, asyncio.CancelledError):
        return ClosedError(f"the stream to {what} was closed by this worker")
    return TransportError(f"stream to {what} failed: {type(e).__name__}: {e}")


class Connection(BaseConnection):
    """One end of a peer gRPC stream: a coalescing writer and a reassembling reader."""

    def __init__(
        self,
        *,
        write: Callable[[bytes], Awaitable[None]],
        read: Callable[[], Awaitable[Any]],
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self._write = write
        self._read = read
        self._wake = asyncio.Event()

    def _kick(self) -> None:
        self._wake.set()

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                data = pack_batch(self._queue, self._batch_bytes, self._chunk_bytes)
                self.messages_out += 1
                await self._write(data)

    async def _reader(self) -> None:
        while True:
            data = await self._read()
            if data is grpc.aio.EOF or data is None:
                return
            self.received_any = True
            self.messages_in += 1
            for m in self._reasm.feed(data):
                self._deliver(m)

    async def run(self) -> None:
        """Pump both directions until the peer ends its side or a side fails.

        When the writer fails first, the reader is given a moment to receive
        the stream's final status, which says why (e.g. the token was refused).

        Raises:
            BaseException: whatever stopped the reader, else the writer.
        """
        reader = asyncio.ensure_future(self._reader())
        writer = asyncio.ensure_future(self._writer())
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done() and not reader.done():
                await asyncio.wait({reader}, timeout=1.0)
        finally:
            for t in (reader, writer):
                if not t.done():
                    t.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
        for t in (reader, writer):
            if not t.cancelled() and (exc := t.exception()) is not None:
                raise exc


def _read_file(path: str) -> bytes:
    return Path(path).read_bytes()


class Server:
    """The agent's gRPC server: accepts peer streams after checking the token."""

    def __init__(
        self,
        options: RpcOptions,
        on_stream: Callable[[int, str, Any], Awaitable[None]],
    ) -> None:
        self._options = options
        self._on_stream = on_stream
        self._server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> int:
        """Bind to ``listen_host`` on a port picked by the OS and start serving.

        Raises:
            ConnectError: the address cannot be bound.
        """
        handler = grpc.method_handlers_generic_handler(
            "rpcdist.v1.Worker",
            {"Stream": grpc.stream_stream_rpc_method_handler(self._handle)},
        )
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        host = self._options.listen_host
        addr = f"[{host}]:0" if ":" in host and not host.startswith("[") else f"{host}:0"
        try:
            if self._options.tls:
                creds = grpc.ssl_server_credentials(
                    [
                        (
                            _read_file(self._options.tls_key_file or ""),
                            _read_file(self._options.tls_cert_file or ""),
                        )
                    ],
                    root_certificates=_read_file(self._options.tls_ca_file or ""),
                    require_client_auth=True,
                )
                self.port = server.add_secure_port(addr, creds)
            else:
                self.port = server.add_insecure_port(addr)
        except (RuntimeError, OSError) as e:
            raise ConnectError(f"cannot listen on {addr}: {e}") from e
        if not self.port:
            raise ConnectError(f"cannot listen on {addr}")
        await server.start()
        self._server = server
        return self.port

    async def _handle(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        md = {k: v for k, v in (context.invocation_metadata() or ())}
        expected = self._options.token
        if expected is not None:
            got = md.get(MD_TOKEN, "")
            if not isinstance(got, str) or not hmac.compare_digest(got, expected):
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, "missing or wrong rpcdist job token"
                )
        try:
            rank = int(md.get(MD_RANK, ""))
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "missing rpcdist-rank metadata")
        # Accepted: tell the client before it sends anything (see ``handshake``).
        await context.send_initial_metadata(())
        await self._on_stream(rank, str(md.get(MD_NAME, "")), context)

    async def stop(self, grace: float | None) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace)


def open_channel(options: RpcOptions, address: str) -> grpc.aio.Channel:
    """A channel to a peer's server, TLS when configured."""
    if options.tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read_file(options.tls_ca_file or ""),
            private_key=_read_file(options.tls_key_file or ""),
            certificate_chain=_read_file(options.tls_cert_file or ""),
        )
        return grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def connect(
    channel: grpc.aio.Channel, *, options: RpcOptions, my_rank: int, my_name: str
) -> grpc.aio.StreamStreamCall:
    """Open the long-lived stream on ``channel``, presenting our identity and token."""
    md: list[tuple[str, str]] = [(MD_RANK, str(my_rank)), (MD_NAME, my_name)]
    if options.token is not None:
        md.append((MD_TOKEN, options.token))
    stub = channel.stream_stream(STREAM_METHOD)
    return stub(metadata=tuple(md), wait_for_ready=False)


async def handshake(call: grpc.aio.StreamStreamCall) -> None:
    """Wait until the server accepted the stream (or ended it, e.g. for a bad token).

    Nothing is written before this, so a refusal reaches the reader as the
    server's own status instead of a local write failure.
    """
    await call.initial_metadata()


async def close_call(call: grpc.aio.StreamStreamCall) -> None:
    """Half-close our side of a client stream, ignoring a stream already gone."""
    with contextlib.suppress(Exception):
        await call.done_writing()
