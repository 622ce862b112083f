"""Process groups: membership, the per-group sequence and op execution.

Every collective on a group gets the next sequence number when it is
issued (on every member, in the same order) and runs strictly in that
order, one at a time:

* a blocking call on an idle group runs at once on the calling thread;
* otherwise (``async_op=True``, or ops still queued) it waits in the
  group's queue for the group's worker thread.

The shared-memory engine runs on that thread itself (blocking waits on its
doorbell); the message-ring and NCCL engines are coroutines, run on the agent loop
with :meth:`ProcessGroup.run_async`. Either way a watchdog ends the op with
an error on:

* the group's timeout (``RpcTimeoutError``);
* a same-host peer process that died (``CollectiveError``, found through
  ``/proc`` within ``CHECK_PERIOD`` seconds);
* a member the failure detector declared lost (``CollectiveError`` naming
  it): an op waiting longer than ``CHECK_PERIOD`` makes the detector watch
  every member (it keeps a link to each, heartbeats flow on it), so a hung
  or stopped member is found by the same detector, with the same window, as
  in every other layer and on every backend (shared memory has no links of
  its own, and the ring's sockets stay open to a stopped process);
* an abort sent by a peer that failed (``CollectiveError``).

A failed collective leaves messages or shared-memory state half-way, so the
group is then *broken*: the failing rank tells every member (internal call
``collectives.abort``), and every later collective on the group fails at
once. Destroy it and start again.

Running shared-memory ops on the caller's thread instead of the loop
saves two thread hand-offs per op, most of a small op's time (see
``docs/collectives.md``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing.util
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import (
    ClosedError,
    CollectiveError,
    RpcdistError,
    RpcTimeoutError,
    TransportError,
)
from .._futures import Future
from .._rpc._doctor import summary
from .._worker import WorkerInfo
from ._shm import CHECK_PERIOD
from ._work import Work

if TYPE_CHECKING:
    from .._rpc._agent import Agent
    from ._types import CollectivesView

__all__ = ["ABORT", "ProcessGroup", "on_abort"]

#: The internal method a failing rank tells the others with.
ABORT = "collectives.abort"

_log = logging.getLogger(__name__)
T = TypeVar("T")
Body = Callable[[int], Any]


#: Failure notices still on their way to the other members. A member that
#: fails a collective and exits at once waits for them a moment as it exits
#: (a normal exit, or a multiprocessing child's), so the others learn the
#: cause (a lost rank), not only that this member left.
_NOTICES: set[threading.Event] = set()
#: Longest an exit waits for them (seconds).
NOTICE_GRACE = 2.0
#: The process that registered the wait (a forked child registers its own).
_waiting_in: list[int] = []


def _sending(notice: threading.Event) -> None:
    _NOTICES.add(notice)
    if _waiting_in != [os.getpid()]:
        _waiting_in[:] = [os.getpid()]
        # (run at interpreter exit, and by multiprocessing children, which
        # leave with os._exit and so skip plain atexit functions)
        multiprocessing.util.Finalize(None, _deliver_notices, exitpriority=100)


def _delivered(notice: threading.Event, _task: object = None) -> None:
    _NOTICES.discard(notice)
    notice.set()


def _deliver_notices() -> None:
    end = time.monotonic() + NOTICE_GRACE
    for notice in list(_NOTICES):
        notice.wait(max(0.0, end - time.monotonic()))


@dataclass(eq=False, slots=True)
class _Op:
    seq: int
    name: str
    body: Body
    future: Future[Any]


class ProcessGroup:
    """A set of ranks that run collectives together (``new_group`` returns one).

    Attributes:
        ranks: The members' global ranks, in group-rank order.
        rank: This process's rank in the group, ``-1`` for a non-member.
        size: Number of members.
        backend: ``"shm"`` or ``"ring"`` (the path for NumPy buffers);
            ``""`` on non-members.
    """

    __module__ = "rpcdist.collectives"

    def __init__(
        self, state: CollectivesView, gid: int, ranks: tuple[int, ...], timeout: float | None
    ) -> None:
        self._state = state
        self.gid = gid
        self.ranks = ranks
        me = state.agent.rank
        self.rank = ranks.index(me) if me in ranks else -1
        self.size = len(ranks)
        self.timeout = timeout
        self.backend = ""
        #: The backend asked for ("auto", "shm", "ring" or "nccl").
        self.requested = ""
        self.engine: Any = None
        #: Lazily created per-group extra engines (NCCL), keyed by name.
        self.extra: dict[str, Any] = {}
        self.prefix = f"{state.tag}.{gid}/"
        self.broken: RpcdistError | None = None
        self.closed = False
        self._cv = threading.Condition()
        self._seq = 0
        self._queue: deque[_Op] = deque()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._op: _Op | None = None
        self._deadline: float | None = None
        self._task: asyncio.Task[Any] | None = None  # the coroutine op running on the loop
        self._stop: BaseException | None = None  # why the watchdog cancelled it
        self._timer: asyncio.TimerHandle | None = None
        self.queued = 0
        self.inflight = 0
        self.completed = 0
        self.failed = 0

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.gid} ranks={list(self.ranks)} backend={self.backend!r}>"

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    @property
    def state(self) -> CollectivesView:
        return self._state

    def describe(self) -> str:
        return (
            "the default group" if self.gid == 0 else f"group {self.gid} (ranks {list(self.ranks)})"
        )

    def check_member(self, what: str) -> None:
        """Raise unless this process belongs to the group and it is usable.

        Raises:
            CollectiveError: not a member.
            ClosedError: the group was destroyed.
        """
        if self.closed:
            raise ClosedError(f"{what}: {self.describe()} was destroyed")
        if self.rank < 0:
            raise CollectiveError(
                f"{what}: rank {self._state.agent.rank} is not a member of {self.describe()}; "
                "only members may call its collectives"
            )

    def group_rank(self, global_rank: int, what: str) -> int:
        """The group rank of ``global_rank``.

        Raises:
            CollectiveError: it is not a member (an invalid root or peer).
        """
        if isinstance(global_rank, bool) or not isinstance(global_rank, int):
            raise CollectiveError(f"{what}: a rank must be an int, got {global_rank!r}")
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise CollectiveError(
                f"{what}: rank {global_rank} is not a member of {self.describe()}"
            ) from None

    # ------------------------------------------------------------ issuing

    def submit(self, name: str, body: Body, async_op: bool) -> Any:
        """Run a collective in issue order; block for it unless ``async_op``.

        ``body(seq)`` runs on the executing thread (the caller's or the
        group's worker) and returns the op's result.

        Raises:
            WrongThreadError: a blocking call on the agent's loop thread.
            ClosedError: the group or agent was shut down.
        """
        agent = self._state.agent
        if not async_op:
            agent.check_not_loop_thread(f"{name}()")
        fut: Future[Any] = Future()
        with self._cv:
            if self.closed or agent.closed:
                raise ClosedError(f"{name}: {self.describe()} was destroyed")
            op = _Op(self._seq, name, body, fut)
            self._seq += 1
            inline = not async_op and not self._queue and not self._busy
            if inline:
                self._busy = True
                self.inflight = 1
            else:
                self._queue.append(op)
                self.queued += 1
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._worker,
                        name=f"rpcdist-coll-{agent.name}-g{self.gid}",
                        daemon=True,
                    )
                    self._thread.start()
                self._cv.notify_all()
        if inline:
            try:
                self._execute(op)
            finally:
                with self._cv:
                    self._busy = False
                    self.inflight = 0
                    self._cv.notify_all()
        if async_op:
            return Work(fut, f"{name} #{op.seq}")
        fut.wait()
        return None

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self.closed and (not self._queue or self._busy):
                    self._cv.wait()
                if self.closed:
                    return
                op = self._queue.popleft()
                self.queued -= 1
                self._busy = True
                self.inflight = 1
            try:
                self._execute(op)
            finally:
                with self._cv:
                    self._busy = False
                    self.inflight = 0
                    self._cv.notify_all()

    # ----------------------------------------------------------- executing

    def _execute(self, op: _Op) -> None:
        where = f"{op.name} #{op.seq} on {self.describe()}"
        self._op = op
        self._deadline = None if not self.timeout else time.monotonic() + self.timeout
        try:
            if self.broken is not None:
                raise CollectiveError(
                    f"{where}: the group is unusable after an earlier failure: {self.broken}"
                )
            value = op.body(op.seq)
        except ClosedError as e:
            self.failed += 1
            op.future.set_exception(e)
        except BaseException as e:
            self.failed += 1
            op.future.set_exception(self._fail(op, e, where))
        else:
            self.completed += 1
            op.future.set_result(value)
        finally:
            self._op = None

    def check(self, full: bool = True) -> None:
        """Raise if the running op must end: shut down, aborted, a dead peer, timed out.

        Raises:
            ClosedError: the group was destroyed.
            CollectiveError: a peer aborted or died.
            RpcTimeoutError: the op's timeout passed.
        """
        op = self._op
        where = f"{op.name} #{op.seq} on {self.describe()}" if op else self.describe()
        if self.closed:
            raise ClosedError(f"{where}: the group was destroyed")
        if self.broken is not None:
            raise self.broken
        if not full:
            return
        dead = self._state.dead_peers(self.ranks)
        self._state.watch(self.ranks)  # a blocked op: the detector watches every member
        if dead:
            raise CollectiveError(f"{where}: rank(s) {dead} died during the collective")
        if self._deadline is not None and time.monotonic() >= self._deadline:
            info = self._state.agent.debug_info()
            raise RpcTimeoutError(
                f"{where} timed out after {self.timeout} s; {summary(info)}", snapshot=info
            )

    def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the agent loop under the watchdog; block for it.

        Raises:
            RpcdistError: the coroutine's error, or the watchdog's (see :meth:`check`).
        """
        result: T = self._state.agent.run(self._guarded(coro), "a collective")
        return result

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.broken is not None:
            coro.close()
            raise self.broken
        loop = asyncio.get_running_loop()
        self._task, self._stop = asyncio.current_task(), None
        self._timer = loop.call_later(CHECK_PERIOD, self._tick)
        try:
            return await coro
        except asyncio.CancelledError:
            # The watchdog or an abort stopped it, or its receives were withdrawn.
            if self._stop is not None or self.broken is not None:
                raise (self._stop or self.broken) from None
            raise
        finally:
            self._task = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _tick(self) -> None:
        """The watchdog of a coroutine op: every ``CHECK_PERIOD`` seconds (on the loop)."""
        task = self._task
        if task is None or task.done():
            return
        try:
            self.check(True)
        except BaseException as e:
            self._stop = e
            task.cancel()
            return
        self._timer = asyncio.get_running_loop().call_later(CHECK_PERIOD, self._tick)

    def _fail(self, op: _Op, e: BaseException, where: str) -> BaseException:
        """Translate an op's error, mark the group broken and tell the other members."""
        if isinstance(e, TransportError):
            err: BaseException = CollectiveError(f"{where} failed: {e}")
            err.__cause__ = e
        elif isinstance(e, RpcdistError) or not isinstance(e, Exception):
            err = e
        else:
            err = CollectiveError(f"{where} failed: {type(e).__name__}: {e}")
            err.__cause__ = e
        if self.broken is None and isinstance(err, RpcdistError):
            self.broken = err
            agent = self._state.agent
            payload = [self._state.tag, self.gid, op.seq, self.rank, str(err)]
            try:
                agent.loop.call_soon_threadsafe(self._after_failure, payload)
            except RuntimeError:
                pass
        return err

    def _after_failure(self, payload: list[Any]) -> None:
        agent = self._state.agent
        agent.mailbox.discard(self.prefix)
        for g in self.ranks:
            if g != agent.rank and not agent.closed and not agent.liveness.is_lost(g):
                notice = threading.Event()
                _sending(notice)
                agent.spawn(self._notify(g, payload)).add_done_callback(
                    functools.partial(_delivered, notice)
                )

    async def _notify(self, dst: int, payload: list[Any]) -> None:
        try:
            agent = self._state.agent
            deadline = time.monotonic() + 5.0
            await agent.call(dst, ABORT, payload, deadline=deadline, meta=None, internal=True)
        except RpcdistError as e:
            _log.debug("could not tell rank %d that a collective failed: %s", dst, e)

    def on_abort(self, seq: int, src: int, message: str) -> None:
        """A member reports that collective ``seq`` failed there (on the loop)."""
        self._break(
            CollectiveError(
                f"collective #{seq} on {self.describe()} failed on rank {self.ranks[src]}: {message}"
            )
        )

    def on_lost(self, rank: int, error: RpcdistError) -> None:
        """Member ``rank`` was declared lost (on the loop): the running and
        every later collective of the group fail, naming it."""
        op = self._op
        running = f" during {op.name} #{op.seq}" if op is not None else ""
        err = CollectiveError(f"{self.describe()} lost rank {rank}{running}: {error}")
        err.__cause__ = error
        first = self.broken is None
        self._break(err)
        if first:  # members that never talked to it hear it from us
            seq = op.seq if op is not None else self._seq
            self._after_failure([self._state.tag, self.gid, seq, self.rank, str(err)])

    def debug_info(self) -> dict[str, Any]:
        """This member's view of the group: sequence numbers, the running op."""
        op = self._op
        return {
            "ranks": list(self.ranks),
            "backend": self.backend,
            "issued": self._seq,
            "running": f"{op.name} #{op.seq}" if op is not None else None,
            "queued": self.queued,
            "completed": self.completed,
            "failed": self.failed,
            "broken": None if self.broken is None else str(self.broken),
        }

    def _break(self, err: CollectiveError) -> None:
        if self.broken is None:
            self.broken = err
            self._state.agent.mailbox.discard(self.prefix)
        if self._task is not None and not self._task.done():
            self._stop = self.broken
            self._task.cancel()
        self._interrupt()

    def _interrupt(self) -> None:
        for engine in [self.engine, *self.extra.values()]:
            fn = getattr(engine, "interrupt", None)
            if fn is not None:
                fn()

    def close(self) -> None:
        """Fail queued ops, stop the worker and release the engines (not on the loop)."""
        with self._cv:
            self.closed = True
            queued, self._queue = list(self._queue), deque()
            self.queued = 0
            self._cv.notify_all()
        err = ClosedError(f"{self.describe()} was destroyed")
        for op in queued:
            op.future.set_exception(err)
        self._interrupt()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._cv:
            while self._busy:  # an inline caller still runs: it sees ``closed`` soon
                self._cv.wait(CHECK_PERIOD)
        for engine in [self.engine, *self.extra.values()]:
            if engine is not None:
                engine.close()
        self.extra.clear()
        agent = self._state.agent
        if not agent.closed:
            try:
                agent.loop.call_soon_threadsafe(agent.mailbox.discard, self.prefix)
            except RuntimeError:
                pass


async def on_abort(agent: Agent, src: WorkerInfo, payload: Any) -> None:
    """A member of one of our groups failed a collective (internal method ``ABORT``)."""
    tag, gid, seq, rank, message = payload
    state: Any = agent.registry.extensions.get("collectives")  # a CollectiveState
    if state is None or state.tag != tag:
        return
    group = state.groups.get(gid)
    if group is not None and not group.closed:
        group.on_abort(seq, rank, message)
