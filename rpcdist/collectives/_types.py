"""What the parts of this package see of each other: the bottom of collectives.

:class:`~._state.CollectiveState` (one agent's collectives) makes the
process groups and their engines, so it imports :mod:`._group` and
:mod:`._engine`; they see it, and an engine sees its group, only through
these protocols, and import neither.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = ["CollectivesView", "GroupView"]

T = TypeVar("T")


class CollectivesView(Protocol):
    """One agent's collectives, as a process group sees them."""

    agent: Agent
    #: The prefix of this ``init_process_group``'s store keys and messages.
    tag: str

    def dead_peers(self, ranks: Sequence[int]) -> list[int]:
        """Members on this host whose process has exited."""
        ...

    def watch(self, ranks: Sequence[int]) -> None:
        """Make the failure detector watch these members (any thread)."""
        ...


class GroupView(Protocol):
    """A process group, as its engines see it."""

    gid: int
    ranks: tuple[int, ...]
    rank: int
    size: int
    timeout: float | None
    requested: str
    engine: Any
    extra: dict[str, Any]

    @property
    def state(self) -> CollectivesView: ...

    def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the agent loop under the group's watchdog; block for it."""
        ...
