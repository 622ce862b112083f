"""``Join``: training on uneven inputs, ranks that run out shadow the others.

Each iteration, the first joinable of a :class:`Join` context (DDP) calls
:meth:`Join.notify_join_context` before its collectives: one all-reduce of a
0/1 flag per rank says which ranks are still training. A rank whose inputs
ran out leaves the ``with`` body and, in ``__exit__``, keeps answering that
all-reduce with 0 and runs every joinable's :meth:`JoinHook.main_hook`,
which issues the same collectives as one training iteration (DDP: buffer
broadcast and bucket all-reduces with zero gradients). When the flags sum to
zero every rank has joined: each joinable's :meth:`JoinHook.post_hook` runs
(DDP: the parameters of a rank that trained last are broadcast to all) and
the context ends on every rank together.

List the joinables in the order their collectives run in an iteration
(DDP before ZeroRedundancyOptimizer), since the shadow runs them in that
order.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from .. import collectives as dist
from .._errors import CollectiveError, ConfigError

__all__ = ["Join", "JoinHook", "Joinable"]


class JoinHook:
    """What a joinable does for the ranks still training once this rank has joined.

    Subclass it and override either method; the defaults do nothing.
    """

    __module__ = "rpcdist.parallel"

    def main_hook(self) -> None:
        """Shadow the collectives of one training iteration (called per iteration)."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once every rank has joined.

        Args:
            is_last_joiner: Whether this rank was among those that trained in
                the last iteration (several ranks can be).
        """


class Joinable(abc.ABC):
    """A class whose collectives a :class:`Join` context can shadow.

    Implementations call :meth:`Join.notify_join_context` at the start of
    every iteration that runs their collectives.
    """

    __module__ = "rpcdist.parallel"

    @abc.abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows this joinable's collectives (``kwargs`` from ``Join``)."""

    @property
    @abc.abstractmethod
    def join_process_group(self) -> dist.ProcessGroup | None:
        """The group its collectives run on (None: the default group)."""


class _Context:
    """What a joinable sees of the ``Join`` it is part of."""

    __slots__ = ("active", "first", "join", "throw")

    def __init__(self, join: Join, first: bool, throw: bool) -> None:
        self.join = join
        self.first = first
        self.throw = throw
        #: Group ranks training in the current iteration (None: not known yet).
        self.active: list[int] | None = None


_CONTEXTS: dict[int, _Context] = {}
_LOCK = threading.Lock()


class Join:
    """Context manager for training where ranks have different numbers of inputs.

    Args:
        joinables: The objects whose collectives are shadowed (e.g. a
            :class:`DistributedDataParallel` model, then a
            :class:`ZeroRedundancyOptimizer`), in the order their collectives
            run in an iteration; they must share one process group.
        enable: ``False`` makes the context do nothing.
        throw_on_early_termination: Raise ``CollectiveError`` on every rank
            as soon as one rank runs out of inputs, instead of shadowing.
        **kwargs: Passed to every joinable's ``join_hook`` (DDP takes
            ``divide_by_initial_world_size``).

    Raises:
        ConfigError: no joinables, groups differ, or a joinable is already
            in a ``Join``.
    """

    __module__ = "rpcdist.parallel"

    def __init__(
        self,
        joinables: Sequence[Joinable],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        **kwargs: Any,
    ) -> None:
        self.joinables = list(joinables)
        if not self.joinables:
            raise ConfigError("Join needs at least one joinable")
        for j in self.joinables:
            if not isinstance(j, Joinable):
                raise ConfigError(f"Join: {type(j).__name__} is not a Joinable")
        self.group = self.joinables[0].join_process_group
        sizes = {dist.get_world_size(j.join_process_group) for j in self.joinables}
        if len(sizes) != 1:
            raise ConfigError(f"Join: the joinables use process groups of sizes {sorted(sizes)}")
        self.enable = enable
        self.throw = throw_on_early_termination
        self.kwargs = kwargs
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._hooks: list[JoinHook] = []
        self._last_active: list[int] = []

    def __enter__(self) -> Join:
        if not self.enable:
            return self
        with _LOCK:
            for j in self.joinables:
                if id(j) in _CONTEXTS:
                    raise ConfigError(f"Join: {type(j).__name__} is already inside a Join")
            for i, j in enumerate(self.joinables):
                _CONTEXTS[id(j)] = _Context(self, i == 0, self.throw)
        self._hooks = [j.join_hook(**self.kwargs) for j in self.joinables]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enable:
            return
        try:
            if exc_type is None:
                self._shadow_until_all_joined()
        finally:
            with _LOCK:
                for j in self.joinables:
                    _CONTEXTS.pop(id(j), None)

    def _shadow_until_all_joined(self) -> None:
        while True:
            active = self._exchange(0)
            if not active:
                break
            if self.throw:
                raise CollectiveError(self._early_message(active))
            for j in self.joinables:
                _CONTEXTS[id(j)].active = active
            for hook in self._hooks:
                hook.main_hook()
        last = self.rank in self._last_active or not self._last_active
        for hook in self._hooks:
            hook.post_hook(last)

    def _exchange(self, flag: int) -> list[int]:
        flags = np.zeros(self.world, np.int64)
        flags[self.rank] = flag
        dist.all_reduce(flags, group=self.group)
        active = [int(r) for r in np.flatnonzero(flags)]
        if active:
            self._last_active = active
        return active

    def _early_message(self, active: list[int]) -> str:
        joined = sorted(set(range(self.world)) - set(active))
        return (
            f"Join(throw_on_early_termination=True): rank(s) {joined} of the group ran out of "
            f"inputs while rank(s) {active} still train; stopping every rank"
        )

    @staticmethod
    def notify_join_context(joinable: Joinable) -> list[int] | None:
        """Tell the ``Join`` around ``joinable`` that this rank trains one more iteration.

        The first joinable of the context runs the all-reduce of the
        "still training" flags (every rank of the group must reach it, the
        joined ones from their shadow loop); the others only read the result.

        Returns:
            The group ranks training in this iteration, or None outside a Join.

        Raises:
            CollectiveError: ``throw_on_early_termination`` and some rank has
                run out of inputs (raised on every rank).
        """
        ctx = _CONTEXTS.get(id(joinable))
        if ctx is None:
            return None
        if not ctx.first:
            return ctx.active
        join = ctx.join
        active = join._exchange(1)
        for j in join.joinables:
            _CONTEXTS[id(j)].active = active
        if ctx.throw and len(active) < join.world:
            raise CollectiveError(join._early_message(active))
        return active

    @staticmethod
    def context_of(joinable: Joinable) -> Any:
        """The running context of ``joinable`` (internal), or None."""
        return _CONTEXTS.get(id(joinable))
