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
from ._base import Accept, Hooks, Link, Peer, TransportBase, Validate, segment_writer
from ._frames import pack_batch
from ._grpc_tls import GrpcTls

__all__ = ["GrpcLink", "GrpcTransport", "translate_rpc_error"]

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
    # Large HTTP/2 frames and a wide flow-control window: more throughput for
    # multi-megabyte arrays (docs/design.md).
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
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return ConnectError(f"{what} refused the connection: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RpcTimeoutError(f"deadline exceeded talking to {what}: {details}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ProtocolError(f"{what} reported a protocol error ({code.name}): {details}")
        if reached or code == grpc.StatusCode.CANCELLED:
            # The stream was up: its end means the peer went away ("Stream
            # removed" when its process was killed), as on sockets.
            return WorkerLostError(
                f"lost the connection to {what} ({code.name}: {details}); its process "
                "exited, was killed or shut down"
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            return ConnectError(f"could not connect to {what}: {details}")
        if code == grpc.StatusCode.INTERNAL:
            return ProtocolError(f"{what} reported a protocol error ({code.name}): {details}")
        return TransportError(f"stream to {what} failed ({code.name}): {details}")
    if isinstance(e, asyncio.CancelledError):
        return ClosedError(f"the stream to {what} was closed by this worker")
    return TransportError(f"stream to {what} failed: {type(e).__name__}: {e}")


class GrpcLink(Link):
    """One end of a peer gRPC stream: a coalescing writer and a reassembling reader."""

    def __init__(
        self,
        *,
        write: Callable[[bytes], Awaitable[None]],
        read: Callable[[], Awaitable[Any]],
        done_writing: Callable[[], Awaitable[None]] | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self._write = write
        self._read = read
        self._done_writing = done_writing
        self._wake = asyncio.Event()
        self._closing = False
        self._aborted: asyncio.Future[None] | None = None

    def _kick(self) -> None:
        self._wake.set()

    def abort(self, exc: RpcdistError) -> None:
        """End the link now with ``exc`` (on the loop)."""
        if self.closed is None:
            self.closed = exc
        for msg in self._queue:
            msg.dropped()
        self._queue.clear()
        if self._aborted is None:
            self._aborted = asyncio.get_running_loop().create_future()
        if not self._aborted.done():
            self._aborted.set_exception(exc)
            self._aborted.exception()  # retrieved by run()

    def close_write(self) -> None:
        """Half-close the client side once the queue is out (servers end with the call)."""
        self._closing = True
        self._wake.set()

    async def aclose_write(self) -> None:
        self._closing = True
        if self._done_writing is not None:
            with contextlib.suppress(Exception):  # the stream is already gone
                await self._done_writing()

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                data = pack_batch(self._queue, self._batch_bytes, self._chunk_bytes)
                self.messages_out += 1
                await self._write(data)
            if self._closing:
                if self._done_writing is not None:
                    with contextlib.suppress(Exception):  # the stream is already gone
                        await self._done_writing()
                await asyncio.Event().wait()  # the reader ends the link

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
        if self._aborted is None:
            self._aborted = asyncio.get_running_loop().create_future()
        aborted = self._aborted
        try:
            await asyncio.wait({reader, writer, aborted}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done() and not reader.done() and not aborted.done():
                await asyncio.wait({reader}, timeout=1.0)
        finally:
            for t in (reader, writer):
                if not t.done():
                    t.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
        if aborted.done():
            raise aborted.exception()  # type: ignore[misc]
        for t in (reader, writer):
            if not t.cancelled() and (exc := t.exception()) is not None:
                raise exc


class GrpcTransport(TransportBase):
    """gRPC streams: one server per agent, one bidirectional stream per peer;
    TLS (mutual) when the options name certificates."""

    name = "grpc"

    def __init__(
        self, loop: asyncio.AbstractEventLoop, options: RpcOptions, *, rank: int, name: str
    ) -> None:
        super().__init__(loop, options, rank=rank, name=name)
        self.segments = segment_writer(options)
        self._server: grpc.aio.Server | None = None
        self._tls = GrpcTls.of(options)  # read once, for the server and every channel

    async def serve(self, validate: Validate, accept: Accept) -> dict[str, Any]:
        """Bind to ``listen_host`` on a port picked by the OS and start serving.

        Raises:
            ConnectError: the address cannot be bound.
        """
        self._validate, self._accept = validate, accept
        handler = grpc.method_handlers_generic_handler(
            "rpcdist.v1.Worker",
            {"Stream": grpc.stream_stream_rpc_method_handler(self._handle)},
        )
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        opts = self._options
        host = opts.listen_host
        addr = f"[{host}]:0" if ":" in host and not host.startswith("[") else f"{host}:0"
        try:
            if self._tls is not None:
                port = server.add_secure_port(addr, self._tls.server_credentials())
            else:
                port = server.add_insecure_port(addr)
        except (RuntimeError, OSError) as e:
            raise ConnectError(f"cannot listen on {addr}: {e}") from e
        if not port:
            raise ConnectError(f"cannot listen on {addr}")
        await server.start()
        self._server = server
        peer_host = opts.peer_host()
        return {"addr": f"[{peer_host}]:{port}" if ":" in peer_host else f"{peer_host}:{port}"}

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
        name = str(md.get(MD_NAME, ""))
        assert self._validate is not None and self._accept is not None
        why = self._validate(rank, name)
        if why is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        # Accepted: tell the client before it sends anything (see ``_run``).
        await context.send_initial_metadata(())

        def make(hooks: Hooks, *, threaded: bool = False, same_host: bool = False) -> Link:
            del threaded  # gRPC streams are always driven by the loop
            return GrpcLink(
                write=context.write,
                read=context.read,
                peer_rank=rank,
                label=f"worker {name!r}",
                hooks=hooks,
                options=self._options,
                segments=self.segments if same_host else None,
            )

        try:
            await self._accept(rank, name, False, make)
        except ProtocolError as e:
            _log.warning("closing stream from worker %r: %s", name, e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (grpc.aio.AioRpcError, ConnectionError, RpcdistError):
            pass

    def link(self, peer: Peer, hooks: Hooks) -> tuple[Link, Awaitable[None]]:
        channel = _open_channel(self._tls, str(peer.info["addr"]))
        md: list[tuple[str, str]] = [(MD_RANK, str(self._rank)), (MD_NAME, self._name)]
        if self._options.token is not None:
            md.append((MD_TOKEN, self._options.token))
        call = channel.stream_stream(STREAM_METHOD)(metadata=tuple(md), wait_for_ready=False)
        link = GrpcLink(
            write=call.write,
            read=call.read,
            done_writing=call.done_writing,
            peer_rank=peer.rank,
            label=peer.label,
            hooks=hooks,
            options=self._options,
            segments=self.segments if peer.same_host else None,
        )
        return link, self._run(link, call, channel, peer.label)

    async def _run(self, link: GrpcLink, call: Any, channel: grpc.aio.Channel, label: str) -> None:
        accepted = False
        try:
            try:
                # Nothing is written before the server accepted the stream, so a
                # refusal reaches us as the server's own status.
                await call.initial_metadata()
                accepted = True
                await link.run()
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                # Once the peer accepted the stream, its end is a lost worker
                # (e.g. "Stream removed" when it was killed), as on sockets.
                raise translate_rpc_error(e, label, reached=accepted or link.received_any) from e
        finally:
            try:
                await channel.close()
            except Exception as e:  # closing a broken channel: nothing left to do
                _log.debug("closing the channel to %s: %s", label, e)

    async def stop(self, grace: float) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace)
        if self.segments is not None:
            await self.segments.aclean()


def _open_channel(tls: GrpcTls | None, address: str) -> grpc.aio.Channel:
    """A channel to a peer's server, TLS when configured."""
    if tls is not None:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
