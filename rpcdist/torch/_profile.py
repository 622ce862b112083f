"""Ranges for torch's profiler around ``rpcdist.torch.rpc`` calls.

Under ``torch.autograd.profiler.profile()`` (or ``torch.profiler``), PyTorch
RPC records each call as a range named ``rpc_async#module.function(caller ->
callee)``, and so does ``rpcdist.torch``: ``rpc_sync`` for the blocking call,
``rpc_async`` until its Future completes, ``remote`` until the owner has made
the value. Only the caller's side is recorded (PyTorch also folds in the
callee's operators). With no profiler running, a call pays one check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .._errors import RpcdistError
from .._futures import Future
from .._rpc._context import current_agent
from .._worker import WorkerInfo

__all__ = ["enabled", "profiled"]

T = TypeVar("T")


def enabled() -> bool:
    """Whether torch's profiler is recording."""
    return bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]


def _key(kind: str, to: str | int | WorkerInfo, func: Any) -> str:
    """torch's name for the range: ``rpc_async#module.function(caller -> callee)``."""
    agent = current_agent()
    try:
        name = agent.function_name(func).replace(":", ".")  # (torch.add, not its C class)
    except RpcdistError:  # the call itself says why it cannot be sent
        name = getattr(func, "__qualname__", None) or repr(func)
    return f"{kind}#{name}({agent.name} -> {agent.worker(to).name})"


def profiled(
    kind: str,
    to: str | int | WorkerInfo,
    func: Any,
    call: Callable[[], T],
    until: Callable[[T], Future[Any] | None] | None = None,
) -> T:
    """``call()`` inside a profiler range named for ``kind``, ``func`` and the
    workers; the range ends when the Future ``until(result)`` gives completes
    (at once without ``until``, or when it gives ``None``)."""
    with torch.autograd.profiler.record_function(_key(kind, to, func)) as rf:
        out = call()
        fut = None if until is None else until(out)
        if fut is not None:
            end: torch.futures.Future[None] = torch.futures.Future()
            fut.add_done_callback(lambda _: end.set_result(None))
            rf._call_end_callbacks_on_future(end)
    return out
