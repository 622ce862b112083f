"""A launcher's side of the rendezvous: its store connection, heartbeats and mailbox.

Every launcher, node 0's included, registers in the launchers' store, bumps
its heartbeat counter every ``interval`` and reads the coordinator's
messages from its mailbox (see ``_records``). A single-node job uses the
same protocol over :class:`MemoryStore`, with no sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from .._errors import ConnectError, RpcTimeoutError, WorkerLostError
from . import _records as rec

__all__ = ["MemoryStore", "NodeSession", "Store"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_STORE_DOWN = (WorkerLostError, ConnectError, RpcTimeoutError)


class Store(Protocol):
    """The store operations the launcher uses (``StoreClient`` has them)."""

    async def set(self, key: str, value: bytes) -> None: ...
    async def get(self, key: str, timeout: float | None = None) -> bytes: ...
    async def wait(self, keys: list[str], timeout: float | None = None) -> None: ...
    async def add(self, key: str, amount: int) -> int: ...
    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...


class MemoryStore:
    """An in-process :class:`Store` (single-node jobs): same semantics, no server."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = asyncio.Condition()

    async def set(self, key: str, value: bytes) -> None:
        async with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    async def get(self, key: str, timeout: float | None = None) -> bytes:
        await self.wait([key], timeout)
        return self._data[key]

    async def wait(self, keys: list[str], timeout: float | None = None) -> None:
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(lambda: all(k in self._data for k in keys))
        except TimeoutError:
            raise RpcTimeoutError(f"wait({keys!r}) on the in-memory store timed out") from None

    async def add(self, key: str, amount: int) -> int:
        async with self._changed:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        async with self._changed:
            current = self._data.get(key, b"")
            if current == expected:
                self._data[key] = current = desired
                self._changed.notify_all()
            return current


async def peek(store: Store, key: str) -> bytes:
    """The value of ``key`` now, ``b""`` when it is not set; never waits for it."""
    return await store.compare_set(key, rec.PEEK, rec.PEEK)


class NodeSession:
    """This launcher's registration in the job: heartbeats, mailbox, round reports.

    Store calls that fail because the store is unreachable are retried until
    no heartbeat got through for ``node_timeout`` seconds; then every call
    (and :attr:`lost`) raises :class:`WorkerLostError`.
    """

    def __init__(self, store: Store, where: str, *, interval: float, node_timeout: float) -> None:
        self.store = store
        self.where = where  # for messages: "the rendezvous store at host:port"
        self.interval = interval
        self.node_timeout = node_timeout
        self.seq = 0
        self._inbox = 0
        loop = asyncio.get_running_loop()
        self._last_ok = loop.time()
        self.lost: asyncio.Future[None] = loop.create_future()
        self._beating: asyncio.Task[None] | None = None

    async def read_job(self, timeout: float) -> rec.Job:
        """The job record node 0 wrote (waits up to ``timeout`` s for it)."""
        job: rec.Job = rec.decode(rec.Job, await self.store.get(rec.JOB, timeout), rec.JOB)
        return job

    async def register(self, node_rank: int | None) -> int:
        """Take a sequence number, describe this launcher and start heartbeats."""
        self.seq = await self.store.add(rec.SEQ, 1)
        info = rec.NodeInfo(node_rank=node_rank, hostname=socket.gethostname(), pid=os.getpid())
        await self.store.set(rec.node_key(self.seq), rec.encode(info))
        await self.store.add(rec.heartbeat_key(self.seq), 1)
        self._beating = asyncio.create_task(self._beat(), name="rpcdist-launch-heartbeat")
        return self.seq

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.store.add(rec.heartbeat_key(self.seq), 1)
            except _STORE_DOWN as exc:
                silent = loop.time() - self._last_ok
                logger.debug("heartbeat to %s failed (%.1f s silent): %s", self.where, silent, exc)
                if silent > self.node_timeout:
                    self.lost.set_exception(self._lost_error(silent, exc))
                    return
            else:
                self._last_ok = loop.time()

    def _lost_error(self, silent: float, exc: BaseException) -> WorkerLostError:
        return WorkerLostError(
            f"no answer from {self.where} for {silent:.1f} s "
            f"(--node-timeout {self.node_timeout}); last error: {exc}"
        )

    async def call(self, make: Callable[[], Awaitable[_T]]) -> _T:
        """``await make()``, retried while the store is unreachable but not yet lost.

        Raises:
            WorkerLostError: the store is lost (see the class docstring).
        """
        while True:
            if self.lost.done():
                self.lost.result()
            try:
                return await make()
            except _STORE_DOWN as exc:
                if self.lost.done():
                    self.lost.result()
                silent = asyncio.get_running_loop().time() - self._last_ok
                if silent > self.node_timeout:  # the same verdict as the heartbeat's
                    raise self._lost_error(silent, exc) from exc
            await asyncio.sleep(self.interval)

    async def next_message(self) -> rec.Message:
        """The coordinator's next message to this launcher (waits for it)."""
        key = rec.inbox_key(self.seq, self._inbox)
        raw = await self.call(lambda: self.store.get(key))
        self._inbox += 1
        message: rec.Message = rec.decode(rec.Message, raw, key)
        return message

    async def round(self, number: int) -> rec.Round:
        """The record of round ``number``."""
        key = rec.round_key(number)
        found: rec.Round = rec.decode(rec.Round, await self.call(lambda: self.store.get(key)), key)
        return found

    async def wait_end(self, number: int) -> rec.End:
        """Wait until round ``number`` ends; why it did."""
        key = rec.end_key(number)
        end: rec.End = rec.decode(rec.End, await self.call(lambda: self.store.get(key)), key)
        return end

    async def end_round(self, number: int, end: rec.End) -> None:
        """End round ``number`` for ``end``'s reason unless it has ended already."""
        encoded = rec.encode(end)
        await self.call(lambda: self.store.compare_set(rec.end_key(number), b"", encoded))

    async def mark(self, key: str) -> None:
        """Set the flag ``key`` (done, stopped, bye, left)."""
        await self.call(lambda: self.store.set(key, b"1"))

    def fail_with(self, task: asyncio.Task[object]) -> None:
        """Done-callback of the coordinator task: its failure ends this session too."""
        if not task.cancelled() and task.exception() is not None and not self.lost.done():
            self.lost.set_exception(task.exception())  # type: ignore[arg-type]

    async def close(self) -> None:
        """Stop the heartbeats."""
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
        if not self.lost.done():
            self.lost.cancel()
        elif not self.lost.cancelled():
            self.lost.exception()  # retrieved: no "never retrieved" warning
