"""The bounded thread pool that runs plain (non-``async``) handlers.

A :class:`concurrent.futures.Executor` (so ``loop.run_in_executor`` takes it)
with one addition, :meth:`WorkerPool.post`: fire-and-forget work with no
Future. The dispatcher posts each plain call, and the pool thread sends the
reply itself, so nobody waits on a Future there. ``ThreadPoolExecutor.submit``
builds a Future, a work item and a semaphore check per call; on the 2-core
machine of docs/benchmarks.md that measured about 18 us of the loop's time
per call, against a few for :meth:`post`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["WorkerPool"]

_log = logging.getLogger(__name__)
T = TypeVar("T")

#: Tells a worker thread to exit.
_STOP = None
#: ``(fn, args, future)``: the future (of :meth:`WorkerPool.submit`) is
#: cancelled if the item is dropped at shutdown.
_Item = tuple[Callable[..., Any], tuple[Any, ...], "concurrent.futures.Future[Any] | None"]


class WorkerPool(concurrent.futures.Executor):
    """At most ``max_workers`` threads, started as work arrives and kept.

    A thread is added when work is posted and every thread is busy, up to
    the bound; beyond it, work waits in arrival order.
    """

    def __init__(self, max_workers: int, name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max = max_workers
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
            if self._waiting_work > self._idle and len(self._threads) < self._max:
                t = threading.Thread(
                    target=self._work,
                    name=f"{self._prefix}_{len(self._threads)}",
                    daemon=True,
                )
                t.start()
                self._threads.append(t)
        # Outside the lock: the woken thread takes it at once.
        self._queue.put(item)

    def _work(self) -> None:
        q = self._queue
        lock = self._lock
        with lock:
            self._idle += 1
        while True:
            item = q.get()
            with lock:
                self._idle -= 1
                if item is _STOP:
                    return
                self._waiting_work -= 1
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
                self._idle += 1
                handoff = self._release_slot()
            if handoff:
                self._handoff.release()

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
            return True

    def give_back(self) -> None:
        """Return a slot taken with :meth:`try_borrow`."""
        with self._lock:
            handoff = self._release_slot()
        if handoff:
            self._handoff.release()

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


def _run_into(fut: concurrent.futures.Future[Any], fn: Callable[..., Any], args: Any,
              kwargs: Any) -> None:  # fmt: skip
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
