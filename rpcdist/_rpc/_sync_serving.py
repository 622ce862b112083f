"""The callee's threads that serve connections a caller drives itself.

Such a connection (its hello says so; see :mod:`._sync_pool`) is read by a
thread of its own, which runs a plain function in a slot borrowed from the
handler pool and writes the reply itself; anything else it reads goes to the
agent's loop as it would from any link. Its waits for the next call poll
first like the caller's (:mod:`._busy_poll`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from .._errors import ProtocolError
from .._transport import Hooks, Link, LinkFactory
from .._transport._frames import CALL, INTERNAL, InMessage
from . import _dispatch
from ._busy_poll import BusyPoll

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["SyncServing"]

_log = logging.getLogger(__name__)

#: Most connections one agent serves with threads of their own; more are
#: served by the loop.
_MAX_SERVED = 64


def _collect_calls(inbox: list[InMessage]) -> Hooks:
    """Hooks that append each call read on a link to ``inbox``."""

    def queue(link: Link, m: InMessage) -> None:
        if m.kind not in (CALL, INTERNAL):
            raise ProtocolError(f"unexpected frame kind {m.kind} from {link.label}")
        inbox.append(m)

    return Hooks(on_message=queue)


class SyncServing:
    """One agent's connections served by threads of their own."""

    def __init__(self, agent: AgentView, limit: int, busy_poll: BusyPoll) -> None:
        self._agent = agent
        #: Most connections served per peer (``RpcOptions.sync_channels``).
        self._limit = limit
        self._busy_poll = busy_poll
        self._lock = threading.Lock()
        self._closed = False
        #: The served links, with the thread serving each.
        self._served: dict[Any, threading.Thread] = {}
        self._served_per_peer: dict[int, int] = {}

    def serve(self, rank: int, name: str, make: LinkFactory, same_host: bool) -> bool:
        """On the loop: serve a caller-driven connection from ``rank`` with a
        thread of its own; False (nothing done) if it should be served by
        the loop like any other (limits reached)."""
        agent = self._agent
        with self._lock:
            if (
                self._closed
                or self._served_per_peer.get(rank, 0) >= self._limit
                or len(self._served) >= _MAX_SERVED
            ):
                return False
            inbox: list[InMessage] = []
            link: Any = make(_collect_calls(inbox), threaded=True, same_host=same_host)
            t = threading.Thread(
                target=self._serve,
                args=(link, inbox),
                name=f"rpcdist-sync-{agent.name}",
                daemon=True,
            )
            self._served[link] = t
            self._served_per_peer[rank] = self._served_per_peer.get(rank, 0) + 1
        t.start()
        return True

    def drop_peer(self, rank: int) -> None:
        """Worker ``rank`` was lost (any thread): close the connections it
        drives here."""
        with self._lock:
            for served in self._served:
                if served.peer_rank == rank:
                    served.interrupt()

    def close(self) -> None:
        """Wake the serving threads, which then end (any thread)."""
        with self._lock:
            self._closed = True
            for served in self._served:
                served.interrupt()

    def join(self, timeout: float | None) -> None:
        """Wait for the serving threads to end (after :meth:`close`)."""
        with self._lock:
            threads = list(self._served.values())
        end = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if end is None else max(end - time.monotonic(), 0.0))

    def _serve(self, link: Any, inbox: list[InMessage]) -> None:
        kind = (link.peer_rank, "")  # (the method served last)
        poller = self._busy_poll
        poller.watch(link._fd)
        try:
            while link.closed is None:
                waited = time.monotonic()
                poller.wait(link, None, poller.window_end(kind, waited))
                poller.remember(kind, time.monotonic() - waited)
                while inbox:
                    m = inbox.pop(0)
                    kind = (link.peer_rank, m.method)
                    self._run(link, m)
        except Exception:  # a bug here: drop the link, loudly (the caller sees it lost)
            _log.exception("error serving blocking calls from %s", link.label)
        finally:
            with self._lock:
                del self._served[link]
                self._served_per_peer[link.peer_rank] -= 1
            link.close_threaded()
            agent = self._agent
            if not agent.closed:  # the caller may have closed it at will: probe it
                agent.liveness.probe_threadsafe(link.peer_rank, f"{link.label} closed a connection")

    def _run(self, link: Any, m: InMessage) -> None:
        """Handle one call on the serving thread: a plain function runs right
        here, in a slot borrowed from the pool (so ``num_worker_threads``
        still bounds running handlers); anything else goes where it would
        have gone from the loop."""
        agent = self._agent
        fn = _dispatch.plain_function(m, agent.policy) if m.kind == CALL else None
        if fn is None:  # internal, async def, @async_execution, unknown
            try:
                agent.loop.call_soon_threadsafe(agent.on_message, link, m)
            except RuntimeError:  # the loop is gone: shutting down
                pass
            return
        agent.activity.handler_started_threadsafe()
        wire = _dispatch.call_wire(agent, agent.workers[link.peer_rank], m, off_loop=True)
        try:
            args, kwargs = _dispatch.decode_call(agent, m, wire)
            wire.wait_gates_blocking(m.deadline)
        except BaseException as e:
            wire.abort()
            _dispatch.reply_error_threadsafe(agent, link, m, wire, e)
            return
        if agent.executor.try_borrow():
            try:
                _dispatch.run_handler(agent, link, m, fn, args, kwargs, wire)
            finally:
                agent.executor.give_back()
        else:  # the pool is busy: queue behind its work
            _dispatch.post_handler(agent, link, m, fn, args, kwargs, wire)
