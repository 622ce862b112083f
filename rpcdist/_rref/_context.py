"""Per-agent RRef state and the control messages of the ownership protocol.

Each agent gets one :class:`RRefContext`, its ``"rref"`` extension, with
its owner and user tables (:mod:`._rref_protocol`) and an *outbox* for control
messages. Control items (fork requests, child accepts, user deletes) are
queued from any thread without locks (so finalisers may queue deletes) and
flushed on the loop as one batched message per destination and kind (user
deletes wait up to ``DELETE_DELAY`` to gather), each idempotent and retried
until acknowledged (``Agent.send_control``).

Message kinds, each a list of items:

* ``rref.fork_request`` user -> owner, ``[r0, r1, f0, f1]``: register a fork.
* ``rref.child_accept`` -> the sender of a fork, ``[f1]``: the owner knows it.
  An owner that got the fork in a call's arguments says so in the call's
  reply instead (its field ``ACCEPTS``), unless that reply is never sent.
* ``rref.user_delete`` user -> owner, ``[r0, r1, f0, f1, abandon]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

from .._deadline import current_deadline
from .._errors import (
    ClosedError,
    ConnectError,
    OwnerLostError,
    RpcdistError,
    RpcTimeoutError,
    RRefError,
    WorkerLostError,
)
from .._futures import Future
from .._rpc._doctor import summary
from .._rpc._registry import BaseExtension
from .._rpc._shutdown import barrier_live
from .._worker import WorkerInfo
from ._protocol import Ids, OwnerTable, UserTable

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = [
    "ACCEPTS",
    "CHILD_ACCEPT",
    "CONFIRMED",
    "FAILED",
    "FAILED_ABANDON",
    "FAILED_DELETE",
    "FORK_REQUEST",
    "PENDING",
    "RELEASED",
    "USER_DELETE",
    "RRefContext",
    "accept_children",
    "context_of",
    "control_handlers",
    "gate",
]

_log = logging.getLogger(__name__)
T = TypeVar("T")

FORK_REQUEST: Final = "rref.fork_request"
CHILD_ACCEPT: Final = "rref.child_accept"
USER_DELETE: Final = "rref.user_delete"
#: Reply field: the forks of the caller's that the call's arguments brought
#: back to their owner, confirmed (``[f1, ...]``; flow 3 without a message).
ACCEPTS: Final = "rca"
#: Items per control message; more are split into several.
BATCH: Final = 4096
#: Seconds user deletes may wait to be batched (they only reclaim memory);
#: fork requests and child accepts, which others wait for, go out at once.
DELETE_DELAY: Final = 0.01

# A user RRef's state; what its finaliser sends is in the comment.
PENDING: Final = 0  # the owner has not confirmed its fork (held by the table)
CONFIRMED: Final = 1  # a delete
FAILED: Final = 2  # nothing (the owner never registered it, or is gone)
FAILED_DELETE: Final = 3  # a delete (the owner may have registered it)
FAILED_ABANDON: Final = 4  # an abandon-delete (its remote() timed out)
RELEASED: Final = 5  # nothing (deleted by shutdown)

#: A shutdown waiting for the outbox looks again this often even unpoked.
_RECHECK: Final = 0.05


def context_of(agent: Agent) -> RRefContext:
    """The RRef state of ``agent`` (installed when the agent was made).

    Raises:
        RRefError: it was not (an agent made without its built-in extensions).
    """
    ctx = agent.registry.extensions.get("rref")
    if not isinstance(ctx, RRefContext):
        raise RRefError(f"the rpcdist agent {agent.name!r} has no RRef support installed")
    return ctx


class RRefContext(BaseExtension):
    """One agent's RRef tables, control outbox and lifecycle (its ``"rref"`` extension)."""

    name = "rref"

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.ids = Ids(agent.rank, fresh=agent.dynamic)
        self.owners = OwnerTable(tombstone_ttl=max(300.0, 2 * (agent.rpc_timeout or 60.0)))
        self.users = UserTable()
        #: Ranks found lost, each with the worker that was (see :meth:`is_lost`).
        self.lost: dict[int, WorkerInfo] = {}
        self.closed = False
        self.leak_error: RRefError | None = None
        self._queue: deque[tuple[int, str, list[Any]]] = deque()
        self._soon = False  # a flush is scheduled now
        self._later = False  # a flush is scheduled DELETE_DELAY from now
        self._unacked = 0  # items flushed but not acknowledged yet (loop only)
        self.control_messages = 0
        self.control_items = 0
        self.control_failures = 0
        #: Set (on the loop) whenever the outbox or the user table may have
        #: become idle; :meth:`wait_until` waits on it.
        self._changed: asyncio.Event | None = None

    # ------------------------------------------------------------ any thread

    def check_open(self, what: str) -> None:
        """Raises: ClosedError: the agent has shut down."""
        if self.closed or self.agent.closed:
            raise ClosedError(
                f"{what}: the rpcdist agent {self.agent.name!r} has shut down; "
                "RRefs cannot be used after shutdown"
            )

    def worker(self, rank: int) -> WorkerInfo:
        return self.agent.workers[rank]

    def post(self, dst: int, method: str, item: list[Any]) -> None:
        """Queue a control item for ``dst``; any thread, lock-free (finaliser-safe)."""
        self._queue.append((dst, method, item))
        try:
            if method != USER_DELETE:
                if not self._soon:
                    self._soon = True
                    self.agent.loop.call_soon_threadsafe(self._flush)
            elif not self._later:
                self._later = True
                self.agent.loop.call_soon_threadsafe(self._arm_later)
        except RuntimeError:  # the loop has stopped: the agent is gone
            pass

    def lost_error(
        self, rank: int, what: str, cause: BaseException | None = None
    ) -> OwnerLostError:
        detail = f" ({cause})" if cause is not None else ""
        return OwnerLostError(
            f"{what}: the owner {self.worker(rank).name!r} is gone (worker lost){detail}"
        )

    def is_lost(self, rank: int) -> bool:
        """Whether the worker of ``rank`` is one found lost: not so once a new
        process took its rank (a dynamic group's table then holds a new
        ``WorkerInfo`` for it; a fixed job's never changes)."""
        gone = self.lost.get(rank)
        return gone is not None and gone is self.worker(rank)

    def mark_lost(self, rank: int) -> None:
        """``rank`` is gone: fail RRefs waiting on it or owned by it (for good:
        a new process may take its rank) and drop forks it held."""
        if rank == self.agent.rank or self.is_lost(rank):
            return
        self.lost[rank] = self.worker(rank)
        err = self.lost_error(rank, "RRef confirmation")
        for fid in self.users.pending_of(rank):
            self.settle(fid, FAILED, err)
        for fid in self.users.children_of(rank):
            self.users.accept_child(fid)
        for rref in self.users.live_users():
            if rref._owner == rank and rref._error is None:
                rref._error = self.lost_error(rank, f"using {rref!r}")
                rref._state = FAILED  # (its finaliser sends nothing)
        dropped = self.owners.forget_holder(rank)
        del dropped
        self.poke()

    def bounded(self, fut: Future[T], deadline: float | None, what: str) -> Future[T]:
        """A Future with ``fut``'s outcome, or failing with RpcTimeoutError at ``deadline``."""
        out: Future[T] = Future()
        loop = self.agent.loop
        timer: list[asyncio.TimerHandle] = []

        def finish(f: Future[T] | None, exc: BaseException | None = None) -> None:
            for t in timer:  # let go of what the timer holds (``out``), now
                loop.call_soon_threadsafe(t.cancel)
            timer.clear()
            try:
                if f is not None and f.exception() is None:
                    out.set_result(f.value())
                else:
                    out.set_exception(exc if f is None else f.exception())  # type: ignore[arg-type]
            except RuntimeError:  # the other side finished it first
                pass

        def expire() -> None:
            if not out.done():
                info = self.agent.debug_info()
                finish(
                    None,
                    RpcTimeoutError(
                        f"{what} did not finish before its deadline; {summary(info)}", snapshot=info
                    ),
                )

        def arm() -> None:
            if not out.done():
                timer.append(loop.call_at(deadline, expire))  # type: ignore[arg-type]

        if deadline is not None:
            try:
                loop.call_soon_threadsafe(arm)
            except RuntimeError:
                finish(None, RpcTimeoutError(f"{what}: the agent has shut down"))
        fut.add_done_callback(finish)
        return out

    # ------------------------------------------------------------- the loop

    def _arm_later(self) -> None:
        self.agent.loop.call_later(DELETE_DELAY, self._flush_later)

    def _flush_later(self) -> None:
        self._later = False
        self._flush()

    def _flush(self) -> None:
        self._soon = False
        groups: dict[tuple[int, str], list[list[Any]]] = {}
        q = self._queue
        while q:
            dst, method, item = q.popleft()
            groups.setdefault((dst, method), []).append(item)
        if self.agent.closed:
            return
        for (dst, method), items in groups.items():
            for i in range(0, len(items), BATCH):
                chunk = items[i : i + BATCH]
                self._unacked += len(chunk)
                self.agent.spawn(self._send(dst, method, chunk))

    async def _send(self, dst: int, method: str, items: list[list[Any]]) -> None:
        current_deadline.set(None)  # control messages have their own retry budget
        try:
            if self.is_lost(dst):
                raise self.lost_error(dst, method)
            self.control_messages += 1
            self.control_items += len(items)
            await self.agent.send_control(dst, method, items)
        except RpcdistError as e:
            self.control_failures += 1
            if isinstance(e, WorkerLostError | ConnectError):
                self.mark_lost(dst)
            _log.debug("%s to worker %d failed: %s", method, dst, e)
            if method == FORK_REQUEST:
                self._forks_failed(dst, items, e)
        else:
            if method == FORK_REQUEST:
                self._forks_confirmed(items)
        finally:
            self._unacked -= len(items)
            self.poke()

    def poke(self) -> None:
        """Something a shutdown may wait for changed (any thread)."""
        changed = self._changed
        if changed is None:
            return
        loop = self.agent.loop
        try:
            if self.agent.in_loop_thread():
                changed.set()
            else:
                loop.call_soon_threadsafe(changed.set)
        except RuntimeError:  # the loop has stopped
            pass

    async def wait_until(self, cond: Callable[[], bool], limit: float) -> None:
        """Wait (on the loop) until ``cond()`` holds, at most ``limit`` seconds.

        Woken by :meth:`poke`; it also looks again every ``_RECHECK`` seconds,
        for changes made where nothing pokes (an RRef's finaliser).
        """
        if self._changed is None:
            self._changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        end = loop.time() + limit
        while not cond():
            left = end - loop.time()
            if left <= 0:
                return
            self._changed.clear()
            try:
                async with asyncio.timeout(min(left, _RECHECK)):
                    await self._changed.wait()
            except TimeoutError:
                pass

    def settle(self, fid: tuple[int, int], state: int, error: BaseException | None = None) -> None:
        entry = self.users.settle(fid, state, error)
        self.poke()
        if entry is None:
            return
        rref, parent = entry
        if error is None:
            rref._confirmed.set_result(None)
        else:
            rref._confirmed.set_exception(error)
        if parent is not None:  # the sender of the fork may let go of its RRef
            self.post(parent, CHILD_ACCEPT, [fid[1]])

    def _forks_confirmed(self, items: list[list[Any]]) -> None:
        for it in items:
            self.settle((it[2], it[3]), CONFIRMED)

    def _forks_failed(self, dst: int, items: list[list[Any]], exc: RpcdistError) -> None:
        if self.is_lost(dst):
            err: RRefError = self.lost_error(dst, "RRef fork request", exc)
        else:
            err = RRefError(
                f"the owner {self.worker(dst).name!r} did not confirm an RRef fork: {exc}"
            )
        for it in items:
            self.settle((it[2], it[3]), FAILED_DELETE, err)

    def idle(self) -> bool:
        """No control item is queued or unacknowledged."""
        return not self._queue and self._unacked == 0

    def release_users(self) -> None:
        """Delete every user RRef still alive here (shutdown); they become unusable."""
        for rref in self.users.live_users():
            if rref._state in (CONFIRMED, FAILED_DELETE, FAILED_ABANDON):
                abandon = int(rref._state == FAILED_ABANDON)
                self.post(rref._owner, USER_DELETE, [*rref._rid, *rref._fork, abandon])
            rref._state = RELEASED

    async def drain(self) -> None:
        """Graceful shutdown, RRef part (``docs/rref.md``, flow 6)."""
        await _drain(self)

    def peer_lost(self, rank: int) -> None:
        """Worker ``rank`` was declared lost: RRefs it owns fail at once."""
        self.mark_lost(rank)

    def check(self) -> None:
        """Raises: RRefError: the drain found leaked RRefs."""
        if self.leak_error is not None:
            raise self.leak_error

    def statistics(self) -> dict[str, int]:
        stats = self.owners.statistics()
        stats.update(self.users.statistics())
        stats["rref_outbox"] = len(self._queue) + self._unacked
        stats["rref_control_messages"] = self.control_messages
        stats["rref_control_items"] = self.control_items
        stats["rref_control_failures"] = self.control_failures
        return stats


