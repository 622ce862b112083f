"""Whether operations record a graph: thread- and task-local grad mode.

The flag lives in a :class:`contextvars.ContextVar`, so ``no_grad()`` in one
thread (an RPC handler, say) or one asyncio task never affects another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["enable_grad", "is_grad_enabled", "no_grad", "set_grad_enabled"]

_GRAD_ENABLED: ContextVar[bool] = ContextVar("rpcdist_grad_enabled", default=True)
_Func = TypeVar("_Func", bound=Callable[..., Any])


def is_grad_enabled() -> bool:
    """Whether operations on tensors that require grad record a graph here."""
    return _GRAD_ENABLED.get()


class set_grad_enabled:
    """Context manager (and decorator) that sets grad mode to ``mode``.

    Args:
        mode: True to record graphs, False not to.
    """

    __module__ = "rpcdist.tensor"
    _mode: bool

    def __init__(self, mode: bool) -> None:
        self._mode = bool(mode)
        self._tokens: list[Token[bool]] = []

    def __enter__(self) -> None:
        self._tokens.append(_GRAD_ENABLED.set(self._mode))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _GRAD_ENABLED.reset(self._tokens.pop())

    def __call__(self, func: _Func) -> _Func:
        mode = self._mode

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with set_grad_enabled(mode):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class no_grad(set_grad_enabled):
    """Context manager (and decorator) under which no graph is recorded.

    Example::

        with rpcdist.tensor.no_grad():
            y = model(x)          # y.requires_grad is False
    """

    __module__ = "rpcdist.tensor"

    def __init__(self) -> None:
        super().__init__(False)


class enable_grad(set_grad_enabled):
    """Context manager (and decorator) that re-enables grad mode."""

    __module__ = "rpcdist.tensor"

    def __init__(self) -> None:
        super().__init__(True)
