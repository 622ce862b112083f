"""What an agent has in flight: handlers running, calls sent and handled.

A graceful shutdown waits for the agent to be *idle* (no handler running, no
call of its own pending) and compares every worker's sent and handled
counts (see ``_agent.Agent._quiesce``). Handlers run on the loop and on pool
or serving threads, so the counts are kept under one lock; the ``idle``
event lives on the loop. Threads that finish work off the loop wake the
loop to re-check idleness only while a graceful shutdown waits for it
(``quiescing``): otherwise the loop is spared the wake-up.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

__all__ = ["Activity"]


class Activity:
    """Counts of one agent's calls and handlers (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, no_calls: Callable[[], bool]) -> None:
        self._loop = loop
        #: Whether the agent has no call of its own pending (any thread).
        self._no_calls = no_calls
        self.lock = threading.Lock()
        #: Handlers running now (read anywhere as a hint; written under ``lock``).
        self.inflight = 0
        self.sent = 0
        self.handled = 0
        self.quiescing = False
        #: Set while nothing runs and nothing is pending (used on the loop;
        #: an asyncio.Event binds to a loop only when first waited on).
        self.idle = asyncio.Event()
        self.idle.set()

    def sent_one(self) -> None:
        with self.lock:
            self.sent += 1

    def handler_started(self) -> None:
        """A handler starts (on the loop)."""
        with self.lock:
            self.inflight += 1
        self.idle.clear()

    def handler_started_threadsafe(self) -> None:
        """A handler starts on another thread (a thread serving blocking calls)."""
        with self.lock:
            self.inflight += 1

    def handler_done(self) -> None:
        """A handler finished (on the loop)."""
        with self.lock:
            self.inflight -= 1
            self.handled += 1
        self.check_idle()

    def handler_done_threadsafe(self) -> None:
        """:meth:`handler_done` from another thread (before it sends the reply itself)."""
        with self.lock:
            self.inflight -= 1
            self.handled += 1
            idle = self.inflight == 0
        if idle:
            self.woke_threadsafe()

    def woke_threadsafe(self) -> None:
        """Work finished off the loop: a waiting graceful shutdown re-checks."""
        if self.quiescing:
            try:
                self._loop.call_soon_threadsafe(self.check_idle)
            except RuntimeError:  # the loop is gone
                pass

    def check_idle(self) -> None:
        """Set or clear ``idle`` (on the loop)."""
        if self.inflight == 0 and self._no_calls():
            self.idle.set()
        else:
            self.idle.clear()  # user threads add calls without touching the loop
