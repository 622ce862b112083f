"""Point-to-point mailbox: one-way messages matched by (source rank, key).

A receive posted before its message arrives may supply the destination
buffer; the transport then writes the chunks straight into it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from .._errors import CollectiveError, ProtocolError
from .._transport import Link
from .._transport._frames import P2P, InMessage, OutMessage

__all__ = ["Mailbox", "Message", "send_one_way"]

#: A received point-to-point message (``.method`` is its key, ``.header`` and
#: ``.buffers`` what was sent).
Message = InMessage


@dataclass(eq=False)
class _Posted:
    fut: asyncio.Future[InMessage]
    out: memoryview | None


class Mailbox:
    """Messages that arrived unasked and receives that wait for a message."""

    def __init__(self) -> None:
        self._arrived: dict[tuple[int, str], deque[InMessage]] = {}
        self._posted: dict[tuple[int, str], deque[_Posted]] = {}
        self._inbound: dict[tuple[int, str], deque[_Posted]] = {}

    def statistics(self) -> dict[str, int]:
        return {
            "p2p_unclaimed": sum(len(q) for q in self._arrived.values()),
            "p2p_posted": sum(len(q) for q in self._posted.values()),
        }

    def post(self, src: int, key: str, out: memoryview | None) -> asyncio.Future[InMessage]:
        """Wait for the next message ``key`` from ``src`` (into ``out`` if given)."""
        fut: asyncio.Future[InMessage] = asyncio.get_running_loop().create_future()
        q = self._arrived.get((src, key))
        if q:
            msg = q.popleft()
            if not q:
                del self._arrived[(src, key)]
            if out is not None:
                _copy_into(msg, out)
            fut.set_result(msg)
            return fut
        self._posted.setdefault((src, key), deque()).append(_Posted(fut, out))
        return fut

    def alloc(self, src: int, key: str, total: int) -> memoryview | None:
        """The posted destination for an arriving message, if one was supplied."""
        q = self._posted.get((src, key))
        while q and q[0].fut.done():  # cancelled receive
            q.popleft()
        if not q or q[0].out is None or q[0].out.nbytes != total:
            return None
        p = q.popleft()
        if not q:
            del self._posted[(src, key)]
        self._inbound.setdefault((src, key), deque()).append(p)
        return p.out

    def deliver(self, src: int, msg: InMessage) -> None:
        key = (src, msg.method)
        inbound = self._inbound.get(key)
        if inbound:
            p = inbound.popleft()
            if not inbound:
                del self._inbound[key]
            if not p.fut.done():
                p.fut.set_result(msg)
            return
        q = self._posted.get(key)
        while q:
            p = q.popleft()
            if not q:
                del self._posted[key]
            if p.fut.done():
                q = self._posted.get(key)
                continue
            if p.out is not None:
                try:
                    _copy_into(msg, p.out)
                except CollectiveError as e:
                    p.fut.set_exception(e)
                    return
            p.fut.set_result(msg)
            return
        self._arrived.setdefault(key, deque()).append(msg)

    def fail_all(self, src: int | None, exc: BaseException) -> None:
        """Fail posted receives from ``src`` (every source when ``None``)."""
        for table in (self._posted, self._inbound):
            for key in [k for k in table if src is None or k[0] == src]:
                for p in table.pop(key):
                    if not p.fut.done():
                        p.fut.set_exception(exc)

    def discard(self, prefix: str) -> int:
        """Drop unclaimed messages and cancel posted receives whose key starts with ``prefix``.

        Used when a collective fails half-way, so its leftovers do not linger.
        Returns how many were dropped.
        """
        n = 0
        for key in [k for k in self._arrived if k[1].startswith(prefix)]:
            n += len(self._arrived.pop(key))
        for key in [k for k in self._posted if k[1].startswith(prefix)]:
            for p in self._posted.pop(key):
                n += 1
                if not p.fut.done():
                    p.fut.cancel()
        return n

    def clear(self) -> None:
        self._arrived.clear()


def _copy_into(msg: InMessage, out: memoryview) -> None:
    total = sum(b.nbytes for b in msg.buffers)
    if total != out.nbytes:
        raise CollectiveError(
            f"point-to-point message {msg.method!r} has {total} bytes, receive buffer {out.nbytes}"
        )
    off = 0
    for b in msg.buffers:
        out[off : off + b.nbytes] = b
        off += b.nbytes
    if off != out.nbytes:
        raise ProtocolError("short point-to-point message")


async def send_one_way(
    link: Link, msg_id: int, key: str, buffers: list[memoryview], header: bytes
) -> None:
    """Send one-way message ``key`` on ``link``; return once its bytes are
    copied out (on the loop).

    Raises:
        RpcdistError: the link died before the bytes went out.
    """
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def packed() -> None:
        if not done.done():
            done.set_result(None)

    msg = OutMessage(P2P, key, header, buffers, on_packed=packed)
    msg.id = msg_id
    link.send(msg)
    while not done.done():  # fail the wait if the link dies first
        if link.closed is not None:
            raise link.closed
        await asyncio.wait([done], timeout=0.5)
