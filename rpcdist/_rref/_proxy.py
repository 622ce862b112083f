"""``rref.rpc_sync()``, ``rref.rpc_async()`` and ``rref.remote()``: method proxies."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._deadline import Unset

if TYPE_CHECKING:
    from ._handle import RRefHandle

__all__ = ["RRefProxy"]


class RRefProxy:
    """Calls the same-named method of an RRef's value, on its owner.

    ``rref.rpc_sync().m(*a)`` returns ``value.m(*a)``; ``rpc_async()`` a Future
    of it; ``remote()`` an RRef to it (owned by the same owner). Instance,
    static and class methods work, and state changes persist in the value.
    """

    __module__ = "rpcdist"
    __slots__ = ("_mode", "_rref", "_timeout")

    def __init__(self, rref: RRefHandle, mode: str, timeout: float | Unset | None) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # keep copy/pickle/introspection probes local

        def call(*args: Any, **kwargs: Any) -> Any:
            rref = self._rref
            if self._mode == "remote":
                return rref._remote_method(name, args, kwargs, self._timeout)
            if self._mode == "async":
                return rref._invoke(name, args, kwargs, self._timeout)
            rref._ctx.agent.check_not_loop_thread(f"rref.rpc_sync().{name}()")
            return rref._invoke(name, args, kwargs, self._timeout, blocking=True).wait()

        call.__name__ = call.__qualname__ = name
        return call

    def __repr__(self) -> str:
        return f"<RRefProxy {self._mode} of {self._rref!r}>"
