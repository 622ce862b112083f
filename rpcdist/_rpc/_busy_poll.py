"""Busy-polling: a thread waiting on a socket polls it for a while before
it sleeps (``RpcOptions.busy_poll_us``), so the bytes it waits for wake no
one.

Each agent owns its :class:`BusyPoll`: its window, what it remembers about
its waits, its counters, and the set of the agent's other sockets. What the
agents of a process share is one GIL: a polling thread holds it, so only one
thread of the process polls at a time, and none while the process holds more
than one agent (a peer in the same process needs the GIL to answer). That
one shared fact lives in :data:`PROCESS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import sys
import threading
import time
from typing import Any, Protocol

from .._cores import CROWDED_FOR, crowded

__all__ = ["LOOK_EVERY", "PROCESS", "BusyPoll", "ProcessGil"]

#: How often (seconds) a polling thread looks whether another thread of its
#: worker, or of the host, needs what it holds (its own socket: every round).
LOOK_EVERY = 20e-6
#: Most kinds of wait whose last length a :class:`BusyPoll` remembers.
_KINDS = 4096


class _Inflight(Protocol):
    """What a poller reads of the agent's activity: handlers running now."""

    inflight: int


#: Python's own switch interval (``sys.getswitchinterval()`` unless a program changed it).
PYTHON_SWITCH = 0.005


class ProcessGil:
    """The agents of this process, which share its GIL: ``slot`` is held by
    the one thread polling now. While any runs, the interpreter's switch
    interval is the agents' (``RpcOptions.gil_switch_us``), if the program
    left Python's own in place."""

    def __init__(self) -> None:
        self.slot = threading.Lock()
        self._lock = threading.Lock()
        self._members: set[int] = set()
        #: Agents of this process not yet closed.
        self.agents = 0
        #: The switch interval the agents set (None: they set none).
        self._switch: float | None = None

    def join(self, member: object, switch: float | None = None) -> None:
        """``member`` starts; ``switch``: the switch interval it asks for (seconds)."""
        with self._lock:
            self._members.add(id(member))
            self.agents = len(self._members)
            # (only over Python's own interval: a program's own choice stays)
            if switch is not None and self._switch is None and _python_switch():
                sys.setswitchinterval(switch)
                self._switch = sys.getswitchinterval()

    def leave(self, member: object) -> None:
        """``member`` is closing (idempotent)."""
        with self._lock:
            self._members.discard(id(member))
            self.agents = len(self._members)
            if not self._members and self._switch is not None:
                if sys.getswitchinterval() == self._switch:  # (nobody changed it since)
                    sys.setswitchinterval(PYTHON_SWITCH)
                self._switch = None


def _python_switch() -> bool:
    return sys.getswitchinterval() == PYTHON_SWITCH


#: This process's GIL, as the pollers of its agents share it.
PROCESS = ProcessGil()


