"""``torch.futures``' helpers over rpcdist Futures, accepting torch's own too.

PyTorch RPC programs wait on their calls with ``torch.futures.wait_all`` and
``collect_all``, which accept only torch's own futures. So that such a
program runs once its imports are changed, :func:`install` (run when
``rpcdist.torch.rpc`` is imported) makes those two accept rpcdist Futures
too: a list holding one goes to this module's versions; any other list to
torch's, unchanged.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._futures import Future, check_callback
from .._futures import collect_all as _collect_all

__all__ = ["TorchFuture", "adopt", "as_future", "collect_all", "install", "wait_all"]


class TorchFuture(Future[Any]):
    """rpcdist's Future as ``rpcdist.torch.rpc.rpc_async`` returns it, whose
    :meth:`then` callbacks may block as torch's may (wait for another call
    they make: ``rpc_async(...).wait()``).

    rpcdist runs a Future's callbacks on the thread that completes it, for
    a reply the agent's event-loop thread, where a callback that waits for
    another reply would stop the loop that is to deliver it. A ``then``
    callback that would run on an event loop runs on a thread of its own
    instead (elsewhere, inline as before).
    """

    __slots__ = ()

    def then(self, callback: Callable[[Future[Any]], Any]) -> Future[Any]:
        """A new Future completed with ``callback(self)``, or with what it raised.

        Raises:
            TypeError: ``callback`` is not callable.
        """
        check_callback(callback)
        out = TorchFuture()
        caller = contextvars.copy_context()  # (the agent current where then() was called)

        def chain(f: Future[Any]) -> None:
            if asyncio._get_running_loop() is None:
                _settle(out, callback, f)
            else:  # (on an event loop: the loop goes on while it waits)
                threading.Thread(
                    target=caller.run,
                    args=(_settle, out, callback, f),
                    name="torch-future-then",
                    daemon=True,
                ).start()

        self.add_done_callback(chain)
        return out


def _settle(out: Future[Any], callback: Callable[[Future[Any]], Any], f: Future[Any]) -> None:
    try:
        value = callback(f)
    except Exception as e:
        # torch's then() fails its future with a RuntimeError of the
        # callback's own error (a TypeError from a wrong signature, say; the
        # original is its __cause__). The error of the future it waited for
        # passes with its own type (torch wraps that too).
        if not isinstance(e, RuntimeError) and e is not f.exception():
            wrapped = RuntimeError(
                f"Got the following error when running the callback: {type(e).__name__}: {e}"
            )
            wrapped.__cause__ = e
            e = wrapped
        out.set_exception(e)
    except BaseException as e:
        out.set_exception(e)
    else:
        out.set_result(value)


def adopt(fut: Future[Any]) -> Future[Any]:
    """``fut`` as a :class:`TorchFuture` (the same object: its class changes
    to the subclass, which adds no state)."""
    if type(fut) is Future:
        fut.__class__ = TorchFuture
    return fut


def as_future(fut: Any) -> Any:
    """An rpcdist Future for a ``torch.futures.Future`` (others pass unchanged)."""
    if not isinstance(fut, torch.futures.Future):
        return fut
    out: Future[Any] = Future()

    def copy(f: torch.futures.Future[Any]) -> None:
        try:
            value = f.value()
        except BaseException as exc:
            out.set_exception(exc)
        else:
            out.set_result(value)

    fut.add_done_callback(copy)
    return out


def collect_all(futures: Iterable[Any]) -> Future[list[Future[Any]]]:
    """A Future completed, with the list of ``futures``, once all of them are done.

    Accepts rpcdist Futures and ``torch.futures.Future`` objects.
    """
    return _collect_all([as_future(f) for f in futures])


def wait_all(futures: Iterable[Any], timeout: float | None = None) -> list[Any]:
    """Wait for every future and return their values, as ``torch.futures.wait_all``:
    the first error raises as soon as it arrives, without waiting for the
    futures still pending (rpcdist's own ``rpcdist.futures.wait_all`` waits
    for all first).

    Accepts rpcdist Futures and ``torch.futures.Future`` objects.

    Raises:
        Exception: the first error among the futures, in completion order.
        RpcTimeoutError: ``timeout`` seconds passed first.
    """
    futs = [as_future(f) for f in futures]
    first_error_or_all: Future[None] = Future()
    lock = threading.Lock()
    pending = len(futs)

    def one_done(f: Future[Any]) -> None:
        nonlocal pending
        with lock:
            pending -= 1
            exc = f.exception()
            if first_error_or_all.done() or (exc is None and pending):
                return
            if exc is not None:
                first_error_or_all.set_exception(exc)
            else:
                first_error_or_all.set_result(None)

    if not futs:
        return []
    for f in futs:
        f.add_done_callback(one_done)
    first_error_or_all.wait(timeout)
    return [f.value() for f in futs]


def _accepting_rpcdist_futures(
    theirs: Callable[..., Any], ours: Callable[..., Any]
) -> Callable[..., Any]:
    """``theirs``, handing a list that holds an rpcdist Future to ``ours``."""

    @functools.wraps(theirs)
    def either(futures: Iterable[Any], *args: Any, **kwargs: Any) -> Any:
        futures = list(futures)
        if any(isinstance(f, Future) for f in futures):
            return ours(futures, *args, **kwargs)
        return theirs(futures, *args, **kwargs)

    either._rpcdist_wraps = theirs  # type: ignore[attr-defined]
    return either


def install() -> None:
    """Make ``torch.futures.wait_all`` and ``collect_all`` accept rpcdist
    Futures (idempotent)."""
    tf = torch.futures
    if not hasattr(tf.wait_all, "_rpcdist_wraps"):
        tf.wait_all = _accepting_rpcdist_futures(tf.wait_all, wait_all)
    if not hasattr(tf.collect_all, "_rpcdist_wraps"):
        tf.collect_all = _accepting_rpcdist_futures(tf.collect_all, collect_all)
