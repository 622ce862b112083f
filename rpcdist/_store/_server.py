"""The rendezvous store's server, run by rank 0 (gRPC service ``rpcdist.v1.Store``).

Waiting reads (``get``, ``wait``, barriers) wait on the server, not by
polling; every request must carry the job token when one is set, and none
may carry one when none is set (a rank started with a token while rank 0
has none is as misconfigured as one with a wrong token). The token is the
user's (``RPCDIST_TOKEN``) or, for a job without one, the secret rank 0 keeps
in a per-user file (:mod:`._secret_file`); the store never hands it out.

A refused caller is told so at once, and nothing else happens: the ranks that
were let in keep waiting, so a stray call to the port cannot abort a starting
job. Refusals are counted with the callers' addresses; :data:`~._common.REFUSED_KEY`
reads as a summary of them (empty when there were none), which a rank whose
rendezvous timed out adds to its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import grpc
import grpc.aio

from .._errors import (
    ClosedError,
    ConnectError,
)
from .._proto import store_pb2 as pb
from ._common import INT64 as _INT64
from ._common import MESSAGE_OPTIONS as _MESSAGE_OPTIONS
from ._common import (
    RANK_METADATA_KEY,
    REFUSED_KEY,
    SECRET_FILE_REFUSAL,
    TOKEN_METADATA_KEY,
    GrpcTls,
    format_address,
)
from ._common import SERVICE as _SERVICE

__all__ = ["FileStoreServer", "StoreServer"]

logger = logging.getLogger(__name__)

_SERVER_OPTIONS = [
    *_MESSAGE_OPTIONS,
    ("grpc.so_reuseport", 0),
    # Accept the clients' keepalive pings during long waits; ping idle clients
    # so that the waiters of a vanished client are dropped.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
#: Refused callers named in :meth:`StoreServer.refusals`, kept, and logged.
_REFUSALS_SHOWN = 5
_REFUSALS_KEPT = 100
_REFUSALS_LOGGED = 10


def _bind_failure_reason(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound, found by binding a plain socket there."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"cannot resolve {host!r}: {exc}"
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(sockaddr)
        except OSError as exc:
            return exc.strerror or str(exc)
    return "gRPC could not listen there"


async def _abort(context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("grpc.aio context.abort() returned")  # pragma: no cover


class StoreServer:
    """Serves the key-value store; rank 0 runs one.

    All methods run on the event loop that called :meth:`start`. Operations
    on one server are atomic with respect to each other: a handler never
    awaits between reading and writing the table.
    """

    def __init__(
        self, *, token: str | None, tls: GrpcTls | None = None, secret_file: str | None = None
    ) -> None:
        self._token = None if token is None else token.encode()
        self._tls = tls
        #: Files of this job removed at :meth:`stop` if they still name this
        #: server: the per-user secret file, the ``file://`` rendezvous file.
        self.files: list[str] = []
        #: Set when ``token`` is a secret kept in this per-user file.
        self.secret_file = secret_file
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._server: Any = None
        self._closing = False
        self._changed = asyncio.Event()
        #: How many calls were refused for their token.
        self.refused = 0
        #: The addresses refused calls came from (and the rank each claimed), oldest first.
        self.refused_from: list[str] = []
        #: Random per instance; clients learn it from Ping, rendezvous files record it.
        self.server_id = secrets.token_hex(16)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` and return the bound port (``0``: the OS picks).

        Raises:
            ConnectError: The address cannot be bound (in use, not local, ...).
            ClosedError: The server was stopped or already started.
        """
        if self._server is not None or self._closing:
            raise ClosedError(f"store server {self.server_id} was already started")
        address = format_address(host, port)
        server = grpc.aio.server(options=_SERVER_OPTIONS)
        server.add_generic_rpc_handlers((self._generic_handler(),))
        try:
            if self._tls is not None:
                bound = server.add_secure_port(address, self._tls.server_credentials())
            else:
                bound = server.add_insecure_port(address)
        except RuntimeError as exc:
            reason = _bind_failure_reason(host, port)
            raise ConnectError(f"store server cannot listen on {address}: {reason}") from exc
        if not bound:  # older grpcio reports a bind failure as port 0
            reason = _bind_failure_reason(host, port)
            raise ConnectError(f"store server cannot listen on {address}: {reason}")
        await server.start()
        self._server = server
        logger.debug("store server %s listening on %s", self.server_id, format_address(host, bound))
        return int(bound)

    async def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving; waiting calls end at once with ``UNAVAILABLE``. Idempotent."""
        if self._closing:
            return
        self._closing = True
        for key in list(self._waiters):
            self._wake(key)
        if self._server is not None:
            await self._server.stop(grace)
        for path in self.files:
            if _holds_file(path, self.server_id):
                with contextlib.suppress(OSError):
                    os.remove(path)
        logger.debug("store server %s stopped", self.server_id)

    def statistics(self) -> dict[str, int]:
        """``keys`` stored and ``waiters``: calls blocked until a key is set."""
        return {
            "keys": len(self._data),
            "waiters": sum(len(waiters) for waiters in self._waiters.values()),
        }

    def refusals(self) -> str:
        """How many calls were refused and from where, or ``""`` if none were."""
        if not self.refused:
            return ""
        shown = list(dict.fromkeys(self.refused_from))
        more = f" and {len(shown) - _REFUSALS_SHOWN} more" if len(shown) > _REFUSALS_SHOWN else ""
        return (
            f"{self.refused} call(s) to the rendezvous store were refused for their token, "
            f"from {', '.join(shown[:_REFUSALS_SHOWN])}{more}"
        )

    async def _wait_statistics(self, predicate: Callable[[dict[str, int]], bool]) -> None:
        """Wait until ``predicate(self.statistics())`` holds (a hook for tests)."""
        while not predicate(self.statistics()):
            self._changed.clear()
            await self._changed.wait()

    # -- handlers ------------------------------------------------------------

    def _generic_handler(self) -> Any:
        methods: Mapping[str, tuple[Callable[[Any, Any], Any], Any, Any]] = {
            "Ping": (self._ping, pb.PingRequest, pb.PingResponse),
            "Set": (self._set, pb.SetRequest, pb.SetResponse),
            "Get": (self._get, pb.GetRequest, pb.GetResponse),
            "Wait": (self._wait, pb.WaitRequest, pb.WaitResponse),
            "Add": (self._add, pb.AddRequest, pb.AddResponse),
            "CompareSet": (self._compare_set, pb.CompareSetRequest, pb.CompareSetResponse),
            "Delete": (self._delete, pb.DeleteRequest, pb.DeleteResponse),
        }
        return grpc.method_handlers_generic_handler(
            _SERVICE,
            {
                name: grpc.unary_unary_rpc_method_handler(
                    self._guarded(handler),
                    request_deserializer=request.FromString,
                    response_serializer=response.SerializeToString,
                )
                for name, (handler, request, response) in methods.items()
            },
        )

    def _refusal(self, metadata: dict[str, Any]) -> str | None:
        offered = metadata.get(TOKEN_METADATA_KEY)
        if self._token is None:
            if offered is not None:
                return (
                    f"the caller presented a job token ({TOKEN_METADATA_KEY!r}) but this store "
                    "has none: every rank must use the same RPCDIST_TOKEN (or none)"
                )
            return None
        if not isinstance(offered, str) or not hmac.compare_digest(offered.encode(), self._token):
            what = "no" if offered is None else "a wrong"
            if self.secret_file is not None:
                return (
                    f"the caller presented {what} job token ({TOKEN_METADATA_KEY!r} metadata): "
                    f"{SECRET_FILE_REFUSAL}; its other ranks must run as the same user on "
                    "this host with no RPCDIST_TOKEN either"
                )
            return (
                f"the caller presented {what} job token ({TOKEN_METADATA_KEY!r} metadata): "
                "every rank must use the same RPCDIST_TOKEN"
            )
        return None

    def _refuse(self, metadata: dict[str, Any], peer: str, why: str) -> None:
        rank = metadata.get(RANK_METADATA_KEY)
        named = isinstance(rank, str) and rank.isdigit() and len(rank) <= 9  # (the caller's word)
        claim = f" (claiming rank {rank})" if named else ""
        self.refused += 1
        if len(self.refused_from) < _REFUSALS_KEPT:
            self.refused_from.append(f"{peer}{claim}")
        if self.refused <= _REFUSALS_LOGGED:
            logger.warning("refused a call to the rendezvous store from %s%s: %s", peer, claim, why)
        self._changed.set()

    def _guarded(self, handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        async def guarded(request: Any, context: Any) -> Any:
            metadata = dict(context.invocation_metadata() or ())
            why = self._refusal(metadata)
            if why is not None:
                # Only the caller hears of it: a stranger cannot abort the job.
                why = f"{why} [store {self.server_id}]"
                self._refuse(metadata, str(context.peer()), why)
                await _abort(context, grpc.StatusCode.UNAUTHENTICATED, why)
            if self._closing:
                await _abort(context, grpc.StatusCode.UNAVAILABLE, "store server is shutting down")
            return await handler(request, context)

        return guarded

    def _store(self, key: str, value: bytes) -> None:
        self._data[key] = value
        self._wake(key)

    def _wake(self, key: str) -> None:
        for waiter in self._waiters.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)
        self._changed.set()

    def _has(self, key: str) -> bool:
        return key in self._data or key == REFUSED_KEY

    async def _until_set(self, key: str, context: Any) -> None:
        """Wait until ``key`` is stored; abort the call if the server stops first."""
        while not self._has(key):
            if self._closing:
                await _abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"store server shut down while the caller waited for key {key!r}",
                )
            waiter = asyncio.get_running_loop().create_future()
            waiters = self._waiters.setdefault(key, set())
            waiters.add(waiter)
            self._changed.set()
            try:
                await waiter
            finally:
                waiters.discard(waiter)
                if not waiters and self._waiters.get(key) is waiters:
                    del self._waiters[key]
                self._changed.set()

    async def _ping(self, request: pb.PingRequest, context: Any) -> pb.PingResponse:
        return pb.PingResponse(server_id=self.server_id)

    async def _set(self, request: pb.SetRequest, context: Any) -> pb.SetResponse:
        self._store(request.key, request.value)
        return pb.SetResponse()

    async def _get(self, request: pb.GetRequest, context: Any) -> pb.GetResponse:
        await self._until_set(request.key, context)
        value = self._data.get(request.key)
        return pb.GetResponse(value=self.refusals().encode() if value is None else value)

    async def _wait(self, request: pb.WaitRequest, context: Any) -> pb.WaitResponse:
        while missing := [key for key in request.keys if not self._has(key)]:
            await self._until_set(missing[0], context)
        return pb.WaitResponse()

    async def _add(self, request: pb.AddRequest, context: Any) -> pb.AddResponse:
        current = self._data.get(request.key, b"0")
        try:
            value = int(current.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"key {request.key!r} holds {current[:32]!r}, not an integer counter",
            )
        value += request.amount
        if value not in _INT64:
            await _abort(
                context,
                grpc.StatusCode.OUT_OF_RANGE,
                f"counter {request.key!r} would overflow int64 ({value})",
            )
        self._store(request.key, str(value).encode("ascii"))
        return pb.AddResponse(value=value)

    async def _compare_set(
        self, request: pb.CompareSetRequest, context: Any
    ) -> pb.CompareSetResponse:
        current = self._data.get(request.key, b"")
        if current == request.expected:
            self._store(request.key, request.desired)
            current = request.desired
        return pb.CompareSetResponse(value=current)

    async def _delete(self, request: pb.DeleteRequest, context: Any) -> pb.DeleteResponse:
        deleted = self._data.pop(request.key, None) is not None
        self._changed.set()
        return pb.DeleteResponse(deleted=deleted)


def _holds_file(path: str, server_id: str) -> bool:
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return len(lines) >= 2 and lines[1] == server_id


class FileStoreServer(StoreServer):
    """A store server that removes its rendezvous file (``file://``) when it stops."""

    def __init__(
        self,
        *,
        token: str | None,
        path: str,
        tls: GrpcTls | None = None,
        secret_file: str | None = None,
    ) -> None:
        super().__init__(token=token, tls=tls, secret_file=secret_file)
        self.path = path
        self.files.append(path)  # removed at stop while it names this server
