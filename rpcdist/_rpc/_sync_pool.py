"""The caller's pool of connections for blocking calls, driven by the
calling threads, not by the agent's loop.

A blocking call from a user or pool thread (TCP transport, nothing else in
flight from this worker, any request size) takes one of a few
spare connections to the callee, writes the call from its own thread and
waits in ``poll`` on that socket for the reply, whose arrival wakes the
waiting thread itself. A connection is checked out for one call and
returned after it, so there are at most ``RpcOptions.sync_channels`` per
peer, shared by all threads.

On the callee, such a connection is read by a thread of its own
(:mod:`._sync_serving`). So a round trip wakes two threads instead of four
(docs/design.md, "Blocking calls"), and often none: both waits first poll
their socket for up to ``RpcOptions.busy_poll_us`` (:mod:`._busy_poll`).

A caller may also write a call and read its reply later
(:meth:`SyncPool.start`), working meanwhile: a backward pass sends a
gradient message as soon as it has it and goes on with its own part.

When a call times out (or its caller abandons it), its connection goes to the loop, which half-closes
it and reads any reply that still comes (so RRef forks in a late reply are
registered and released like those of any late reply). Anything that does
not fit (a busy worker, a large request to another host, fault injection,
the gRPC transport, a peer that cannot be dialled) takes the usual path. A
large request to a peer on this host travels in a /dev/shm segment the
calling thread copies it into, its reply in one the serving thread fills.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any

from .._errors import (
    ClosedError,
    ConnectError,
    ProtocolError,
    RpcdistError,
    RpcTimeoutError,
    WorkerLostError,
)
from .._pool import blocking
from .._serialization import decode, exception_from_wire
from .._transport import Hooks, Link
from .._transport._frames import ERROR_REPLY, HEARTBEAT, P2P, REPLY, InMessage, OutMessage
from .._worker import WorkerInfo
from . import _doctor
from ._busy_poll import BusyPoll
from ._started import Started
from ._wire import WireContext

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["NOT_TAKEN", "SyncPool", "channel_limit"]

#: Returned by :meth:`SyncPool.start` when the call was left to the usual path.
NOT_TAKEN: Any = object()


def channel_limit(agent: AgentView) -> int:
    """Thread-driven connections per peer (``RpcOptions.sync_channels``; 0:
    none, the transport cannot hand its sockets to threads)."""
    # Only plain sockets can be driven by a thread (see ``TcpLink``).
    threaded = agent.links.transport.name == "tcp"
    return int(agent.options.sync_channels) if threaded else 0


class _Channel:
    """The caller's end of a thread-driven link: replies land in ``replies``."""

    __slots__ = ("link", "replies")

    def __init__(self, link: Any, replies: list[InMessage]) -> None:
        #: A ``TcpLink`` in threaded mode (possibly wrapped for fault injection).
        self.link = link
        self.replies = replies


def _collect_replies(replies: list[InMessage]) -> Hooks:
    """Hooks that append each reply read on a link to ``replies``."""

    def keep(link: Link, m: InMessage) -> None:
        if m.kind not in (REPLY, ERROR_REPLY):
            if m.kind == P2P and m.method == HEARTBEAT:
                return
            raise ProtocolError(f"unexpected frame kind {m.kind} from {link.label}")
        replies.append(m)

    return Hooks(on_message=keep)


