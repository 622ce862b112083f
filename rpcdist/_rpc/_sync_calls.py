"""``rpc_sync`` on connections driven by threads, not by the agent loops.

A blocking call from a user or pool thread (TCP transport, nothing else in
flight from this worker, any request size) takes one of a few
spare connections to the callee, writes the call from its own thread and
waits in ``poll`` on that socket for the reply, whose arrival wakes the
waiting thread itself. A connection is checked out for one call and
returned after it, so there are at most ``RpcOptions.sync_channels`` per
peer, shared by all threads.

On the callee, such a connection (its hello says so) is read by a thread of
its own, which runs a plain function in a slot borrowed from the handler
pool and writes the reply itself. So a round trip wakes two threads instead
of four (docs/design.md, "Blocking calls"), and often none: both waits first
poll their socket for up to ``RpcOptions.busy_poll_us`` (see :class:`_Polling`
and :meth:`SyncCalls._wait` for when).

A caller may also write a call and read its reply later
(:meth:`SyncCalls.start`), working meanwhile: a backward pass sends a
gradient message as soon as it has it and goes on with its own part.

When a call times out (or its caller abandons it), its connection goes to the loop, which half-closes
it and reads any reply that still comes (so RRef forks in a late reply are
registered and released like those of any late reply). Anything that does
not fit (a busy worker, a request for /dev/shm, fault injection, the gRPC
transport, a peer that cannot be dialled) takes the usual path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
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
from .._transport import Hooks, Link, LinkFactory
from .._transport._frames import (
    CALL,
    ERROR_REPLY,
    HEARTBEAT,
    INTERNAL,
    P2P,
    REPLY,
    InMessage,
    OutMessage,
)
from .._worker import WorkerInfo
from . import _dispatch, _doctor
from ._context import WireContext
from ._cores import CROWDED_FOR, crowded
from ._started import Started

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["NOT_TAKEN", "SyncCalls"]

_log = logging.getLogger(__name__)

#: Returned by :meth:`SyncCalls.start` when the call was left to the usual path.
NOT_TAKEN: Any = object()
#: Most connections one agent serves with threads of their own; more are
#: served by the loop.
_MAX_SERVED = 64
#: How often (seconds) a polling thread looks whether another thread of its
#: worker, or of the host, needs what it holds (its own socket: every round).
LOOK_EVERY = 20e-6
#: Most kinds of wait whose last length :class:`SyncCalls` remembers.
_KINDS = 4096


class _Polling:
    """This process's busy-polling (``RpcOptions.busy_poll_us``): one thread
    polls at a time (more would take the GIL from each other and from the
    handlers they wait for), and only while the process holds one agent (a
    peer in the same process needs the GIL to answer)."""

    slot = threading.Lock()
    lock = threading.Lock()
    agents = 0


class _Channel:
    """The caller's end of a thread-driven link: replies land in ``replies``."""

    __slots__ = ("link", "replies")

    def __init__(self, link: Any, replies: list[InMessage]) -> None:
        #: A ``TcpLink`` in threaded mode (possibly wrapped for fault injection).
        self.link = link
        self.replies = replies


def _keeper(replies: list[InMessage]) -> Hooks:
    def keep(link: Link, m: InMessage) -> None:
        if m.kind not in (REPLY, ERROR_REPLY):
            if m.kind == P2P and m.method == HEARTBEAT:
                return
            raise ProtocolError(f"unexpected frame kind {m.kind} from {link.label}")
        replies.append(m)

    return Hooks(on_message=keep)


def _queuer(inbox: list[InMessage]) -> Hooks:
    def queue(link: Link, m: InMessage) -> None:
        if m.kind not in (CALL, INTERNAL):
            raise ProtocolError(f"unexpected frame kind {m.kind} from {link.label}")
        inbox.append(m)

    return Hooks(on_message=queue)


