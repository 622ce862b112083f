"""Fault injection for tests: drop, delay or fail the Nth message of a kind.

:class:`FaultyTransport` wraps any transport; each link it makes consults a
:class:`FaultInjector` for every outgoing message, on every sending path
(the loop's queue, a thread's direct send, a blocking call's own socket).

A message's *kind* is its method for calls and internal messages (for
example ``"rref.fork_request"`` or ``"examples.ops:add"``), ``"reply:" +
method`` for the reply to one, and ``"p2p"`` for point-to-point messages.
Rules match by exact kind or by a prefix ending in ``*``
(:mod:`rpcdist._faults`, below the options that carry them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .._errors import TransportError
from .._faults import Action, Fault, FaultInjector
from ._base import Accept, Hooks, Link, LinkFactory, Peer, Validate
from ._frames import InMessage, OutMessage, fault_label

__all__ = ["Fault", "FaultInjector", "FaultyLink", "FaultyTransport"]


class FaultyLink(Link):
    """A link whose outgoing messages pass :class:`FaultInjector` first."""

    def __init__(self, inner: Link, faults: FaultInjector, loop: asyncio.AbstractEventLoop) -> None:
        # Not Link.__init__: every attribute but the sending ones is the inner link's.
        self._inner = inner
        self._faults = faults
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_inner", "_faults", "_loop"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def _decide(self, msg: OutMessage) -> tuple[Action, float] | None:
        return self._faults.decide(fault_label(msg))

    def send(self, msg: OutMessage) -> None:
        """Queue ``msg`` unless a rule drops, fails or delays it (on the loop).

        Raises:
            TransportError: a rule fails it.
        """
        d = self._decide(msg)
        if d is None:
            self._inner.send(msg)
        elif d[0] == "drop":
            msg.dropped()
        elif d[0] == "fail":
            raise TransportError(f"injected failure sending {fault_label(msg)!r} to {self.label}")
        else:
            self._loop.call_later(d[1], self._send_late, msg)

    def _send_late(self, msg: OutMessage) -> None:
        if self._inner.closed is not None:
            msg.dropped()
        else:
            self._inner.send(msg)

    def try_send_now(self, msg: OutMessage, before: Callable[[], None] | None = None) -> bool:
        """As the inner link's, with the rules applied first (any thread).

        Raises:
            TransportError: a rule fails it.
        """
        d = self._decide(msg)
        if d is None:
            return self._inner.try_send_now(msg, before)
        if d[0] == "fail":
            raise TransportError(f"injected failure sending {fault_label(msg)!r} to {self.label}")
        if before is not None:
            before()
        if d[0] == "drop":
            msg.dropped()
        else:
            self._loop.call_soon_threadsafe(self._loop.call_later, d[1], self._send_late, msg)
        return True

    def send_blocking(self, msg: OutMessage, deadline: float | None) -> bool:
        """As the inner (threaded) link's, with the rules applied first.

        Raises:
            TransportError: a rule fails it.
            OSError: the socket failed.
        """
        d = self._decide(msg)
        if d is not None:
            if d[0] == "fail":
                raise TransportError(
                    f"injected failure sending {fault_label(msg)!r} to {self.label}"
                )
            if d[0] == "drop":
                msg.dropped()
                return True  # as if sent: the caller waits for a reply that never comes
            time.sleep(d[1])  # this thread's own call, delayed
        inner: Any = self._inner
        return bool(inner.send_blocking(msg, deadline))

    def close_write(self) -> None:
        self._inner.close_write()

    def abort(self, exc: Any) -> None:
        self._inner.abort(exc)

    async def aclose_write(self) -> None:
        await self._inner.aclose_write()

    def rebind(self, hooks: Hooks) -> None:
        def on_message(_: Link, m: InMessage) -> None:
            hooks.on_message(self, m)

        self._inner.rebind(Hooks(on_message, hooks.alloc, hooks.after_read))

    async def run(self) -> None:
        await self._inner.run()

    def queued(self) -> int:
        return self._inner.queued()


class FaultyTransport:
    """Wraps a transport so that every link it makes applies ``faults``."""

    def __init__(self, inner: Any, faults: FaultInjector, loop: asyncio.AbstractEventLoop) -> None:
        self._inner = inner
        self._faults = faults
        self._loop = loop
        self.name: str = inner.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _wrapped(self, hooks: Hooks, make: Callable[[Hooks], Link]) -> Link:
        """``make(hooks)`` wrapped, with its messages delivered as the wrapper's
        (so replies to them are sent through the wrapper too)."""
        box: list[FaultyLink] = []

        def on_message(_: Link, m: InMessage) -> None:
            hooks.on_message(box[0], m)

        inner = make(Hooks(on_message, hooks.alloc, hooks.after_read))
        box.append(FaultyLink(inner, self._faults, self._loop))
        return box[0]

    async def serve(self, validate: Validate, accept: Accept) -> dict[str, Any]:
        async def faulty_accept(rank: int, name: str, sync: bool, make: LinkFactory) -> None:
            def faulty_make(hooks: Hooks, **kw: Any) -> Link:
                return self._wrapped(hooks, lambda h: make(h, **kw))

            await accept(rank, name, sync, faulty_make)

        served: dict[str, Any] = await self._inner.serve(validate, faulty_accept)
        return served

    def link(self, peer: Peer, hooks: Hooks) -> tuple[Link, Awaitable[None]]:
        runs: list[Awaitable[None]] = []

        def make(h: Hooks) -> Link:
            link, run = self._inner.link(peer, h)
            runs.append(run)
            return link  # type: ignore[no-any-return]

        return self._wrapped(hooks, make), runs[0]

    def threaded_link(self, peer: Peer, hooks: Hooks) -> Link:
        return self._wrapped(hooks, lambda h: self._inner.threaded_link(peer, h))

    async def stop(self, grace: float) -> None:
        await self._inner.stop(grace)