class SyncPool:
    """One agent's thread-driven connections to its peers, checked out for a
    call each, and the calls in flight on them."""

    def __init__(self, agent: AgentView, limit: int, busy_poll: BusyPoll) -> None:
        self._agent = agent
        self._limit = limit
        self._busy_poll = busy_poll
        #: Requests this large go to a peer on another host by the loop's
        #: path; to one on this host, through /dev/shm
        #: (``RpcOptions.shm_threshold_bytes``), copied in by the calling thread.
        self._max_request = agent.options.payload_shm_threshold or (1 << 62)
        self._lock = threading.Lock()
        self._free: dict[int, list[_Channel]] = {}
        self._busy: set[_Channel] = set()
        self._count: dict[int, int] = {}
        self._closed = False
        #: Calls in flight on these connections, and calls made on them
        #: (both under ``agent.activity.lock``).
        self.inflight = 0
        self.calls = 0
        #: The calls in flight: id -> (peer, label, started); for snapshots.
        self._active: dict[int, tuple[int, str, float]] = {}
        #: How long a thread waits for a reply before looking whether the peer
        #: was lost (a call without a deadline still ends when it is).
        self._slice = agent.options.heartbeat_interval

    def outstanding(self) -> list[tuple[int, str, float]]:
        """``(peer, label, started)`` of each call in flight here (any thread)."""
        with self._agent.activity.lock:
            return list(self._active.values())

    def drop_peer(self, rank: int) -> None:
        """Worker ``rank`` was lost (any thread): wake the threads waiting on
        it and close its idle connections."""
        with self._lock:
            idle = self._free.pop(rank, [])
            self._count[rank] = self._count.get(rank, 0) - len(idle)
            for chan in self._busy:
                if chan.link.peer_rank == rank:
                    chan.link.interrupt()
        for chan in idle:
            chan.link.close_threaded()

    def connections(self, dst: int) -> int:
        """Thread-driven connections open to worker ``dst`` now."""
        with self._lock:
            return self._count.get(dst, 0)

    def eligible(self, peer: WorkerInfo, msg: OutMessage) -> bool:
        agent = self._agent
        return (
            self._limit > 0
            and not agent.calls.busy()
            and (msg.payload_bytes < self._max_request or agent.links.peer(peer.id).same_host)
        )

    def start(self, peer: WorkerInfo, msg: OutMessage) -> Started:
        """Write the call and return at once; :meth:`Started.wait` reads the
        reply (so the caller can work meanwhile). Returns :data:`NOT_TAKEN`
        having sent nothing if no connection is free.

        Raises:
            WorkerLostError: the connection failed while the call was written.
            RpcdistError: a fault rule failed the call (nothing was sent).
        """
        agent = self._agent
        chan = self._take(peer.id, msg.deadline)
        if chan is None:
            return NOT_TAKEN  # type: ignore[no-any-return]
        msg.id = next(agent.calls.ids)
        call = Started(self, chan, msg, msg.label or msg.method, time.monotonic())
        with agent.activity.lock:
            agent.activity.sent += 1
            self.calls += 1
            self.inflight += 1
            self._active[msg.id] = (peer.id, call.label, call.started)
        link = chan.link
        try:
            call.sent = link.send_blocking(msg, msg.deadline)
        except OSError as e:  # (no RpcTimeoutError, also an OSError, is raised in here)
            self._ended(call)
            self._drop(chan)
            raise self._lost_link(link, call.label, e) from e
        except RpcdistError:  # a fault rule failed the call: nothing was sent
            self._ended(call)
            self._give_back(chan)
            msg.dropped()
            raise
        except BaseException:  # interrupted mid-write: the connection is unusable
            self._ended(call)
            self._drop(chan)
            raise
        return call

    def _ended(self, call: Started) -> None:
        """Count ``call`` out of the calls in flight (once)."""
        if call.done:
            return
        call.done = True
        activity = self._agent.activity
        with activity.lock:
            self.inflight -= 1
            del self._active[call.msg.id]
        activity.woke_threadsafe()

    def finish(self, call: Started) -> Any:
        """Read ``call``'s reply on this thread (:meth:`Started.wait`)."""
        if call.done:
            raise RuntimeError(f"call {call.label!r} was already waited for or abandoned")
        pool = blocking(call)  # (a handler waiting: its pool may start another thread)
        try:
            reply = self._await(call)
        finally:
            if pool is not None:
                pool.unblocked()
            self._ended(call)
        agent = self._agent
        peer = agent.workers[call.chan.link.peer_rank]
        agent.registry.on_reply(agent, peer, reply.meta)
        wire = WireContext(agent, peer, off_loop=True, meta=reply.meta)
        value = decode(
            reply.header, reply.buffers, allow_pickle=agent.options.allow_pickle, context=wire
        )
        if reply.kind == ERROR_REPLY:
            raise exception_from_wire(value)
        return value

    def abandon(self, call: Started) -> None:
        """No one will wait for ``call``'s reply (:meth:`Started.abandon`)."""
        if call.done:
            return
        self._ended(call)
        if call.sent:
            self._retire(call.chan)  # the loop reads the reply when it comes
        else:
            self._drop(call.chan)

    def _lost_link(self, link: Any, label: str, e: OSError) -> RpcdistError:
        why: RpcdistError = WorkerLostError(f"lost the connection to {link.label}: {e}")
        liveness = self._agent.liveness
        if liveness.is_lost(link.peer_rank):
            why = liveness.error(link.peer_rank)
        return self._lost(label, why)

    def _await(self, call: Started) -> InMessage:
        chan: _Channel = call.chan
        msg, label = call.msg, call.label
        link = chan.link
        liveness = self._agent.liveness
        poller = self._busy_poll
        dst = link.peer_rank
        lost = False
        kind = (dst, label)
        waited = time.monotonic()
        try:
            watched = False
            spin_end = poller.window_end(kind, waited)
            while call.sent and not chan.replies and link.closed is None:
                if poller.wait(link, self._until(msg.deadline), spin_end):
                    continue
                if liveness.is_lost(dst):
                    lost = True
                    break
                if msg.deadline is not None and time.monotonic() >= msg.deadline:
                    break
                if not watched:  # a slow reply: make sure the detector watches the callee
                    watched = True
                    liveness.watch_threadsafe(dst)
        except OSError as e:
            self._drop(chan)
            raise self._lost_link(link, label, e) from e
        poller.remember(kind, time.monotonic() - waited)
        if lost or (link.closed is not None and not chan.replies and liveness.is_lost(dst)):
            self._drop(chan)
            raise self._lost(label, liveness.error(dst))
        if not call.sent:
            self._drop(chan)  # cut mid-message: nothing will answer it
            raise self._timeout(chan, label, call.started)
        if link.closed is not None and not chan.replies:
            self._drop(chan)
            raise self._lost(label, link.closed)
        if not chan.replies:
            self._retire(chan)  # the deadline passed
            raise self._timeout(chan, label, call.started)
        reply = chan.replies.pop()
        if reply.id != msg.id or chan.replies:
            self._drop(chan)
            raise ProtocolError(f"{link.label} answered call {msg.id} with message {reply.id}")
        if link.closed is not None or self._agent.closed:
            self._drop(chan)
        else:
            self._give_back(chan)
        return reply

    def _until(self, deadline: float | None) -> float:
        """The end of the next wait for a reply: a slice, or the deadline if sooner."""
        end = time.monotonic() + self._slice
        return end if deadline is None else min(end, deadline)

    def _lost(self, label: str, why: RpcdistError) -> RpcdistError:
        agent = self._agent
        if agent.closed:
            return ClosedError(f"call {label!r} failed: agent {agent.name!r} shut down")
        return type(why)(f"call {label!r} failed: {why}")

    def _timeout(self, chan: _Channel, label: str, started: float) -> RpcTimeoutError:
        name = self._agent.workers[chan.link.peer_rank].name
        info = _doctor.snapshot(self._agent)
        return RpcTimeoutError(
            f"call {label!r} to worker {name!r} timed out after "
            f"{time.monotonic() - started:.3g} s; {_doctor.summary(info)}",
            snapshot=info,
        )

    # ------------------------------------------------------------ channels

    def _take(self, dst: int, deadline: float | None) -> _Channel | None:
        with self._lock:
            if self._closed or self._agent.liveness.is_lost(dst):
                return None
            free = self._free.get(dst)
            while free:
                idle = free.pop()
                if idle.link.idle_ok():
                    self._busy.add(idle)
                    return idle
                self._count[dst] -= 1  # the peer closed it while it was idle
                idle.link.close_threaded()
            if self._count.get(dst, 0) >= self._limit:
                return None
            self._count[dst] = self._count.get(dst, 0) + 1
        chan = self._open(dst, deadline)
        with self._lock:
            if chan is not None and not self._closed:
                self._busy.add(chan)
                return chan
            self._count[dst] -= 1
        if chan is not None:
            chan.link.close_threaded()
        return None

    def _open(self, dst: int, deadline: float | None) -> _Channel | None:
        """A new thread-driven connection to ``dst``, or None (the usual path
        then reports whatever is wrong)."""
        agent = self._agent
        transport: Any = agent.links.transport
        peer = agent.links.peer(dst)
        replies: list[InMessage] = []
        link = transport.threaded_link(peer, _collect_replies(replies))
        limit = 30.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            fut = asyncio.run_coroutine_threadsafe(
                asyncio.wait_for(transport.dial(peer, sync=True), limit), agent.loop
            )
            sock = fut.result()
        except (RuntimeError, ConnectError, TimeoutError, OSError):
            return None
        link.attach(sock, threaded=True)
        return _Channel(link, replies)

    def _give_back(self, chan: _Channel) -> None:
        with self._lock:
            self._busy.discard(chan)
            if not self._closed:
                self._free.setdefault(chan.link.peer_rank, []).append(chan)
                return
        chan.link.close_threaded()

    def _drop(self, chan: _Channel) -> None:
        with self._lock:
            self._busy.discard(chan)
            self._count[chan.link.peer_rank] -= 1
        chan.link.close_threaded()

    def _retire(self, chan: _Channel) -> None:
        """After a timeout: the loop reads whatever late reply still comes."""
        with self._lock:
            self._busy.discard(chan)
            self._count[chan.link.peer_rank] -= 1
            closed = self._closed
        if not closed:
            try:
                self._agent.loop.call_soon_threadsafe(self._agent.links.adopt_late, chan.link)
                return
            except RuntimeError:  # the loop is gone
                pass
        chan.link.close_threaded()

    def close(self) -> None:
        """Close idle connections and wake threads waiting on busy ones (any
        thread)."""
        with self._lock:
            self._closed = True
            idle = [c for chans in self._free.values() for c in chans]
            self._free.clear()
            for chan in self._busy:
                chan.link.interrupt()
        for chan in idle:
            chan.link.close_threaded()
