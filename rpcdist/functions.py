"""Decorators for functions served over RPC: :func:`async_execution`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])

#: Attribute set on functions decorated with :func:`async_execution`.
ASYNC_EXECUTION_ATTR = "_rpcdist_async_execution"


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a Future whose value is the RPC's reply.

    The callee runs ``fn`` in its thread pool, then releases the thread and
    replies when the returned ``rpcdist.Future`` (or awaitable) completes, so
    many calls can wait (for a batch to fill, for a nested call) while holding
    no thread. Works on plain functions, staticmethods and classmethods; put
    it under ``@staticmethod``/``@classmethod``.
    """
    target = fn.__func__ if isinstance(fn, staticmethod | classmethod) else fn
    setattr(target, ASYNC_EXECUTION_ATTR, True)
    return fn
