"""``torch.distributed.rpc.functions``: :func:`async_execution`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ...functions import async_execution as _mark
from .._futures import as_future
from .._profile import run_async_body

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a Future whose value is the RPC's reply.

    The future may be an ``rpcdist.torch.futures.Future`` (rpcdist's) or a
    ``torch.futures.Future``; user code completes it later (for example when
    a batch is full), and the reply leaves then, holding no thread meanwhile.
    Put it under ``@staticmethod``/``@classmethod``, as in torch.
    """
    kind = type(fn) if isinstance(fn, staticmethod | classmethod) else None
    target = fn.__func__ if isinstance(fn, staticmethod | classmethod) else fn

    @functools.wraps(target)
    def run(*args: Any, **kwargs: Any) -> Any:
        return as_future(run_async_body(target, args, kwargs))

    _mark(run)
    out: Any = kind(run) if kind is not None else run
    return out  # type: ignore[no-any-return]