class SyncCalls:
    """One agent's thread-driven connections, and the calls made on them."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        # Only plain sockets can be driven by a thread (see ``TcpLink``).
        threaded = agent.links.transport.name == "tcp"
        self._limit = int(agent.options.sync_channels) if threaded else 0
        #: Requests this large take the loop's path, whose same-host links
        #: send them through /dev/shm (``RpcOptions.shm_threshold_bytes``).
        self._max_request = agent.options.payload_shm_threshold or (1 << 62)
        self._lock = threading.Lock()
        self._free: dict[int, list[_Channel]] = {}
        self._busy: set[_Channel] = set()
        self._count: dict[int, int] = {}
        self._closed = False
        #: Callee side: links served by threads of their own, with their inboxes.
        self._served: dict[Any, threading.Thread] = {}
        self._served_per_peer: dict[int, int] = {}
        #: Calls in flight on these connections, and calls made on them
        #: (both under ``agent.activity.lock``).
        self.inflight = 0
        self.calls = 0
        #: The calls in flight: id -> (peer, label, started); for snapshots.
        self._active: dict[int, tuple[int, str, float]] = {}
        #: How long a thread waits for a reply before looking whether the peer
        #: was lost (a call without a deadline still ends when it is).
        self._slice = agent.options.heartbeat_interval
        #: Seconds a waiting thread polls before it sleeps (0: never).
        self._spin = float(agent.options.busy_poll_us) * 1e-6 if self._limit else 0.0
        #: Waits that began by polling, and those whose bytes came meanwhile
        #: (written by the one polling thread of the process).
        self.polls = 0
        self.polled = 0
        #: Polls cut short because bytes came for another thread of this agent.
        self.yielded = 0
        #: Whether the last wait of each kind ended within the window: a
        #: reply to ``(peer, label)``, or the next call after one of
        #: ``(peer, method)`` was served. A wait polls only if the last of
        #: its kind was that short (a step's long and short calls alternate
        #: on one connection).
        self._quick: dict[tuple[int, str], bool] = {}
        #: What the agent's other threads wait on: the loop's selector and the
        #: connections served here (see :meth:`_wait`).
        self._others: Any = None
        if self._spin:
            self._others = select.epoll()
            selector = getattr(agent.loop, "_selector", None)  # (asyncio's epoll)
            if selector is not None:
                self._watch(selector.fileno())
        with _Polling.lock:
            _Polling.agents += 1

    def outstanding(self) -> list[tuple[int, str, float]]:
        """``(peer, label, started)`` of each call in flight here (any thread)."""
        with self._agent.activity.lock:
            return list(self._active.values())

    def drop_peer(self, rank: int) -> None:
        """Worker ``rank`` was lost (any thread): wake the threads waiting on
        it, close its idle connections and the ones it drives here."""
        with self._lock:
            idle = self._free.pop(rank, [])
            self._count[rank] = self._count.get(rank, 0) - len(idle)
            for chan in self._busy:
                if chan.link.peer_rank == rank:
                    chan.link.interrupt()
            for served in self._served:
                if served.peer_rank == rank:
                    served.interrupt()
        for chan in idle:
            chan.link.close_threaded()

    def connections(self, dst: int) -> int:
        """Thread-driven connections open to worker ``dst`` now."""
        with self._lock:
            return self._count.get(dst, 0)

    def eligible(self, msg: OutMessage) -> bool:
        agent = self._agent
        return self._limit > 0 and not agent.calls.busy() and msg.payload_bytes < self._max_request

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

    def _finish(self, call: Started) -> Any:
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

    def _abandon(self, call: Started) -> None:
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
        dst = link.peer_rank
        lost = False
        kind = (dst, label)
        waited = time.monotonic()
        try:
            watched = False
            spin_end = self._spin_end(kind, waited)
            while call.sent and not chan.replies and link.closed is None:
                if self._wait(link, self._until(msg.deadline), spin_end):
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
        self._remember(kind, time.monotonic() - waited)
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

    def _wait(self, link: Any, until: float | None, spin_end: float) -> bool:
        """``link.read_blocking(until)``, polling without sleeping first until
        ``spin_end`` if this thread may (see :class:`_Polling`) and nothing
        else of this agent runs: a handler elsewhere would wait for the GIL."""
        if spin_end and _Polling.agents == 1 and not self._agent.activity.inflight:
            if until is not None:
                spin_end = min(spin_end, until)
            if time.monotonic() < spin_end and _Polling.slot.acquire(blocking=False):
                try:
                    self._poll(link, spin_end)
                except ValueError:  # the set was closed: the agent shut down meanwhile
                    pass
                finally:
                    _Polling.slot.release()
        return bool(link.read_blocking(until))

    def _poll(self, link: Any, spin_end: float) -> None:
        """Poll ``link`` until it is readable, ``spin_end``, or another thread
        of this worker (its GIL) or of the host (a core) needs what this takes."""
        self.polls += 1
        readable, others, clock = link.readable, self._others.poll, time.monotonic
        own = getattr(link, "_fd", -1)  # (served links are in ``others`` too)
        since = 0.0  # when the host was first seen crowded (0: it is not)
        look = 0.0  # when to look at the other threads and the host next
        while not readable():
            now = clock()
            if now >= look:  # (two more syscalls: not every round)
                look = now + LOOK_EVERY
                since = (since or now) if crowded() else 0.0
                if any(fd != own for fd, _ in others(0)) or (since and now - since >= CROWDED_FOR):
                    self.yielded += 1
                    return
            if now >= spin_end:
                return
        self.polled += 1

    def _spin_end(self, kind: tuple[int, str], now: float) -> float:
        """Until when a wait of ``kind`` starting ``now`` may poll (0: not at
        all: the last wait of its kind was longer than the window)."""
        return now + self._spin if self._quick.get(kind, True) else 0.0

    def _remember(self, kind: tuple[int, str], waited: float) -> None:
        quick = self._quick
        if len(quick) >= _KINDS and kind not in quick:
            quick.clear()  # (a program of that many kinds of call: start afresh)
        quick[kind] = waited <= self._spin

    def _watch(self, fd: int) -> None:
        """Count ``fd``'s bytes as another thread's in :meth:`_wait` (until it
        is closed: epoll forgets a closed socket by itself)."""
        if self._others is not None and fd >= 0:
            with contextlib.suppress(OSError, ValueError):  # (closed meanwhile)
                self._others.register(fd, select.EPOLLIN)

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
        link = transport.threaded_link(peer, _keeper(replies))
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
        """Close idle connections and wake threads waiting on busy or served
        ones (any thread)."""
        with self._lock:
            counted, self._closed = not self._closed, True  # (counted in _Polling until now)
            idle = [c for chans in self._free.values() for c in chans]
            self._free.clear()
            for chan in self._busy:
                chan.link.interrupt()
            for served in self._served:
                served.interrupt()
        for chan in idle:
            chan.link.close_threaded()
        if counted:
            with _Polling.lock:
                _Polling.agents -= 1

    def join(self, timeout: float | None) -> None:
        """Wait for the serving threads to end (after :meth:`close`), and
        close the set :meth:`_wait` watches."""
        with self._lock:
            threads = list(self._served.values())
        end = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if end is None else max(end - time.monotonic(), 0.0))
        if self._others is not None:
            self._others.close()

    # ------------------------------------------------------------ callee side

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
            link: Any = make(_queuer(inbox), threaded=True, same_host=same_host)
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

    def _serve(self, link: Any, inbox: list[InMessage]) -> None:
        kind = (link.peer_rank, "")  # (the method served last)
        self._watch(link._fd)
        try:
            while link.closed is None:
                waited = time.monotonic()
                self._wait(link, None, self._spin_end(kind, waited))
                self._remember(kind, time.monotonic() - waited)
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
