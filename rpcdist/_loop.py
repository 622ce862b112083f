"""The agent's event loop, in a daemon thread, and the blocking portal into it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._errors import ClosedError, WrongThreadError
from ._futures import Future

__all__ = ["LoopThread"]

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed and not disabled (``RPCDIST_UVLOOP=0``), else asyncio's."""
    if os.environ.get("RPCDIST_UVLOOP", "1") != "0":
        try:
            import uvloop

            return uvloop.new_event_loop()  # type: ignore[no-any-return]
        except ImportError:
            pass
    return asyncio.new_event_loop()


class LoopThread:
    """Owns one asyncio event loop running in a daemon thread."""

    def __init__(self, name: str = "rpcdist-loop") -> None:
        self.loop = _new_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                self._cancel_all()
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            finally:
                self.loop.close()

    def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def check_not_loop_thread(self, what: str) -> None:
        """Raise ``WrongThreadError`` when called on the loop thread.

        Raises:
            WrongThreadError: the caller is the loop thread.
        """
        if self.in_loop_thread():
            raise WrongThreadError(
                f"{what} blocks and was called on the rpcdist event-loop thread, where it "
                "would deadlock; use its async form (await it) or call it from another thread"
            )

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the loop; return an rpcdist Future for its result."""
        if self._closed:
            coro.close()
            raise ClosedError("the rpcdist event loop has been stopped")
        out: Future[T] = Future()
        cf = asyncio.run_coroutine_threadsafe(coro, self.loop)

        def done(f: concurrent.futures.Future[T]) -> None:
            if f.cancelled():
                out.set_exception(ClosedError("operation cancelled: the agent shut down"))
            elif (e := f.exception()) is not None:
                out.set_exception(e)
            else:
                out.set_result(f.result())

        cf.add_done_callback(done)
        return out

    def run(self, coro: Coroutine[Any, Any, T], what: str = "this call") -> T:
        """Run ``coro`` on the loop and block until it finishes.

        Raises:
            WrongThreadError: called on the loop thread itself.
        """
        if self.in_loop_thread():
            coro.close()
            self.check_not_loop_thread(what)
        return self.submit(coro).wait()

    def stop(self, join_timeout: float | None = 10.0) -> None:
        """Stop the loop (cancelling what still runs) and join its thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:
            pass
        if not self.in_loop_thread():
            self._thread.join(join_timeout)
