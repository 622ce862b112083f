"""The rendezvous key-value store: a gRPC server on rank 0, a client on every rank.

The agent uses it at init to exchange worker names and addresses, to find
duplicate names and to run barriers; the collectives use it later. Waiting
reads (``get``, ``wait``, ``barrier``) wait on the server, not by polling, and
end at the caller's deadline, which travels with the request as the gRPC
deadline. The service ``rpcdist.v1.Store`` is defined by hand here; its
messages are in ``proto/rpcdist/v1/store.proto``.

Every gRPC error is translated in :meth:`StoreClient._call` (and in
:meth:`StoreClient.connect`); none escapes this module.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from .._deadline import UNSET, Unset, deadline_for, remaining
from .._errors import (
    ClosedError,
    ConfigError,
    ConnectError,
    ProtocolError,
    RpcdistError,
    RpcTimeoutError,
    WorkerLostError,
)
from .._proto import store_pb2 as pb
from ._common import BARRIER_PREFIX as _BARRIER_PREFIX
from ._common import INT64 as _INT64
from ._common import MESSAGE_OPTIONS as _MESSAGE_OPTIONS
from ._common import RANK_METADATA_KEY, TOKEN_METADATA_KEY, GrpcTls
from ._common import SERVICE as _SERVICE

__all__ = ["StoreClient"]

logger = logging.getLogger(__name__)

_CLIENT_OPTIONS = [
    *_MESSAGE_OPTIONS,
    # A waiting get sends no data for a long time: keep pinging so that a
    # server host that vanished without closing the connection is noticed.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect on the same schedule as connect()'s retries.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_RETRY_FIRST_DELAY = 0.05
_RETRY_MAX_DELAY = 1.0
_PING_ATTEMPT_TIMEOUT = 5.0

_M = TypeVar("_M", bound=Message)


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"store keys must be non-empty strings, got {key!r}")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"store key {key!r} is not valid UTF-8") from exc
    return key


def _check_value(value: object, what: str) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ConfigError(f"{what} must be bytes, got {type(value).__name__}")
    return bytes(value)


def _check_count(value: object, what: str, allowed: range) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        raise ConfigError(
            f"{what} must be an integer in [{allowed.start}, {allowed.stop}), got {value!r}"
        )
    return value


class StoreClient:
    """A connection to the store served at ``address`` (``host:port``).

    ``timeout`` bounds :meth:`connect` and every call that does not wait for
    a key (``None`` or ``0``: no limit). Waiting calls take their own
    ``timeout``; ``None`` waits without limit, yet ends with
    :class:`WorkerLostError` as soon as the server goes away.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None,
        timeout: float = 60.0,
        rank: int | None = None,
        tls: GrpcTls | None = None,
    ) -> None:
        self._address = address
        self._tls = tls
        #: The token this client presents (``None``: none).
        self.token = token
        metadata: list[tuple[str, str]] = []
        if token is not None:
            metadata.append((TOKEN_METADATA_KEY, token))
        if rank is not None:  # named in the server's report if it refuses us
            metadata.append((RANK_METADATA_KEY, str(rank)))
        self._metadata = tuple(metadata) or None
        deadline_for(timeout, None)  # validates it
        self._timeout = timeout
        self._channel: Any = None
        self._calls: dict[str, Any] = {}
        self._server_id: str | None = None
        self._connect_lock = asyncio.Lock()
        self._closed = False
        self._pending = 0

    @property
    def address(self) -> str:
        """The store's ``host:port``."""
        return self._address

    @property
    def server_id(self) -> str | None:
        """The id of the server reached by :meth:`connect`, ``None`` before."""
        return self._server_id

    def statistics(self) -> dict[str, int]:
        """``pending``: calls in flight."""
        return {"pending": self._pending}

    async def connect(self, *, timeout: float | Unset | None = UNSET) -> None:
        """Reach the server, retrying with backoff until ``timeout``.

        ``UNSET`` takes the client's timeout; ``None`` or ``0`` retry without
        limit. Idempotent once connected.

        Raises:
            ConnectError: Unreachable within the timeout (naming the last gRPC
                status), or the server rejected the token.
            ClosedError: :meth:`close` was called.
        """
        async with self._connect_lock:
            if self._closed:
                raise ClosedError(f"store client for {self._address} is closed")
            if self._server_id is not None:
                return
            if self._channel is None:
                if self._tls is not None:
                    creds = self._tls.channel_credentials()
                    self._channel = grpc.aio.secure_channel(
                        self._address, creds, options=_CLIENT_OPTIONS
                    )
                else:
                    self._channel = grpc.aio.insecure_channel(
                        self._address, options=_CLIENT_OPTIONS
                    )
            limit = self._timeout if timeout is UNSET else timeout
            deadline = deadline_for(limit, None)
            delay = _RETRY_FIRST_DELAY
            last: grpc.aio.AioRpcError | None = None
            while True:
                try:
                    reply = await self._ping(deadline)
                except grpc.aio.AioRpcError as exc:
                    # An attempt cut short by the deadline says less than the
                    # failure before it ("Connection refused", ...): keep that.
                    if last is None or exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                        last = exc
                    left = remaining(deadline)
                    if exc.code() not in _RETRYABLE or (left is not None and left <= 0):
                        raise self._connect_error(last, limit) from last
                    logger.debug("store %s not reachable yet: %s", self._address, exc.code())
                    await asyncio.sleep(delay if left is None else min(delay, left))
                    delay = min(2 * delay, _RETRY_MAX_DELAY)
                else:
                    self._server_id = reply.server_id
                    return

    async def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, waking every caller waiting for it.

        Raises:
            ConfigError: ``key`` is not a non-empty string or ``value`` not bytes.
            RpcTimeoutError, WorkerLostError, ConnectError, ClosedError.
        """
        request = pb.SetRequest(key=_check_key(key), value=_check_value(value, "value"))
        await self._call("Set", request, pb.SetResponse, self._deadline(), f"set({key!r})")

    async def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting on the server until it is set.

        Raises:
            RpcTimeoutError: ``key`` was not set within ``timeout`` seconds.
            WorkerLostError: The server went away meanwhile.
            ConnectError, ClosedError, ConfigError.
        """
        return await self._get(_check_key(key), deadline_for(timeout, None))

    async def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Wait on the server until every key in ``keys`` is set.

        Raises:
            RpcTimeoutError: Some key was not set within ``timeout`` seconds.
            WorkerLostError, ConnectError, ClosedError, ConfigError.
        """
        request = pb.WaitRequest(keys=[_check_key(key) for key in keys])
        if request.keys:
            deadline = deadline_for(timeout, None)
            await self._call("Wait", request, pb.WaitResponse, deadline, f"wait({keys!r})")

    async def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (absent: 0); the new value.

        Raises:
            ConfigError: ``key`` holds something other than a counter, or int64
                would overflow.
            RpcTimeoutError, WorkerLostError, ConnectError, ClosedError.
        """
        return await self._add(
            _check_key(key), _check_count(amount, "amount", _INT64), self._deadline()
        )

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Atomically store ``desired`` if ``key`` holds ``expected``; the value now stored.

        ``expected == b""`` matches an absent key (and an empty value). When
        nothing matches the current value is returned (``b""`` when absent).

        Raises:
            ConfigError, RpcTimeoutError, WorkerLostError, ConnectError, ClosedError.
        """
        request = pb.CompareSetRequest(
            key=_check_key(key),
            expected=_check_value(expected, "expected"),
            desired=_check_value(desired, "desired"),
        )
        reply = await self._call(
            "CompareSet", request, pb.CompareSetResponse, self._deadline(), f"compare_set({key!r})"
        )
        return reply.value

    async def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed. Waiters for it keep waiting.

        Raises:
            ConfigError, RpcTimeoutError, WorkerLostError, ConnectError, ClosedError.
        """
        request = pb.DeleteRequest(key=_check_key(key))
        reply = await self._call(
            "Delete", request, pb.DeleteResponse, self._deadline(), f"delete({key!r})"
        )
        return reply.deleted

    async def barrier(self, name: str, world_size: int, timeout: float | None = None) -> None:
        """Wait until ``world_size`` callers reached the barrier ``name``.

        Each use needs a fresh ``name``; the keys stay in the store.

        Raises:
            RpcTimeoutError: Not everyone arrived within ``timeout`` seconds
                (the message says how many did).
            ConfigError: More than ``world_size`` callers used ``name``.
            WorkerLostError, ConnectError, ClosedError.
        """
        _check_count(world_size, "world_size", range(1, 2**63))
        prefix = _BARRIER_PREFIX + _check_key(name)
        deadline = deadline_for(timeout, None)
        try:
            arrived = await self._add(f"{prefix}/arrived", 1, deadline)
            if arrived > world_size:
                raise ConfigError(
                    f"barrier {name!r} on the store at {self._address} was entered "
                    f"{arrived} times for world_size {world_size}; barrier names are single-use"
                )
            if arrived == world_size:
                await self._call(
                    "Set",
                    pb.SetRequest(key=f"{prefix}/done", value=b"1"),
                    pb.SetResponse,
                    deadline,
                    f"barrier({name!r})",
                )
            await self._get(f"{prefix}/done", deadline)
        except RpcTimeoutError as exc:
            try:
                seen = f"{await self._add(f'{prefix}/arrived', 0, self._deadline())}"
            except RpcdistError:
                seen = "an unknown number"
            raise RpcTimeoutError(
                f"barrier {name!r} on the store at {self._address} timed out after "
                f"{timeout}s: {seen} of {world_size} callers arrived"
            ) from exc

    async def close(self) -> None:
        """Close the connection; calls in flight end with :class:`ClosedError`."""
        if self._closed:
            return
        self._closed = True
        if self._channel is not None:
            await self._channel.close(None)

    # -- internals -----------------------------------------------------------

    def _deadline(self) -> float | None:
        return deadline_for(self._timeout, None)

    async def _ping(self, deadline: float | None) -> pb.PingResponse:
        """One connection attempt; gRPC status errors are left to :meth:`connect`."""
        left = remaining(deadline)
        attempt = _PING_ATTEMPT_TIMEOUT if left is None else min(left, _PING_ATTEMPT_TIMEOUT)
        try:
            return await self._invoke("Ping", pb.PingRequest(), pb.PingResponse, attempt)
        except grpc.aio.AioRpcError:
            raise
        except BaseException as exc:
            if (error := self._translate_other(exc, "connect")) is None:
                raise
            raise error from exc

    def _connect_error(self, exc: grpc.aio.AioRpcError, limit: float | None) -> RpcdistError:
        code = exc.code()
        if code is grpc.StatusCode.UNAUTHENTICATED:
            return self._translate(exc, "connect", limit)
        if self._closed:
            return ClosedError(f"connect to the store at {self._address}: the client was closed")
        if code in _RETRYABLE:
            details = str(exc.details())
            hint = ""
            if "Tls" in details or "SSL" in details or "ssl" in details:
                hint = (
                    "; TLS failed: every rank needs a certificate from the same CA "
                    "(RpcOptions.tls_cert_file, tls_key_file, tls_ca_file)"
                )
            elif self._tls is None and "Socket closed" in details:
                hint = (
                    "; if the job uses TLS certificates, this rank must have them too "
                    "(the store then speaks only TLS)"
                )
            return ConnectError(
                f"could not reach the store at {self._address} within {limit}s; "
                f"last gRPC status {code.name}: {details}{hint}"
            )
        return ConnectError(
            f"the server at {self._address} answered {code.name} ({exc.details()}); "
            "is it an rpcdist store?"
        )

    async def _get(self, key: str, deadline: float | None) -> bytes:
        reply = await self._call(
            "Get", pb.GetRequest(key=key), pb.GetResponse, deadline, f"get({key!r})"
        )
        return reply.value

    async def _add(self, key: str, amount: int, deadline: float | None) -> int:
        request = pb.AddRequest(key=key, amount=amount)
        reply = await self._call("Add", request, pb.AddResponse, deadline, f"add({key!r})")
        return reply.value

    async def _invoke(
        self, method: str, request: Any, response: type[_M], timeout: float | None
    ) -> _M:
        call = self._calls.get(method)
        if call is None:
            call = self._calls[method] = self._channel.unary_unary(
                f"/{_SERVICE}/{method}",
                request_serializer=type(request).SerializeToString,
                response_deserializer=response.FromString,
            )
        reply: _M = await call(request, timeout=timeout, metadata=self._metadata)
        return reply

    async def _call(
        self, method: str, request: Any, response: type[_M], deadline: float | None, what: str
    ) -> _M:
        if self._server_id is None:
            await self.connect()
        timeout = remaining(deadline)
        self._pending += 1
        try:
            return await self._invoke(method, request, response, timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc, what, timeout) from exc
        except BaseException as exc:
            if (error := self._translate_other(exc, what)) is None:
                raise
            raise error from exc
        finally:
            self._pending -= 1

    def _translate(
        self, exc: grpc.aio.AioRpcError, what: str, timeout: float | None
    ) -> RpcdistError:
        code = exc.code()
        where = f"{what} on the store at {self._address}"
        if code is grpc.StatusCode.UNAUTHENTICATED:
            return ConnectError(
                f"{where}: the store rejected this process's token ({TOKEN_METADATA_KEY!r}): "
                f"{exc.details()}"
            )
        if self._closed and code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
            return ClosedError(f"{where}: the client was closed")
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            seconds = "its deadline" if timeout is None else f"{timeout:.3g}s"
            return RpcTimeoutError(f"{where} timed out after {seconds}")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return WorkerLostError(f"{where}: the store went away ({code.name}: {exc.details()})")
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            return ConfigError(f"{where}: {exc.details()}")
        return ProtocolError(f"{where} failed with {code.name}: {exc.details()}")

    def _translate_other(self, exc: BaseException, what: str) -> RpcdistError | None:
        """Translate a gRPC failure without a status; ``None``: re-raise ``exc``."""
        where = f"{what} on the store at {self._address}"
        if isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            # close() cancels calls in flight; a cancellation of our own task wins.
            if self._closed and (task is None or task.cancelling() == 0):
                return ClosedError(f"{where}: the client was closed")
            return None
        if isinstance(exc, grpc.aio.UsageError) and self._closed:
            return ClosedError(f"{where}: the client was closed")
        if isinstance(exc, grpc.aio.BaseError | grpc.RpcError):
            return ProtocolError(f"{where} failed inside gRPC: {exc!r}")
        return None
