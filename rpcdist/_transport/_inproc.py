"""In-memory transport: agents in one process hand messages to each other.

No sockets and no bytes on a wire: a sent :class:`OutMessage` becomes an
:class:`InMessage` on the peer's loop, with its payload copied once into a
fresh buffer (or a receive the peer posted in advance), so the receiver owns
what it decodes and the sender may reuse its buffers, as on a real link.
The hello is checked as the socket transport checks it (job token, rank and
name), so refusals behave the same. For fast tests of everything above the
transport (``RpcOptions(transport="inproc")``); it cannot cross processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .._errors import ConnectError, WorkerLostError
from .._options import RpcOptions
from ._base import Accept, Hooks, Link, Peer, TransportBase, Validate
from ._frames import InMessage, OutMessage

__all__ = ["InprocLink", "InprocTransport"]

_servers: dict[str, InprocTransport] = {}
_servers_lock = threading.Lock()
_ids = itertools.count(1)


class InprocLink(Link):
    """One end of an in-memory link; :meth:`pair` joins two ends."""

    CALLS_AFTER_READ = True

    def __init__(self, loop: asyncio.AbstractEventLoop, **kw: Any) -> None:
        super().__init__(**kw)
        self._loop = loop
        self._peer: InprocLink | None = None
        self._ended: asyncio.Future[None] = loop.create_future()
        self._flush_scheduled = False
        self._lock = threading.Lock()

    def pair(self, other: InprocLink) -> None:
        self._peer, other._peer = other, self
        if self._queue:
            self._kick()

    def _kick(self) -> None:
        with self._lock:
            if self._flush_scheduled or self._peer is None:
                return
            self._flush_scheduled = True
        self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        with self._lock:  # held while handing over: a thread's try_send_now waits
            self._flush_scheduled = False
            while self._queue and self._peer is not None:
                self._hand_over(self._queue.popleft())

    def _hand_over(self, msg: OutMessage) -> None:
        """Copy ``msg`` for the peer and deliver it on the peer's loop (any thread)."""
        peer = self._peer
        if peer is None or self.closed is not None:
            msg.dropped()
            return
        sizes = [b.nbytes for b in msg.buffers]
        now = time.monotonic()
        timeout_us = 0 if msg.deadline is None else max(1, int((msg.deadline - now) * 1e6))
        try:
            peer._loop.call_soon_threadsafe(
                peer._receive,
                msg.id,
                msg.kind,
                msg.method,
                msg.header,
                [bytes(b) for b in msg.buffers],
                sizes,
                timeout_us,
                dict(msg.meta) if msg.meta else None,
            )
        except RuntimeError:  # the peer's loop is closed: it has gone, as a dead process's socket
            msg.dropped()
            return
        self.messages_out += 1
        if msg.on_packed is not None:
            msg.on_packed()

    def _receive(
        self,
        id_: int,
        kind: int,
        method: str,
        header: bytes,
        parts: list[bytes],
        sizes: list[int],
        timeout_us: int,
        meta: dict[str, Any] | None,
    ) -> None:
        if self._ended.done():
            return
        total = sum(sizes)
        dest = self._reasm._alloc(kind, method, total) if self._reasm._alloc and total else None
        if dest is None or dest.nbytes != total:
            dest = memoryview(bytearray(total))
        bufs, off = [], 0
        for part, n in zip(parts, sizes):
            dest[off : off + n] = part
            bufs.append(dest[off : off + n])
            off += n
        self.received_any = True
        self.messages_in += 1
        self._deliver(InMessage(id_, kind, method, header, bufs, timeout_us, meta=meta))
        if self.after_read is not None:
            self.after_read()

    def try_send_now(self, msg: OutMessage, before: Callable[[], None] | None = None) -> bool:
        with self._lock:
            if self._peer is None or self.closed is not None or self._queue:
                return False
            if before is not None:
                before()
            self._hand_over(msg)
        return True

    def close_write(self) -> None:
        peer = self._peer
        if peer is not None:
            with contextlib.suppress(RuntimeError):  # (its loop is closed: it has gone)
                peer._loop.call_soon_threadsafe(peer._end, None)

    def abort(self, exc: WorkerLostError) -> None:  # type: ignore[override]
        self._end(exc)

    def _end(self, exc: WorkerLostError | None) -> None:
        if self.closed is None:
            self.closed = exc or WorkerLostError(f"{self.label} closed the connection")
        if not self._ended.done():
            self._ended.set_result(None) if exc is None else self._ended.set_exception(exc)
            if exc is not None:
                self._ended.exception()  # retrieved by run()

    async def run(self) -> None:
        try:
            await asyncio.shield(self._ended)
        finally:
            peer, self._peer = self._peer, None
            if peer is not None:  # our end is gone: the other end sees it at once
                try:
                    peer._loop.call_soon_threadsafe(peer._end, None)
                except RuntimeError:  # its loop is closed
                    pass
            for msg in self._queue:
                msg.dropped()
            self._queue.clear()


