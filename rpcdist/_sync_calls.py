"""``rpc_sync`` on a connection the calling thread drives itself.

A blocking call from a user or pool thread (TCP transport, nothing else in
flight from this worker, a request of at most 64 KiB) takes one of a few
spare connections to the callee, writes the call from its own thread and
waits in ``poll`` on that socket for the reply. The reply's arrival wakes
the waiting thread itself: the agent loop, and the hand-off from the loop
to the waiting thread, are off the path (docs/design.md, "Blocking calls").
The callee serves these connections like any other.

A connection is checked out for one call and returned after it, so there
are at most ``RpcOptions.sync_channels`` per peer, shared by all threads.
When a call times out, its connection goes to the loop, which half-closes
it and reads any reply that still comes (so RRef forks in a late reply are
registered and released like those of any late reply). Anything that does
not fit (a busy worker, a large request, fault injection, the gRPC
transport, a peer that cannot be dialled) takes the usual path.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any

from ._context import WireContext
from ._errors import (
    ClosedError,
    ConnectError,
    ProtocolError,
    RpcdistError,
    RpcTimeoutError,
    WorkerLostError,
)
from ._serialization import decode, exception_from_wire
from ._transport._conn import BaseConnection
from ._transport._frames import ERROR_REPLY, REPLY, InMessage, OutMessage
from ._transport._tcp import TcpConnection
from ._worker import WorkerInfo

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["NOT_TAKEN", "SyncCalls"]

#: Requests up to this size may take a thread-driven connection.
MAX_REQUEST_BYTES = 64 << 10
#: Returned by :meth:`SyncCalls.call` when the call was left to the usual path.
NOT_TAKEN: Any = object()


class _Channel(TcpConnection):
    """A thread-driven connection: replies land in ``replies``."""

    def __init__(self, agent: Agent, dst: int) -> None:
        super().__init__(
            agent.loop,
            peer_rank=dst,
            label=agent.peer_label(dst),
            on_message=_keep,
            options=agent.options,
            segments=agent.segments_for(dst),
        )
        self.replies: list[InMessage] = []


def _keep(conn: BaseConnection, m: InMessage) -> None:
    if m.kind not in (REPLY, ERROR_REPLY):
        raise ProtocolError(f"unexpected frame kind {m.kind} from {conn.label}")
    conn.replies.append(m)  # type: ignore[attr-defined]


class SyncCalls:
    """One agent's thread-driven connections, and the calls made on them."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._limit = int(agent.options.sync_channels)
        self._lock = threading.Lock()
        self._free: dict[int, list[_Channel]] = {}
        self._busy: set[_Channel] = set()
        self._count: dict[int, int] = {}
        self._closed = False
        #: Calls in flight on these connections, and calls made on them
        #: (both under ``agent.count_lock``).
        self.inflight = 0
        self.calls = 0

    def connections(self, dst: int) -> int:
        """Thread-driven connections open to worker ``dst`` now."""
        with self._lock:
            return self._count.get(dst, 0)

    def eligible(self, msg: OutMessage) -> bool:
        agent = self._agent
        return (
            self._limit > 0
            and agent.options.faults is None
            and agent.options.data_transport == "tcp"
            and not agent.has_queued_calls()
            and len(msg.header) + msg.payload_bytes <= MAX_REQUEST_BYTES
        )

    def call(self, peer: WorkerInfo, msg: OutMessage, label: str) -> Any:
        """Make the call and return its result (or raise its error), or
        return :data:`NOT_TAKEN` having sent nothing.

        Raises:
            RpcTimeoutError: no reply before ``msg.deadline``.
            WorkerLostError: the connection to the callee failed.
            ClosedError: this agent shut down meanwhile.
            Exception: what the remote function raised.
        """
        agent = self._agent
        chan = self._take(peer.id, msg.deadline)
        if chan is None:
            return NOT_TAKEN
        msg.id = next(agent.call_ids)
        with agent.count_lock:
            agent.calls_sent += 1
            self.calls += 1
            self.inflight += 1
        try:
            reply = self._round_trip(chan, msg, label)
        finally:
            with agent.count_lock:
                self.inflight -= 1
            agent.woke_idle_threadsafe()
        ctx = WireContext(agent, peer, gated=False)
        value = decode(
            reply.header, reply.buffers, allow_pickle=agent.options.allow_pickle, context=ctx
        )
        if reply.kind == ERROR_REPLY:
            raise exception_from_wire(value)
        return value

    def _round_trip(self, chan: _Channel, msg: OutMessage, label: str) -> InMessage:
        started = time.monotonic()
        try:
            sent = chan.send_blocking(msg, msg.deadline)
            while sent and not chan.replies and chan.closed is None:
                if not chan.read_blocking(msg.deadline):
                    break
        except OSError as e:  # (no RpcTimeoutError, also an OSError, is raised in here)
            self._drop(chan)
            why = WorkerLostError(f"lost the connection to {chan.label}: {e}")
            raise self._lost(label, why) from e
        if not sent:
            self._drop(chan)  # cut mid-message: nothing will answer it
            raise self._timeout(chan, label, started)
        if chan.closed is not None and not chan.replies:
            self._drop(chan)
            raise self._lost(label, chan.closed)
        if not chan.replies:
            self._retire(chan)  # the deadline passed
            raise self._timeout(chan, label, started)
        reply = chan.replies.pop()
        if reply.id != msg.id or chan.replies:
            self._drop(chan)
            raise ProtocolError(f"{chan.label} answered call {msg.id} with message {reply.id}")
        if chan.closed is not None or self._agent.closed:
            self._drop(chan)
        else:
            self._give_back(chan)
        return reply

    def _lost(self, label: str, why: RpcdistError) -> RpcdistError:
        agent = self._agent
        if agent.closed:
            return ClosedError(f"call {label!r} failed: agent {agent.name!r} shut down")
        return type(why)(f"call {label!r} failed: {why}")

    def _timeout(self, chan: _Channel, label: str, started: float) -> RpcTimeoutError:
        name = self._agent.workers[chan.peer_rank].name
        return RpcTimeoutError(
            f"call {label!r} to worker {name!r} timed out after {time.monotonic() - started:.3g} s"
        )

    # ------------------------------------------------------------ channels

    def _take(self, dst: int, deadline: float | None) -> _Channel | None:
        with self._lock:
            if self._closed:
                return None
            free = self._free.get(dst)
            while free:
                idle = free.pop()
                if idle.idle_ok():
                    self._busy.add(idle)
                    return idle
                self._count[dst] -= 1  # the peer closed it while it was idle
                idle.close_threaded()
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
            chan.close_threaded()
        return None

    def _open(self, dst: int, deadline: float | None) -> _Channel | None:
        """A new thread-driven connection to ``dst``, or None (the usual path
        then reports whatever is wrong)."""
        agent = self._agent
        chan = _Channel(agent, dst)
        limit = 30.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            fut = asyncio.run_coroutine_threadsafe(
                asyncio.wait_for(agent.dial(dst, chan.label), limit), agent.loop
            )
            sock = fut.result()
        except (RuntimeError, ConnectError, TimeoutError, OSError):
            return None
        chan.attach(sock, threaded=True)
        return chan

    def _give_back(self, chan: _Channel) -> None:
        with self._lock:
            self._busy.discard(chan)
            if not self._closed:
                self._free.setdefault(chan.peer_rank, []).append(chan)
                return
        chan.close_threaded()

    def _drop(self, chan: _Channel) -> None:
        with self._lock:
            self._busy.discard(chan)
            self._count[chan.peer_rank] -= 1
        chan.close_threaded()

    def _retire(self, chan: _Channel) -> None:
        """After a timeout: the loop reads whatever late reply still comes."""
        with self._lock:
            self._busy.discard(chan)
            self._count[chan.peer_rank] -= 1
            closed = self._closed
        if not closed:
            try:
                self._agent.loop.call_soon_threadsafe(self._agent.adopt_late, chan)
                return
            except RuntimeError:  # the loop is gone
                pass
        chan.close_threaded()

    def close(self) -> None:
        """Close idle connections and wake threads waiting on busy ones (any thread)."""
        with self._lock:
            self._closed = True
            idle = [c for chans in self._free.values() for c in chans]
            self._free.clear()
            for chan in self._busy:
                chan.interrupt()
        for chan in idle:
            chan.close_threaded()
