"""Idempotent control items for peers, sent in batches.

Extensions that tell peers "this is done" many times a second (distributed
autograd freeing contexts, CUDA IPC releasing lends) post one item per event;
:class:`ControlOutbox` sends each peer's items in ``send_control``
messages with a list payload of at most ``batch`` items: once ``batch`` of
them wait, ``delay`` seconds after the first (0: on the loop's next turn), or
at :meth:`flush`. Each
message is retried until acknowledged, as every control message is; a
graceful shutdown :meth:`drain`\\ s the outbox.

Items may instead ride on a call to their peer (a registry rider):
:meth:`take` hands over what waits for the peer, under a token that the
callee's reply acknowledges (:meth:`delivered`). What is not acknowledged
within ``delay`` (a call that failed, or is slow) is sent the usual way at
the next flush; a call that was never sent gives its items back at once
(:meth:`returned`). The items are idempotent, so a late acknowledgement
after such a resend costs nothing but the resend.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from .._errors import RpcdistError

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["ControlOutbox"]

_log = logging.getLogger(__name__)


class ControlOutbox:
    """Items for internal method ``method``, batched per peer (see the module docstring)."""

    def __init__(
        self, agent: AgentView, method: str, *, delay: float = 0.0, batch: int = 256
    ) -> None:
        self._agent = agent
        self._method = method
        self._delay = delay
        self._batch = batch
        self._lock = threading.Lock()
        self._boxes: dict[int, list[Any]] = {}
        #: Items riding on calls: token -> (peer, items, when taken).
        self._riding: dict[int, tuple[int, list[Any], float]] = {}
        self._tokens = itertools.count(1)
        self._armed = False
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def post(self, peer: int, item: Any) -> None:
        """Queue ``item`` for ``peer`` (any thread)."""
        with self._lock:
            box = self._boxes.setdefault(peer, [])
            box.append(item)
            full = len(box) >= self._batch
            arm = not self._armed
            self._armed = True
        try:
            if full:
                self._agent.loop.call_soon_threadsafe(self._send_full, peer)
            if arm:
                self._agent.loop.call_soon_threadsafe(self._arm)
        except RuntimeError:  # the loop is gone: the agent shut down
            pass

    def take(self, peer: int) -> tuple[int, list[Any]] | None:
        """What waits for ``peer``, to ride on a call there (any thread):
        ``(token, items)``, or ``None`` if nothing waits."""
        if not self._boxes:  # (every call asks: no lock when nothing waits)
            return None
        with self._lock:
            items = self._boxes.pop(peer, None)
            if not items:
                return None
            token = next(self._tokens)
            self._riding[token] = (peer, items, time.monotonic())
        return token, items

    def delivered(self, token: object) -> None:
        """The callee acknowledged the items that rode under ``token`` (any thread)."""
        with self._lock:
            self._riding.pop(token, None)  # type: ignore[call-overload]

    def returned(self, token: int) -> None:
        """The call that took the items under ``token`` was never sent (any thread)."""
        with self._lock:
            got = self._riding.pop(token, None)
        if got is not None:
            for item in got[1]:
                self.post(got[0], item)

    def drop(self, peer: int) -> None:
        """Forget what waits for ``peer`` (it is gone)."""
        with self._lock:
            self._boxes.pop(peer, None)
            for token in [t for t, r in self._riding.items() if r[0] == peer]:
                del self._riding[token]

    def pending(self) -> int:
        """Items waiting or riding, plus messages not yet acknowledged."""
        with self._lock:
            riding = sum(len(r[1]) for r in self._riding.values())
            return sum(map(len, self._boxes.values())) + riding + len(self._tasks)

    def flush(self, *, everything: bool = False) -> None:
        """Send everything queued now, and what has ridden unacknowledged for
        ``delay`` (``everything``: all that rides) (on the loop)."""
        self._cancel_timer()
        now = time.monotonic()
        with self._lock:
            self._armed = False
            for token, (peer, items, taken) in list(self._riding.items()):
                if everything or now - taken >= self._delay:
                    del self._riding[token]
                    self._boxes.setdefault(peer, []).extend(items)
            peers = list(self._boxes)
            riding = bool(self._riding)
        for peer in peers:
            self._send(peer)
        if riding and not self._agent.closed:  # look again once they are due
            with self._lock:
                self._armed = True
            self._arm()

    async def drain(self) -> None:
        """Graceful shutdown: send what is queued and wait for the acknowledgements."""
        self.flush(everything=True)
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        self._cancel_timer()
        with self._lock:
            self._boxes.clear()
            self._riding.clear()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------- the loop

    def _arm(self) -> None:
        if self._agent.closed:
            return
        if self._delay <= 0:
            self.flush()
        elif self._timer is None:
            self._timer = self._agent.loop.call_later(self._delay, self.flush)

    def _send_full(self, peer: int) -> None:
        """Send the full batches waiting for ``peer``; the rest waits on."""
        self._send(peer, whole_batches=True)

    def _send(self, peer: int, *, whole_batches: bool = False) -> None:
        # Items keep coming while a full box waits for the loop: a message
        # never carries more than ``batch`` of them.
        with self._lock:
            items = self._boxes.pop(peer, None) or []
            if whole_batches and len(items) % self._batch:
                cut = len(items) - len(items) % self._batch
                self._boxes[peer] = items[cut:]
                items = items[:cut]
        for start in range(0, len(items), self._batch):
            chunk = items[start : start + self._batch]
            task = self._agent.loop.create_task(self._deliver(peer, chunk))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _deliver(self, peer: int, items: list[Any]) -> None:
        try:
            await self._agent.send_control(peer, self._method, items)
        except RpcdistError as e:  # it is gone, and what the items were about with it
            _log.debug("%s to rank %d (%d items): %s", self._method, peer, len(items), e)
