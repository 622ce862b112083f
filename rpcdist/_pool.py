"""The bounded thread pool that runs plain (non-``async``) handlers.

A :class:`concurrent.futures.Executor` (so ``loop.run_in_executor`` takes it)
with one addition, :meth:`WorkerPool.post`: fire-and-forget work with no
Future. The dispatcher posts each plain call, and the pool thread sends the
reply itself, so nobody waits on a Future there. ``ThreadPoolExecutor.submit``
builds a Future, a work item and a semaphore check per call; on the 2-core
machine of docs/benchmarks.md that measured about 18 us of the loop's time
per call, against a few for :meth:`post`.

Managed blocking: a thread running the pool's work that is about to wait
for a nested call (``rpc_sync`` or ``Future.wait`` inside a handler) says
so with :func:`blocking`. While it waits it counts against neither bound,
so the pool starts another thread for queued work if it has none idle, up
to ``max_grown`` threads in all (a thread beyond ``max_workers`` leaves
once the blocked ones are back); nested blocking calls then cannot take
every thread and wait for work that none is left to run. Past that bound
the pool is *exhausted*: it logs a warning naming the blocked handlers and
the calls they wait on, and :meth:`WorkerPool.debug_info` says so (the
agent's timeout errors carry it).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["GROWTH", "WorkerPool", "blocking"]

_log = logging.getLogger(__name__)
T = TypeVar("T")

#: Tells a worker thread to exit.
_STOP = None
#: ``(fn, args, future)``: the future (of :meth:`WorkerPool.submit`) is
#: cancelled if the item is dropped at shutdown.
_Item = tuple[Callable[..., Any], tuple[Any, ...], "concurrent.futures.Future[Any] | None"]
#: The default ``max_grown``: this many times ``max_workers``.
GROWTH = 4
#: ``pool``: the pool whose work the current thread runs (its own threads,
#: and a thread while it holds a borrowed slot); ``own``: one of its threads.
_here = threading.local()


def blocking(waits_on: object) -> WorkerPool | None:
    """The calling thread is about to wait for ``waits_on`` (a description,
    or what the pool's ``describe`` hook makes one of): if it runs a pool's
    work, the pool lets another thread take queued work meanwhile. Returns
    that pool, whose :meth:`WorkerPool.unblocked` the caller must call once
    the wait is over, or None (nothing to do)."""
    pool: WorkerPool | None = getattr(_here, "pool", None)
    if pool is not None:
        pool._block(waits_on)
    return pool


class WorkerPool(concurrent.futures.Executor):
    """At most ``max_workers`` threads, started as work arrives and kept.

    A thread is added when work is posted and every thread is busy, up to
    the bound; beyond it, work waits in arrival order.
    """

    def __init__(self, max_workers: int, name_prefix: str, *, max_grown: int | None = None) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max = max_workers
        #: Most threads while some are blocked in nested calls.
        self._cap = max(max_workers, GROWTH * max_workers if max_grown is None else max_grown)
        #: Threads blocked in nested calls (:func:`blocking`): ident ->
        #: ``[thread name, ident, what it waits on, since]``; how many
        #: are this pool's own threads; the most threads so far; what was
        #: said when the pool was found exhausted, kept until no work waits
        #: and no thread is blocked (so that the errors of the calls it held
        #: up say it too).
        self._parked: dict[int, list[Any]] = {}
        self._parked_own = 0
        self._high = max_workers
        self._exhausted = ""
        self._named = 0
        #: Set by the pool's owner, for the warnings and :meth:`debug_info`
        #: (only when they are made, from any thread): ``describe(ident,
        #: waits_on) -> (what blocked thread ``ident`` runs, what it waits on)``.
        self.describe: Callable[[int, object], tuple[str, str]] | None = None
        self._prefix = name_prefix
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        #: Work posted and not yet taken by a thread, and threads waiting for work.
        self._waiting_work = 0
        self._idle = 0
        self._shut = False
        #: Work running now, on pool threads or on borrowed slots (at most
        #: ``max_workers``); pool threads holding work but waiting for a slot
        #: (only while slots are borrowed), and how a slot is handed to one.
        self._active = 0
        self._blocked = 0
        self._handoff = threading.Semaphore(0)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a pool thread; exceptions it raises are logged.

        Raises:
            RuntimeError: the pool was shut down.
        """
        self._put((fn, args, None))

    def submit(  # type: ignore[override]
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Schedule ``fn(*args, **kwargs)``; its Future gets the result.

        Raises:
            RuntimeError: the pool was shut down.
        """
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._put((_run_into, (fut, fn, args, kwargs), fut))
        return fut

    def _put(self, item: _Item) -> None:
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule work on a pool that was shut down")
            self._waiting_work += 1
            warn = None
            if (
                self._waiting_work > self._idle
                and len(self._threads) - self._parked_own < self._max
            ):
                warn = self._event(self._grow())
        # Outside the lock: the woken thread takes it at once.
        self._queue.put(item)
        if warn:
            self._warn(*warn)

    def _grow(self) -> bool | None:
        """Start a thread (holding ``_lock``), unless ``max_grown`` are running:
        True if it is one beyond ``max_workers``, False if not, None if none."""
        if len(self._threads) >= self._cap:
            return None
        t = threading.Thread(target=self._work, name=f"{self._prefix}_{self._named}", daemon=True)
        self._named += 1
        t.start()
        self._threads.append(t)
        return len(self._threads) > self._max

    def _work(self) -> None:
        q = self._queue
        lock = self._lock
        _here.pool, _here.own = self, True
        with lock:
            self._idle += 1
        while True:
            item = q.get()
            with lock:
                self._idle -= 1
                if item is _STOP:
                    return
                self._waiting_work -= 1
                if self._exhausted and not (self._waiting_work or self._parked):
                    self._exhausted = ""
                wait = self._active >= self._max  # only while slots are borrowed
                if wait:
                    self._blocked += 1
                else:
                    self._active += 1
            if wait:
                self._handoff.acquire()  # give_back() hands us its slot
            fn, args = item[0], item[1]
            try:
                fn(*args)
            except BaseException:
                _log.exception("rpcdist pool task %r raised", fn)
            # Drop every reference before waiting again: an idle thread must
            # not keep the last call's arguments or result (RRefs) alive.
            del item, fn, args
            with lock:
                handoff = self._release_slot()
                # A thread the pool grew by leaves once it is not needed.
                surplus = len(self._threads) - self._parked_own > self._max
                if surplus:
                    self._threads.remove(threading.current_thread())
                else:
                    self._idle += 1
            if handoff:
                self._handoff.release()
            if surplus:
                return

    def _release_slot(self) -> bool:
        """A slot is free (holding ``_lock``): True if it goes to a blocked thread."""
        if self._blocked:
            self._blocked -= 1
            return True
        self._active -= 1
        return False

    def try_borrow(self) -> bool:
        """Take one of the ``max_workers`` slots to run work on the calling
        thread, if one is free and no posted work waits for it; False if not.

        While borrowed, the slot counts as running work: pool threads run at
        most ``max_workers`` minus the borrowed slots. Return it with
        :meth:`give_back`.
        """
        with self._lock:
            if self._shut or self._active >= self._max or self._waiting_work or self._blocked:
                return False
            self._active += 1
        _here.pool, _here.own = self, False
        return True

    def give_back(self) -> None:
        """Return a slot taken with :meth:`try_borrow`."""
        _here.pool = None
        with self._lock:
            handoff = self._release_slot()
        if handoff:
            self._handoff.release()

    # ------------------------------------------------------------ blocking

    def _block(self, waits_on: object) -> None:
        """:func:`blocking`: the calling thread gives up its slot (to a thread
        waiting for one) and counts against no bound until :meth:`unblocked`;
        a thread is started for queued work that no idle thread will take."""
        me = threading.current_thread()
        own = bool(getattr(_here, "own", False))
        with self._lock:
            self._parked[me.ident or 0] = [me.name, me.ident, waits_on, time.monotonic()]
            if own:
                self._parked_own += 1
            handoff = self._release_slot()
            warn = None
            if (
                self._waiting_work > self._idle
                and len(self._threads) - self._parked_own < self._max
                and not self._shut
            ):
                warn = self._event(self._grow())
        if handoff:
            self._handoff.release()
        if warn:
            self._warn(*warn)

    def unblocked(self) -> None:
        """The wait :func:`blocking` announced is over: the thread runs again
        (taking a slot back at once, even if that exceeds ``max_workers``
        for a while: it holds work that is half done)."""
        with self._lock:
            if self._parked.pop(threading.get_ident(), None) is None:
                return
            if getattr(_here, "own", False):
                self._parked_own -= 1
            self._active += 1
            if self._exhausted and not (self._waiting_work or self._parked):
                self._exhausted = ""

    def _event(self, grown: bool | None) -> tuple[bool, list[list[Any]], int, int] | None:
        """After trying to start a thread for queued work while some are
        blocked (holding ``_lock``): ``(exhausted, blocked, threads, queued)``
        to warn of, if the pool grew past its highest yet (``grown``) or
        could not grow (None) and is exhausted; None if nothing to say."""
        if not self._parked:
            return None
        n = len(self._threads)
        if grown:
            if n <= self._high:
                return None
            self._high = n
        elif grown is None and not self._exhausted and n == self._parked_own:
            self._exhausted = self._exhausted_text([], n, self._waiting_work)
        else:
            return None
        return grown is None, list(self._parked.values()), n, self._waiting_work

    def _warn(self, exhausted: bool, blocked: list[list[Any]], threads: int, queued: int) -> None:
        """Log an :meth:`_event` (not holding ``_lock``: describing the
        blocked handlers reads their stacks and the agent's tables)."""
        if not exhausted:
            _log.warning(
                "rpcdist handler pool %r grew to %d threads (num_worker_threads=%d, at most %d): "
                "%s while calls wait to be handled",
                self._prefix,
                threads,
                self._max,
                self._cap,
                self._blocked_text(blocked),
            )
            return
        text = self._exhausted_text(blocked, threads, queued)
        with self._lock:
            if self._exhausted:  # (the errors of the calls held up say it too)
                self._exhausted = text
        _log.warning("%s", text)

    def _describe(self, parked: list[Any]) -> tuple[str, str]:
        """What a blocked thread runs and what it waits on."""
        how = self.describe
        if how is None:
            return f"thread {parked[0]}", str(parked[2])
        return how(parked[1], parked[2])

    def _blocked_text(self, blocked: list[list[Any]]) -> str:
        parked = sorted(blocked, key=lambda p: p[3])
        shown = []
        for p in parked[:4]:
            running, what = self._describe(p)
            shown.append(f"{running} (thread {p[0]}) waits on {what}")
        more = f" and {len(parked) - 4} more" if len(parked) > 4 else ""
        return f"{len(parked)} handlers blocked in nested blocking calls: {', '.join(shown)}{more}"

    def _exhausted_text(self, blocked: list[list[Any]], threads: int, queued: int) -> str:
        which = f" ({self._blocked_text(blocked)})" if blocked else ""
        return (
            f"handler pool exhausted: all {threads} threads of {self._prefix!r} are taken"
            f"{which} and {queued} calls wait to be handled; raise init_rpc's "
            f"num_worker_threads (now {self._max}; the pool grows to {self._cap} while "
            f"handlers block), make the handlers `async def`, or use rpc_async in them "
            f"instead of blocking"
        )

    def debug_info(self) -> dict[str, Any]:
        """Threads, blocked handlers and queued work now (any thread); with
        ``exhausted``, the text saying so and what to do about it."""
        with self._lock:
            now = time.monotonic()
            parked = sorted(self._parked.values(), key=lambda p: p[3])
            info: dict[str, Any] = {
                "threads": len(self._threads),
                "max_workers": self._max,
                "max_grown": self._cap,
                "queued": self._waiting_work,
            }
            exhausted = self._exhausted
        info["blocked"] = []
        for p in parked:
            running, what = self._describe(p)
            info["blocked"].append(
                {
                    "thread": p[0],
                    "running": running,
                    "waits_on": what,
                    "age_s": round(now - p[3], 3),
                }
            )
        if exhausted:
            info["exhausted"] = exhausted
        return info

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; with ``cancel_futures``, drop work not started yet.

        Work already started finishes; ``wait`` joins the threads.
        """
        with self._lock:
            if not self._shut:
                self._shut = True
                if cancel_futures:
                    while True:
                        try:
                            item = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if item is not _STOP:
                            self._waiting_work -= 1
                            if item[2] is not None:
                                item[2].cancel()
                for _ in self._threads:
                    self._queue.put(_STOP)
            threads = list(self._threads)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()


def _run_into(
    fut: concurrent.futures.Future[Any], fn: Callable[..., Any], args: Any, kwargs: Any
) -> None:
    """``fut``'s outcome is ``fn(*args, **kwargs)``."""
    if not fut.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:
        fut.set_exception(e)
        # The error's traceback holds this frame, which must not hold ``fut``
        # (that holds the error): a cycle only the collector would free.
        fut = None  # type: ignore[assignment]
    else:
        fut.set_result(result)