class BusyPoll:
    """One agent's busy-polling policy: whether a wait polls first, and the
    polling itself.

    ``window``: seconds a waiting thread polls before it sleeps (0: never).
    """

    def __init__(
        self,
        window: float,
        activity: _Inflight,
        loop: asyncio.AbstractEventLoop,
        process: ProcessGil = PROCESS,
        switch: float | None = None,
    ) -> None:
        self.window = window
        self._activity = activity
        self._process = process
        #: Waits that began by polling, those whose bytes came meanwhile, and
        #: polls cut short (or not begun) because bytes came for another
        #: thread of this agent or the host was crowded.
        self.polls = 0
        self.hits = 0
        self.yields = 0
        #: Whether the last wait of each kind ended within the window: a
        #: reply to ``(peer, label)``, or the next call after one of
        #: ``(peer, method)`` was served. A wait polls only if the last of
        #: its kind was that short (a step's long and short calls alternate
        #: on one connection).
        self._last_was_short: dict[tuple[int, str], bool] = {}
        #: Whether the host was crowded at the last look of the last poll
        #: (see :meth:`_poll`).
        self._crowded = False
        #: What the agent's other threads wait on: the loop's selector and the
        #: connections served by threads (see :meth:`wait`).
        self.others: Any = None
        if window:
            self.others = select.epoll()
            selector = getattr(loop, "_selector", None)  # (asyncio's epoll)
            if selector is not None:
                self.watch(selector.fileno())
        process.join(self, switch)

    def window_end(self, kind: tuple[int, str], now: float) -> float:
        """Until when a wait of ``kind`` starting ``now`` may poll (0: not at
        all: the last wait of its kind was longer than the window)."""
        return now + self.window if self._last_was_short.get(kind, True) else 0.0

    def remember(self, kind: tuple[int, str], waited: float) -> None:
        """A wait of ``kind`` took ``waited`` seconds."""
        last = self._last_was_short
        if len(last) >= _KINDS and kind not in last:
            last.clear()  # (a program of that many kinds of call: start afresh)
        last[kind] = waited <= self.window

    def wait(self, link: Any, until: float | None, spin_end: float) -> bool:
        """``link.read_blocking(until)``, polling without sleeping first until
        ``spin_end`` if this thread may (see :class:`ProcessGil`) and nothing
        else of this agent runs: a handler elsewhere would wait for the GIL."""
        process = self._process
        if spin_end and process.agents == 1 and not self._activity.inflight:
            if until is not None:
                spin_end = min(spin_end, until)
            if time.monotonic() < spin_end and process.slot.acquire(blocking=False):
                try:
                    self._poll(link, spin_end)
                except ValueError:  # the set was closed: the agent shut down meanwhile
                    pass
                finally:
                    process.slot.release()
        return bool(link.read_blocking(until))

    def _poll(self, link: Any, spin_end: float) -> None:
        """Poll ``link`` until it is readable, ``spin_end``, or another thread
        of this worker (its GIL) or of the host (a core) needs what this takes.

        A host crowded as the wait begins, as it was at the last look before
        (a thread that runs for a moment is not seen twice running), is not
        polled at all: the peer this thread just wrote to was woken on its
        core (a socket's wake-up asks the scheduler for that), where the
        spin only takes CPU from it and from the host's other work, and a
        thread that used more than its share waits longer for a core when it
        is woken (docs/design.md, "Polling before sleeping"). Once polling,
        the host must stay crowded for :data:`CROWDED_FOR` (a thread that
        runs for a moment does not end the poll)."""
        self.polls += 1
        if self._crowded and crowded():  # (before anything else: no more syscalls)
            self.yields += 1
            return
        readable, others, clock = link.readable, self.others.poll, time.monotonic
        own = getattr(link, "_fd", -1)  # (served links are in ``others`` too)
        since = 0.0  # when the host was first seen crowded (0: it is not)
        look = 0.0  # when to look at the other threads and the host next
        try:
            while not readable():
                now = clock()
                if now >= look:  # (two more syscalls: not every round)
                    look = now + LOOK_EVERY
                    since = (since or now) if crowded() else 0.0
                    if any(fd != own for fd, _ in others(0)) or (
                        since and now - since >= CROWDED_FOR
                    ):
                        self.yields += 1
                        return
                if now >= spin_end:
                    return
            self.hits += 1
        finally:
            self._crowded = bool(since)  # (what the last look saw)

    def watch(self, fd: int) -> None:
        """Count ``fd``'s bytes as another thread's in :meth:`wait` (until it
        is closed: epoll forgets a closed socket by itself)."""
        if self.others is not None and fd >= 0:
            with contextlib.suppress(OSError, ValueError):  # (closed meanwhile)
                self.others.register(fd, select.EPOLLIN)

    def close(self) -> None:
        """The agent is closing: it no longer counts in :data:`PROCESS`."""
        self._process.leave(self)

    def stop_watching(self) -> None:
        """After the threads that poll have ended: close the watched set."""
        if self.others is not None:
            self.others.close()
