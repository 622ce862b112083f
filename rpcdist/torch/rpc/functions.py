"""``torch.distributed.rpc.functions``: :func:`async_execution`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..._futures import Future
from ...functions import async_execution as _mark
from .._futures import as_future
from .._profile import run_async_body

__all__ = ["AsyncFunctionTypeError", "async_execution"]

F = TypeVar("F", bound=Callable[..., Any])


class AsyncFunctionTypeError(TypeError, RuntimeError):
    """An ``@async_execution`` function returned no Future (a ``RuntimeError``
    too, as torch's)."""


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
        out = run_async_body(target, args, kwargs)
        if not isinstance(out, Future | torch.futures.Future) and not inspect.isawaitable(out):
            raise AsyncFunctionTypeError(
                "Functions decorated with @rpc.async_function must return a "
                f"torch.futures.Future object, but got {type(out).__name__} (or an "
                "rpcdist Future)"
            )
        return as_future(out)

    _mark(run)
    out: Any = kind(run) if kind is not None else run
    return out  # type: ignore[no-any-return]