def gate(agent: Agent, fut: Future[Any]) -> asyncio.Future[None]:
    """An asyncio future on the agent loop, done when ``fut`` is (call on the loop).

    A future rather than a coroutine, so that an unawaited gate (replies are
    not gated) is harmless; the dispatcher bounds the wait by the deadline.
    """
    loop = agent.loop
    out: asyncio.Future[None] = loop.create_future()

    def finish(exc: BaseException | None) -> None:
        if not out.done():
            out.set_result(None) if exc is None else out.set_exception(exc)

    def on_done(f: Future[Any]) -> None:
        try:
            loop.call_soon_threadsafe(finish, f.exception())
        except RuntimeError:  # the loop has stopped
            pass

    out.add_done_callback(lambda o: o.cancelled() or o.exception())  # mark retrieved
    fut.add_done_callback(on_done)
    return out


# ------------------------------------------------------------- control handlers


async def _on_fork_request(agent: Agent, src: WorkerInfo, items: list[list[int]]) -> None:
    owners = context_of(agent).owners
    for r0, r1, f0, f1 in items:
        owners.add_fork(owners.record((r0, r1)), (f0, f1), src.id)


def accept_children(agent: Agent, children: list[int]) -> None:
    """The owner confirmed these forks this worker sent (``f1`` of each; any thread)."""
    ctx = context_of(agent)
    parents = [ctx.users.accept_child((agent.rank, c)) for c in children]
    del parents  # now collectable: their finalisers send deletes
    ctx.poke()


