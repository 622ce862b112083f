"""A background thread that runs the jobs put to it, started when there is
work and gone once it has been idle a while.

The shared-memory path has two: the reaper, which takes large segments
down off the thread that lets go of them, and the copier, which takes a
share of a large copy into a segment (``_shm``). Neither holds a thread
while a process is idle, and a transport that stops can wait for them to
end (:meth:`LingeringThread.drain`), so no thread is left behind.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LINGER", "LingeringThread"]

_log = logging.getLogger(__name__)
#: Seconds the thread waits for more work before it ends.
LINGER = 1.0


class LingeringThread:
    """Runs ``fn(*args)`` jobs in order on one thread named ``name``; a job
    that raises is logged as ``doing`` failed (and its future says so)."""

    def __init__(self, name: str, doing: str) -> None:
        self.name, self._doing = name, doing
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (put: reentrant)
        #: Reentrant: a collection on a thread holding it may put a job.
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=self.reset)
        atexit.register(self.drain)  # (a daemon thread: finish what was put before exiting)

    def put(self, fn: Callable[..., None], *args: Any) -> concurrent.futures.Future[None]:
        """Run ``fn(*args)`` on the thread (any thread); the future says when it has."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._jobs.put((fn, args, done))
        with self._lock:
            if self._thread is None:
                t = threading.Thread(target=self._run, name=self.name, daemon=True)
                if self._thread is None:  # (a collection in Thread() may have started one)
                    self._thread = t
                    try:
                        t.start()
                    except RuntimeError:  # the interpreter is exiting: do it here
                        self._thread = None
                        self._work(block=False)
        return done

    def here(self) -> bool:
        return threading.current_thread() is self._thread

    def drain(self) -> None:
        """Wait until everything put is done and the thread has ended (not on the thread)."""
        while True:
            with self._lock:
                t = self._thread
            if t is None or t is threading.current_thread():
                return
            self._jobs.put(None)  # (wakes it: it ends once nothing is left)
            t.join()

    def _run(self) -> None:
        self._work(block=True)
        while True:  # (a wake-up from drain, or idle: finish what is left and end)
            with self._lock:
                if self._jobs.empty():
                    self._thread = None
                    return
            self._work(block=False)

    def _work(self, *, block: bool) -> None:
        """Run jobs until none came for :data:`LINGER` seconds (or none is
        left), or a wake-up from :meth:`drain`."""
        while True:
            try:
                job = self._jobs.get(block, LINGER)
            except queue.Empty:
                return
            if job is None:
                return
            fn, args, done = job
            del job
            try:
                fn(*args)
            except Exception as e:
                _log.warning("%s failed: %s", self._doing, e)
                done.set_exception(e)
            else:
                done.set_result(None)
            del fn, args  # (the last hold on what a job used goes here, not on the next job)

    def reset(self) -> None:
        """In a forked child: the parent's thread is not there."""
        self._jobs = queue.SimpleQueue()
        self._lock = threading.RLock()
        self._thread = None