class InprocTransport(TransportBase):
    """Agents of one process, linked in memory (see the module docstring)."""

    name = "inproc"

    def __init__(
        self, loop: asyncio.AbstractEventLoop, options: RpcOptions, *, rank: int, name: str
    ) -> None:
        super().__init__(loop, options, rank=rank, name=name)
        self._address = ""
        self._tasks: set[asyncio.Future[None]] = set()

    async def serve(self, validate: Validate, accept: Accept) -> dict[str, Any]:
        self._validate, self._accept = validate, accept
        self._address = f"inproc:{next(_ids)}"
        with _servers_lock:
            _servers[self._address] = self
        return {"addr": self._address}

    def link(self, peer: Peer, hooks: Hooks) -> tuple[Link, Awaitable[None]]:
        link = InprocLink(
            self._loop, peer_rank=peer.rank, label=peer.label, hooks=hooks, options=self._options
        )
        return link, self._run(link, peer)

    async def _run(self, link: InprocLink, peer: Peer) -> None:
        with _servers_lock:
            server = _servers.get(str(peer.info["addr"]))
        if server is None:
            raise ConnectError(f"could not connect to {peer.label}: nobody serves it")
        hello = {"rank": self._rank, "name": self._name, "token": self._options.token}
        fut = asyncio.run_coroutine_threadsafe(server._incoming(hello, link), server._loop)
        why = await asyncio.wrap_future(fut)
        if why is not None:
            raise ConnectError(f"{peer.label} refused the connection: {why}")
        await link.run()

    async def _incoming(self, hello: dict[str, Any], remote: InprocLink) -> str | None:
        """On this transport's loop: check a hello, pair a new link with ``remote``."""
        expected = self._options.token
        got = hello["token"]
        if expected is not None and (
            not isinstance(got, str) or not hmac.compare_digest(got.encode(), expected.encode())
        ):
            return "missing or wrong rpcdist job token"
        if self._validate is None or self._accept is None:
            return "not serving"
        why = self._validate(hello["rank"], hello["name"])
        if why is not None:
            return why
        rank, name = hello["rank"], hello["name"]
        made: list[InprocLink] = []

        def make(hooks: Hooks, *, threaded: bool = False, same_host: bool = False) -> Link:
            del threaded, same_host
            link = InprocLink(
                self._loop,
                peer_rank=rank,
                label=f"worker {name!r}",
                hooks=hooks,
                options=self._options,
            )
            made.append(link)
            return link

        task: asyncio.Future[None] = asyncio.ensure_future(self._accept(rank, name, False, make))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_retrieve)
        for _ in range(3):  # accept() makes its link before it first waits
            if made:
                break
            await asyncio.sleep(0)
        if not made:
            return "not accepted"
        link = made[0]
        # Pair on both loops' terms: each end flushes on its own loop.
        link._peer = remote
        remote._loop.call_soon_threadsafe(remote.pair, link)
        return None

    async def stop(self, grace: float) -> None:
        del grace
        with _servers_lock:
            _servers.pop(self._address, None)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _retrieve(task: asyncio.Future[None]) -> None:
    """A served link's end was dealt with by the agent: mark it retrieved."""
    if not task.cancelled():
        task.exception()
