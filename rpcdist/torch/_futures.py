"""``torch.futures``' helpers over rpcdist Futures, accepting torch's own too."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._futures import Future
from .._futures import collect_all as _collect_all
from .._futures import wait_all as _wait_all

__all__ = ["as_future", "collect_all", "wait_all"]


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
    """Wait for every future and return their values (raising the first error).

    Accepts rpcdist Futures and ``torch.futures.Future`` objects.

    Raises:
        Exception: the first error among the futures.
        RpcTimeoutError: ``timeout`` seconds passed first.
    """
    return _wait_all([as_future(f) for f in futures], timeout)
