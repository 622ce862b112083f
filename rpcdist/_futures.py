"""A thread-safe Future that is also awaitable from any asyncio event loop."""

from __future__ import annotations

import _thread
import asyncio
import logging
import threading
from collections.abc import Callable, Generator, Iterable
from typing import Any, Generic, TypeVar

from ._errors import RpcTimeoutError
from ._pool import blocking

__all__ = ["Future", "collect_all", "wait_all"]

T = TypeVar("T")
U = TypeVar("U")
_log = logging.getLogger(__name__)
_PENDING, _DONE = 0, 1


class Future(Generic[T]):
    """The result of an asynchronous operation, usable from threads and asyncio.

    ``wait()`` blocks the calling thread; ``await fut`` suspends the awaiting
    coroutine on whatever event loop it runs in. Callbacks registered with
    :meth:`add_done_callback` or :meth:`then` run on the thread that completes
    the future (for RPC replies, the agent's loop thread), so they must not
    block; blocking calls made there raise ``WrongThreadError``.
    """

    __module__ = "rpcdist"
    __slots__ = ("_callbacks", "_exc", "_gate", "_lock", "_state", "_value")

    def __init__(self) -> None:
        # Two bare locks rather than a threading.Condition (a third of the
        # cost on the rpc_sync path): ``_lock`` guards the state and the
        # callbacks; ``_gate`` is held until completion, and each waiter
        # passes through it (acquire, then release for the next one). The
        # first thread to wait makes the gate: most futures of a window of
        # calls are complete before anyone waits for them.
        self._lock = _thread.allocate_lock()
        self._gate: _thread.LockType | None = None
        self._state = _PENDING
        self._value: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[Future[T]], None]] = []

    def done(self) -> bool:
        """Whether a result or an exception has been set."""
        return self._state == _DONE

    def set_result(self, result: T) -> None:
        """Complete the future with ``result``.

        Raises:
            RuntimeError: the future is already complete.
        """
        self._complete(result, None)

    def set_exception(self, exc: BaseException) -> None:
        """Complete the future with an exception.

        Raises:
            RuntimeError: the future is already complete.
        """
        if not isinstance(exc, BaseException):
            raise TypeError(f"set_exception expects an exception, got {type(exc).__name__}")
        self._complete(None, exc)

    def _has_callbacks(self) -> bool:
        """Whether callbacks wait for completion (else only threads may)."""
        return bool(self._callbacks)

    def _complete(self, value: Any, exc: BaseException | None) -> None:
        with self._lock:
            if self._state == _DONE:
                raise RuntimeError(
                    "Future can only be marked completed once: it is already complete"
                )
            self._value, self._exc, self._state = value, exc, _DONE
            callbacks, self._callbacks = self._callbacks, []
            gate = self._gate
        if gate is not None:
            gate.release()
        for cb in callbacks:
            self._run_callback(cb)

    def _run_callback(self, cb: Callable[[Future[T]], None]) -> None:
        try:
            cb(self)
        except Exception:
            _log.exception("rpcdist.Future callback %r raised", cb)

    def wait(self, timeout: float | None = None) -> T:
        """Block until complete and return the result (or raise its exception).

        Args:
            timeout: Seconds to wait; ``None`` waits for ever.

        Raises:
            RpcTimeoutError: ``timeout`` passed before completion.
        """
        if self._state != _DONE and (gate := self._waiters_gate()) is not None:
            pool = blocking(self)  # (a handler waiting: its pool may start another thread)
            try:
                if timeout is None:
                    gate.acquire()
                elif not gate.acquire(True, min(max(float(timeout), 0.0), threading.TIMEOUT_MAX)):
                    raise RpcTimeoutError(f"Future not complete after waiting {timeout} s")
            finally:
                if pool is not None:
                    pool.unblocked()
            gate.release()
        try:
            return self.value()
        finally:
            self = None  # type: ignore[assignment]  # (see value())

    def _waiters_gate(self) -> _thread.LockType | None:
        """The gate waiters pass once the future is complete, made (held) by
        the first; None if it is complete already."""
        with self._lock:
            if self._state == _DONE:
                return None
            if self._gate is None:
                gate = _thread.allocate_lock()
                gate.acquire()
                self._gate = gate
            return self._gate

    def value(self) -> T:
        """The result of a completed future; raises its exception if it failed.

        Raises:
            RuntimeError: the future is not complete yet.
        """
        if self._state != _DONE:
            raise RuntimeError("Future.value() called before the future completed")
        exc = self._exc
        if exc is not None:
            try:
                raise exc
            finally:
                # The exception's traceback holds this frame: were the frame
                # still to hold the future, which holds the exception, the
                # three would be a cycle that only the collector frees (with
                # everything the frames refer to), after every failed call.
                self = exc = None  # type: ignore[assignment]
        return self._value  # type: ignore[no-any-return]

    def exception(self) -> BaseException | None:
        """The exception of a completed future, or ``None``."""
        if self._state != _DONE:
            raise RuntimeError("Future.exception() called before the future completed")
        return self._exc

    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """Call ``callback(self)`` when complete (at once if already complete)."""
        with self._lock:
            if self._state != _DONE:
                self._callbacks.append(callback)
                return
        self._run_callback(callback)

    def then(self, callback: Callable[[Future[T]], U]) -> Future[U]:
        """A new Future completed with ``callback(self)``, or with what it raised.

        Raises:
            TypeError: ``callback`` is not callable.
        """
        check_callback(callback)
        out: Future[U] = Future()

        box = [out]  # (taken out on completion: see value())

        def chain(f: Future[T]) -> None:
            target = box.pop()
            failed = f._exc
            tb = None if failed is None else failed.__traceback__
            try:
                target.set_result(callback(f))
            except BaseException as e:
                if e is failed:
                    # ``f``'s own error, re-raised by ``callback`` (``f.wait()``):
                    # keep its traceback as it was. This stack in it would
                    # make a cycle (``f``, the error, these frames) holding
                    # whatever the frames hold until the collector ran.
                    e.__traceback__ = tb
                target.set_exception(e)
            finally:
                target = failed = tb = None  # type: ignore[assignment]  # (see value())

        self.add_done_callback(chain)
        return out

    def __await__(self) -> Generator[Any, None, T]:
        if self._state != _DONE:
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()

            def resolve() -> None:
                if not waiter.done():
                    waiter.set_result(None)

            def wake(_: Future[T]) -> None:
                if asyncio._get_running_loop() is loop:
                    resolve()  # completed on the awaiting loop itself: no wake-up needed
                    return
                try:
                    loop.call_soon_threadsafe(resolve)
                except RuntimeError:  # the awaiting loop was closed meanwhile
                    pass

            self.add_done_callback(wake)
            yield from waiter.__await__()
        try:
            return self.value()
        finally:
            self = None  # type: ignore[assignment]  # (see value())

    def __repr__(self) -> str:
        if self._state != _DONE:
            return "<rpcdist.Future pending>"
        if self._exc is not None:
            return f"<rpcdist.Future exception={self._exc!r}>"
        return f"<rpcdist.Future result={self._value!r}>"


def check_callback(callback: object) -> None:
    """Raises: TypeError: ``callback`` is not callable (torch's text first)."""
    if not callable(callback):
        raise TypeError(
            f"then(): incompatible function arguments: callback must be callable, got {callback!r}"
        )


def collect_all(futures: Iterable[Future[Any]]) -> Future[list[Future[Any]]]:
    """A Future completed, with the input list, once every input completed."""
    futs = list(futures)
    out: Future[list[Future[Any]]] = Future()
    if not futs:
        out.set_result(futs)
        return out
    remaining = [len(futs)]
    lock = threading.Lock()

    def one_done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            out.set_result(futs)

    for f in futs:
        f.add_done_callback(one_done)
    return out


def wait_all(futures: Iterable[Future[Any]], timeout: float | None = None) -> list[Any]:
    """Wait for every future and return their values in submission order.

    Raises:
        BaseException: the first failed future's exception (in input order),
            after every future has completed.
    """
    futs = list(futures)
    collect_all(futs).wait(timeout)
    return [f.value() for f in futs]


collect_all.__module__ = wait_all.__module__ = "rpcdist.futures"
