"""A thread that, while it waits for a call, runs work other threads hand it.

A profiled distributed backward pass (:mod:`._backward`) runs on the
thread that called it, and torch's profiler records only that thread. The
part of the pass that the other workers' gradients start here (the local
send function's backward) arrives on a pool thread: it is handed to the
pass's thread, which is then waiting for the reply of the call that led to
it, so that the profile holds it as PyTorch's does. A thread that is busy
(not waiting) declines, and the work runs where it arrived: handing over
never makes work wait behind other work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .._futures import Future
from .._pool import blocking

__all__ = ["Host"]


class Host:
    """Made on the thread that waits (:meth:`wait`); :meth:`offer` from any other."""

    __slots__ = ("_cond", "_idle", "_job", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self._cond = threading.Condition(threading.Lock())
        #: Whether the thread waits in :meth:`wait` and runs nothing.
        self._idle = False
        self._job: tuple[Callable[[], Any], Future[Any]] | None = None

    def offer(self, fn: Callable[[], Any]) -> Future[Any] | None:
        """Have the host thread run ``fn`` if it waits idle: a Future of its
        result, else ``None`` (the caller runs it)."""
        done: Future[Any] = Future()
        with self._cond:
            if not self._idle or self._job is not None:
                return None
            self._job = (fn, done)
            self._idle = False
            self._cond.notify_all()
        return done

    def wait(self, fut: Future[Any]) -> Any:
        """``fut``'s value (on the host thread), running meanwhile what :meth:`offer` hands over."""
        assert threading.get_ident() == self.thread
        fut.add_done_callback(self._wake)
        while True:
            with self._cond:
                job = self._take(fut)
            if job is None:
                return fut.value()
            fn, done = job
            try:
                result = fn()
            except BaseException as e:
                done.set_exception(e)
                if not isinstance(e, Exception):
                    raise
            else:
                done.set_result(result)

    def _take(self, fut: Future[Any]) -> tuple[Callable[[], Any], Future[Any]] | None:
        """The job handed over, or ``None`` once ``fut`` is done (lock held)."""
        self._idle = True
        try:
            if self._job is None and not fut.done():
                pool = blocking(fut)  # (a handler waiting: its pool may start another thread)
                try:
                    while self._job is None and not fut.done():
                        self._cond.wait()
                finally:
                    if pool is not None:
                        pool.unblocked()
            job, self._job = self._job, None
            return job
        finally:
            self._idle = False

    def _wake(self, _: Future[Any]) -> None:
        with self._cond:
            self._cond.notify_all()