async def _on_child_accept(agent: Agent, src: WorkerInfo, items: list[list[int]]) -> None:
    accept_children(agent, [it[0] for it in items])


async def _on_user_delete(agent: Agent, src: WorkerInfo, items: list[list[int]]) -> None:
    owners = context_of(agent).owners
    dropped = [
        owners.remove_fork((r0, r1), (f0, f1), abandon=bool(ab)) for r0, r1, f0, f1, ab in items
    ]
    del dropped  # values no fork holds any more are freed here, outside the lock


# ---------------------------------------------------------------------- shutdown


def control_handlers() -> dict[str, Any]:
    """The control methods of the ownership protocol, by name."""
    return {
        FORK_REQUEST: _on_fork_request,
        CHILD_ACCEPT: _on_child_accept,
        USER_DELETE: _on_user_delete,
    }


async def _drain(ctx: RRefContext) -> None:
    agent = ctx.agent
    limit = agent.options.shutdown_timeout
    many = agent.world_size > 1 and agent.store is not None
    if many:  # every live worker has stopped making new RRefs
        await barrier_live(agent, "rpcdist/rref/shutdown", limit)
    await ctx.wait_until(lambda: not ctx.users.busy() and ctx.idle(), limit / 4)
    ctx.release_users()
    await ctx.wait_until(ctx.idle, limit / 4)
    if many:  # every live worker's deletes are acknowledged: owners have drained
        await barrier_live(agent, "rpcdist/rref/released", limit)
    ctx.closed = True
    if agent.options.ignore_rref_leaks:
        return
    leaks = ctx.owners.leftovers()
    stats = ctx.users.statistics()
    stuck = stats["rref_pending_users"] + stats["rref_pending_children"]
    if leaks or stuck:
        shown = "; ".join(
            f"RRef {rid} held by " + ", ".join(ctx.worker(h).name for h in holders)
            for rid, holders in leaks[:5]
        )
        ctx.leak_error = RRefError(
            f"graceful shutdown of {agent.name!r} found leaked RRefs: {len(leaks)} values "
            f"owned here are still referenced by undeleted forks{': ' + shown if shown else ''}; "
            f"{stuck} user RRefs were never confirmed. (RpcOptions(ignore_rref_leaks=True) "
            "skips this check.)"
        )
