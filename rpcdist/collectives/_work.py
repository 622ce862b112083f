"""``Work``: the handle an ``async_op=True`` collective returns."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from .._futures import Future

__all__ = ["Work"]


class Work:
    """A collective in flight, like ``torch.distributed.Work``.

    Collectives on one group complete in the order they were issued. A Work
    is awaitable from any event loop (``await work``) and from threads
    (``work.wait()``); both give the result or raise the collective's error.
    Callbacks on :meth:`get_future` run on the thread that ran the
    collective and must not block (in particular, not call a blocking
    collective on the same group).
    """

    __module__ = "rpcdist.collectives"
    __slots__ = ("_future", "_what")

    def __init__(self, future: Future[Any], what: str) -> None:
        self._future = future
        self._what = what

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the collective is complete; ``True`` on success.

        Args:
            timeout: Seconds to wait; ``None`` waits as long as the collective
                itself may take (its own timeout still applies).

        Raises:
            RpcTimeoutError: ``timeout`` passed first (the collective goes on),
                or the collective itself timed out.
            CollectiveError: the collective failed on this or another rank.
        """
        self._future.wait(timeout)
        return True

    def is_completed(self) -> bool:
        """Whether the collective has finished, successfully or not."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the collective finished without an error."""
        return self._future.done() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        """The error of a finished collective (``None`` if it succeeded or still runs)."""
        return self._future.exception() if self._future.done() else None

    def result(self) -> Any:
        """Wait and return the output: the buffer (or list of buffers) written.

        Raises:
            CollectiveError: the collective failed.
            RpcTimeoutError: it timed out.
        """
        return self._future.wait()

    def get_future(self) -> Future[Any]:
        """The underlying :class:`rpcdist.Future` (for ``then`` chains)."""
        return self._future

    def __await__(self) -> Generator[Any, None, Any]:
        return self._future.__await__()

    def __repr__(self) -> str:
        state = (
            "pending"
            if not self._future.done()
            else ("ok" if self._future.exception() is None else "failed")
        )
        return f"<rpcdist.collectives.Work {self._what} {state}>"
