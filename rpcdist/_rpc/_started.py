"""A blocking call split in two (``Agent.start_blocking``): written now, its
reply read later on the same thread, so the caller works meanwhile."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .._transport._frames import OutMessage

__all__ = ["Started", "abandon"]


class _Pool(Protocol):
    """Where a started call's reply is read (``_sync_pool.SyncPool``)."""

    def finish(self, call: Started) -> Any: ...
    def abandon(self, call: Started) -> None: ...


class Started:
    """A call written on a thread-driven connection, whose reply the caller
    reads later with :meth:`wait` (or gives up with :meth:`abandon`)."""

    __slots__ = ("_calls", "chan", "done", "label", "msg", "sent", "started")

    def __init__(
        self, calls: _Pool, chan: Any, msg: OutMessage, label: str, started: float
    ) -> None:
        self._calls = calls
        self.chan = chan
        self.msg = msg
        self.label = label
        self.started = started
        self.sent = False
        self.done = False

    def wait(self) -> Any:
        """The call's result, read on this thread (once).

        Raises:
            RpcTimeoutError: no reply before the call's deadline.
            WorkerLostError: the connection to the callee failed.
            ClosedError: this agent shut down meanwhile.
            RuntimeError: waited for (or abandoned) before.
            Exception: what the remote function raised.
        """
        return self._calls.finish(self)

    def abandon(self) -> None:
        """No one will wait for the reply (an error came first): the agent's
        loop reads it and drops it. A no-op once waited for."""
        self._calls.abandon(self)


def abandon(calls: list[Any]) -> None:
    """Give up each of ``calls`` that can be (a :class:`Started`, or what
    wraps one); a Future needs nothing."""
    for c in calls:
        give_up = getattr(c, "abandon", None)
        if give_up is not None:
            give_up()
