"""Outgoing calls waiting for their replies: ids, timers, completion.

A call is sent from the thread that makes it when it can be (a small call on
an idle link, see :meth:`Calls._send_now`), else handed to the loop. Either
way it is *pending* until its reply, its deadline or the loss of its peer
completes its Future. The pending table is guarded by a lock: user threads
and the loop both write it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._deadline import current_deadline
from .._errors import (
    CallPolicyError,
    ClosedError,
    NotInitializedError,
    RpcdistError,
    RpcTimeoutError,
    SerializationError,
    TransportError,
)
from .._futures import Future
from .._serialization import decode, exception_from_wire
from .._serialization._codec import NONE_HEADER
from .._transport import Link
from .._transport._frames import REPLY, InMessage, OutMessage
from . import _doctor
from ._wire import WireContext

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["Calls", "send_control"]

#: How often the loop arms the timers of calls whose deadlines are not near.
_ARM_PERIOD = 0.25
#: A call whose deadline is nearer than this gets its timer at once (a
#: directly sent one wakes the loop for it); later deadlines wait for the
#: next sweep, so that most calls, answered before it, never get one.
_ARM_AT_ONCE = 4 * _ARM_PERIOD


@dataclass(eq=False, slots=True)
class _Pending:
    fut: Future[Any]
    dst: int
    label: str
    deadline: float | None
    timer: asyncio.TimerHandle | None
    started: float
    ordered: bool = True


class Calls:
    """One agent's outgoing calls (see the module docstring)."""

    def __init__(self, agent: AgentView) -> None:
        self._agent = agent
        self._loop = agent.loop
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        #: Pending control messages (``OutMessage.ordered`` false): they hold
        #: no user call back from a direct or thread-driven send.
        self._unordered = 0
        #: Message ids, unique per sender (calls, p2p messages, blocking calls).
        self.ids = itertools.count(1)
        #: Calls user threads handed to the loop that it has not sent yet.
        self._queued = 0
        #: Calls whose timers the loop has not armed yet (their deadlines
        #: are not near); drained every ``_ARM_PERIOD``.
        self._to_arm: collections.deque[int] = collections.deque()
        self._sweeper: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def queued(self) -> int:
        """Calls user threads handed to the loop that it has not started yet."""
        return self._queued

    def outstanding(self) -> list[tuple[int, str, float, float | None]]:
        """``(peer, label, started, deadline)`` of each pending call (any thread)."""
        with self._lock:
            return [(p.dst, p.label, p.started, p.deadline) for p in self._pending.values()]

    def describe(self, fut: Future[Any]) -> str | None:
        """The pending call whose reply ``fut`` gets, as ``'label' on 'worker'``
        (any thread; a scan, for warnings); None if none."""
        with self._lock:
            found = next((p for p in self._pending.values() if p.fut is fut), None)
        if found is None:
            return None
        return f"{found.label!r} on {self._agent.workers[found.dst].name!r}"

    def busy(self) -> bool:
        """Whether user calls are pending or queued for the loop (any thread; a hint)."""
        return len(self._pending) > self._unordered or bool(self._queued)

    def _add(self, call_id: int, p: _Pending) -> None:
        with self._lock:
            self._pending[call_id] = p
            if not p.ordered:
                self._unordered += 1

    def _pop(self, call_id: int) -> _Pending | None:
        with self._lock:
            p = self._pending.pop(call_id, None)
            if p is not None and not p.ordered:
                self._unordered -= 1
            return p

    def start(self) -> None:
        """Start arming sweeps (on the loop)."""
        self._sweeper = self._loop.call_later(_ARM_PERIOD, self._sweep)

    # ------------------------------------------------------------- submit

    def submit(self, dst: int, msg: OutMessage) -> Future[Any]:
        """Send request ``msg`` to worker ``dst`` from any thread; the Future gets its reply."""
        fut: Future[Any] = Future()
        agent = self._agent
        if agent.in_loop_thread():
            self._start(dst, msg, fut)
        elif not self._send_now(dst, msg, fut):
            if msg.buffers and (link := agent.links.get(dst)) is not None:
                link.to_segment(msg)  # (a large payload: copied on this thread, not the loop)
            with self._lock:
                self._queued += 1
            try:
                self._loop.call_soon_threadsafe(self._start, dst, msg, fut, True)
            except RuntimeError as e:
                with self._lock:
                    self._queued -= 1
                raise NotInitializedError(f"the rpcdist agent {agent.name!r} has shut down") from e
        return fut

    def _send_now(self, dst: int, msg: OutMessage, fut: Future[Any]) -> bool:
        """From a user thread: send a call straight onto an idle link.

        Saves the hop to the loop; the loop arms the call's timer afterwards
        (:meth:`_arm`). Only for a call made while none is in flight (under
        load, one write per call would cost more than the hop saves); never
        while calls this agent handed to the loop are still unsent (so one
        thread's calls keep their order). Returns False, having done nothing,
        when not taken.
        """
        if self._queued or len(self._pending) > self._unordered:
            return False  # in flight: the loop coalesces them (asked first: the usual answer)
        agent = self._agent
        link = agent.links.get(dst)
        if link is None or agent.closed:
            return False
        call_id = msg.id = next(self.ids)
        now = time.monotonic()
        self._add(call_id, _Pending(fut, dst, _label(msg), msg.deadline, None, now, msg.ordered))
        try:
            sent = link.try_send_now(msg)
        except RpcdistError as e:  # an injected failure
            self.finish(call_id, exc=e)
            return True
        if not sent:
            # Not sent; True if the link failed meanwhile and the loop has
            # already failed the call (its Future holds the error).
            return self._pop(call_id) is None
        agent.activity.sent_one()
        if msg.deadline is None:
            pass  # no timer to arm
        elif msg.deadline - now > _ARM_AT_ONCE:
            self._to_arm.append(call_id)  # the sweep arms it: no wake-up now
        else:
            try:
                self._loop.call_soon_threadsafe(self._arm, call_id)
            except RuntimeError:
                pass  # the loop is gone: handled just below
        # Shut down meanwhile: fail_all may have missed this call.
        if agent.closed and self._pop(call_id) is not None:
            fut.set_exception(ClosedError(f"agent {agent.name!r} shut down"))
        return True

    def _arm(self, call_id: int) -> None:
        """On the loop, after the call was sent: start its timer (if still pending)."""
        p = self._pending.get(call_id)
        if p is not None and p.timer is None and p.deadline is not None:  # not answered yet
            p.timer = self._loop.call_at(p.deadline, self._expire, call_id)

    def _sweep(self) -> None:
        """Every ``_ARM_PERIOD`` on the loop: arm the timers of calls still pending."""
        while self._to_arm:
            self._arm(self._to_arm.popleft())
        if not self._agent.closed:
            self._sweeper = self._loop.call_later(_ARM_PERIOD, self._sweep)

    def _start(self, dst: int, msg: OutMessage, fut: Future[Any], queued: bool = False) -> None:
        """On the loop: register the call, arm its timer, queue it on its link."""
        agent = self._agent
        if agent.closed:
            if queued:
                with self._lock:
                    self._queued -= 1
            msg.dropped()
            fut.set_exception(
                NotInitializedError(f"the rpcdist agent {agent.name!r} has shut down")
            )
            return
        call_id = msg.id = next(self.ids)
        now = time.monotonic()
        deadline, timer = msg.deadline, None
        if deadline is not None:
            if deadline - now > _ARM_AT_ONCE:
                self._to_arm.append(call_id)  # the sweep arms it, if still pending
            else:
                timer = self._loop.call_at(deadline, self._expire, call_id)
        p = _Pending(fut, dst, msg.label or msg.method, deadline, timer, now, msg.ordered)
        with self._lock:  # (inlined _add: this is the loop's path of every call)
            self._pending[call_id] = p
            if not p.ordered:
                self._unordered += 1
            if queued:  # (with the add: a user thread sees it queued or pending)
                self._queued -= 1
        activity = agent.activity
        activity.idle.clear()
        with activity.lock:
            activity.sent += 1
        try:
            agent.links.send(dst, msg)
        except RpcdistError as e:
            msg.dropped()
            self.finish(call_id, exc=e)

    # ---------------------------------------------------------- completion

    def _expire(self, call_id: int) -> None:
        p = self._pending.get(call_id)
        if p is not None:
            waited = time.monotonic() - p.started
            name = self._agent.workers[p.dst].name
            info = _doctor.snapshot(self._agent)
            self.finish(
                call_id,
                exc=RpcTimeoutError(
                    f"call {p.label!r} to worker {name!r} timed out after {waited:.3g} s; "
                    f"{_doctor.summary(info)}",
                    snapshot=info,
                ),
            )

    def finish(
        self,
        call_id: int,
        *,
        value: Any = None,
        exc: BaseException | None = None,
        link: Link | None = None,
    ) -> None:
        """Complete call ``call_id`` (on the loop); ``link``: its reply came in on it."""
        with self._lock:  # (inlined _pop)
            p = self._pending.pop(call_id, None)
            if p is None:
                return
            if not p.ordered:
                self._unordered -= 1
        if p.timer is not None:
            p.timer.cancel()
        agent = self._agent
        if not self._pending and agent.activity.inflight == 0 and not agent.sync.inflight:
            agent.activity.idle.set()
        if link is not None and not p.fut._has_callbacks():
            # Only threads wait on it: wake them when the read callback ends.
            agent.wake_after_read(link, p.fut._complete, value, exc)
        else:
            p.fut._complete(value, exc)

    def on_reply(self, link: Link, m: InMessage) -> None:
        """A REPLY or ERROR_REPLY arrived (on the loop)."""
        if m.header == NONE_HEADER and m.kind == REPLY and not m.buffers and not m.meta:
            self.finish(m.id, link=link)  # ``None``: nothing to decode, no fields to run
            return
        agent = self._agent
        peer = agent.workers[link.peer_rank]
        agent.registry.on_reply(agent, peer, m.meta)
        wire = WireContext(agent, peer, meta=m.meta)
        pickle = agent.options.allow_pickle
        if m.id not in self._pending:
            # A late reply to a call that timed out or was failed: decode it
            # anyway, so that RRef forks it carries are registered and released.
            try:
                decode(m.header, m.buffers, allow_pickle=pickle, context=wire)
            except RpcdistError:
                pass
            return
        try:
            value = decode(m.header, m.buffers, allow_pickle=pickle, context=wire)
        except (SerializationError, CallPolicyError) as e:  # (a refused function in it)
            self.finish(m.id, exc=e, link=link)
            return
        if m.kind == REPLY:
            self.finish(m.id, value=value, link=link)
        else:
            self.finish(m.id, exc=exception_from_wire(value), link=link)

    def fail_peer(self, dst: int, exc: RpcdistError) -> None:
        """Fail every call pending on worker ``dst`` (on the loop)."""
        for call_id, p in list(self._pending.items()):
            if p.dst == dst:
                self.finish(call_id, exc=type(exc)(f"call {p.label!r} failed: {exc}"))

    def fail_all(self, exc: RpcdistError) -> None:
        """Fail every pending call; stop arming (on the loop, at close)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for call_id in list(self._pending):
            self.finish(call_id, exc=type(exc)(str(exc)))


def _label(msg: OutMessage) -> str:
    return msg.label or msg.method


async def send_control(
    agent: AgentView, dst: int, method: str, payload: Any, give_up_after: float | None
) -> Any:
    """``agent.send_control``: an idempotent internal message, retried until
    acknowledged (on the loop).

    Retries after ``control_retry_interval`` without a reply and after
    transport errors, until ``give_up_after`` seconds (default: the agent's
    rpc timeout, else 60 s) have passed, then raises the last error; no
    retry once ``dst`` is lost.
    """
    limit = give_up_after if give_up_after is not None else (agent.rpc_timeout or 60.0)
    end = time.monotonic() + limit
    interval = agent.options.control_retry_interval
    token = current_deadline.set(None)
    try:
        while True:
            if agent.liveness.is_lost(dst):  # no retry will reach it
                raise agent.liveness.error(dst, f"control message {method!r}")
            left = end - time.monotonic()
            deadline = time.monotonic() + min(interval, max(left, 1e-3))
            try:
                return await agent.call(
                    dst,
                    method,
                    payload,
                    deadline=deadline,
                    meta=None,
                    internal=True,
                    control=True,  # unordered: it holds no user call off the direct paths
                )
            except (RpcTimeoutError, TransportError) as e:
                if time.monotonic() >= end or agent.closed:
                    raise
                if not isinstance(e, RpcTimeoutError):
                    await asyncio.sleep(min(interval, max(end - time.monotonic(), 0)))
    finally:
        current_deadline.reset(token)
