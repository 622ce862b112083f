"""What the calls to an RRef's owner and the method proxies see of an RRef.

With :mod:`._protocol` (the ownership bookkeeping) and :mod:`._context`
(one agent's RRef state), the bottom of this package: :mod:`._calls` and
:mod:`._proxy` are written against :class:`RRefHandle`, never against
:class:`~._rref.RRef` itself, so the RRef class depends on them and not the
reverse. ``RRef`` satisfies it, which the type checker verifies where an
RRef is handed to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .._deadline import Unset
    from .._futures import Future
    from .._worker import WorkerInfo
    from ._context import RRefContext

__all__ = ["RRefHandle"]


class RRefHandle(Protocol):
    """An RRef as its owner calls and its proxies use it (``_rref.RRef``)."""

    #: This agent's RRef state, the RRef's id and its owner's rank.
    _ctx: RRefContext
    _rid: tuple[int, int]
    _owner: int
    #: Done when the owner confirmed it (None: confirmed from the start).
    _confirmed: Future[None] | None
    #: Made by ``remote()`` here: that call's deadline (inf: none).
    _creator: float | None
    #: A copy of the value, while the reply of its ``remote()`` settles.
    _early: list[Any] | None

    def owner(self) -> WorkerInfo: ...
    def _invoke(
        self,
        name: str,
        args: Any,
        kwargs: Any,
        timeout: float | Unset | None,
        blocking: bool = False,
    ) -> Future[Any]: ...
    def _remote_method(
        self, name: str, args: Any, kwargs: Any, timeout: float | Unset | None
    ) -> RRefHandle: ...
