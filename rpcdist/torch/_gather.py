"""Gathering an object from every worker over RPC: ``rpc.api._all_gather``.

PyTorch RPC programs (and libraries built on it: PyTorch Geometric's
distributed loaders, torch's sharded tensors) call the private helpers
``rpc.api._all_gather``/``_barrier`` to exchange small objects or line the
workers up, so ``rpcdist.torch.rpc.api`` offers them with torch's meaning:
every worker of the set calls with its object and gets ``{name: object}``
for all of them; calls over the same set of workers pair up by their order.

How: the worker with the smallest name leads. Each of the others makes one
call to it (:func:`gather_at_leader`, an ``async`` handler, so waiting holds
no thread there) whose reply is the whole map, sent once the last object has
arrived. Unlike torch's, the wait is bounded on every worker: by the timeout
(the agent's default unless given), or at once when a worker of the set is
lost (``WorkerLostError``) or the agent shuts down.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._deadline import Unset
from .._errors import ClosedError, ConfigError, RpcTimeoutError
from .._futures import Future
from .._rpc import _api
from .._rpc._agent import Agent
from .._rpc._context import current_agent
from .._rpc._registry import BaseExtension
from ._constants import UNSET_RPC_TIMEOUT
from ._rpc import _timeout

__all__ = ["all_gather", "gather_at_leader"]

#: A follower's call to the leader outlives the leader's own wait by this
#: much, so that the leader's error (which names the missing workers) is
#: what the follower sees.
_GRACE = 2.0


class _Round:
    """One gather on its leader: the objects so far and who is still missing."""

    __slots__ = ("done", "names", "objects")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.objects: dict[str, Any] = {}
        self.done: Future[dict[str, Any]] = Future()

    def missing(self) -> list[str]:
        return [n for n in self.names if n not in self.objects]


class _Gathers(BaseExtension):
    """One agent's gathers: its sequence numbers, and the rounds it leads."""

    name = "torch_gather"

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._seq: dict[str, int] = {}
        self._rounds: dict[str, _Round] = {}

    def next_key(self, names: list[str]) -> str:
        """The key of this worker's next gather over ``names`` (sorted)."""
        group = "\x1f".join(names)
        with self._lock:
            n = self._seq.get(group, 0)
            self._seq[group] = n + 1
        return f"{group}\x1e{n}"

    def arrive(self, key: str, name: str, obj: Any, names: list[str]) -> _Round:
        """Worker ``name`` brings ``obj`` to round ``key`` (made on first arrival)."""
        agent = self._agent
        with self._lock:
            rnd = self._rounds.get(key)
            new = rnd is None
            if rnd is None:
                rnd = self._rounds[key] = _Round(names)
            if name not in rnd.names:
                raise ConfigError(f"_all_gather: worker {name!r} is not one of {rnd.names}")
            if name in rnd.objects:
                raise ConfigError(f"_all_gather: worker {name!r} arrived twice at one round")
            rnd.objects[name] = obj
            complete = len(rnd.objects) == len(rnd.names)
            if complete:
                del self._rounds[key]
        if complete:
            rnd.done.set_result(dict(rnd.objects))
            return rnd
        live = agent.liveness
        ranks = [agent.worker(n).id for n in rnd.missing()]
        lost = [r for r in ranks if live.is_lost(r)]
        if lost:
            self._fail(key, rnd, live.error(lost[0], "_all_gather"))
        elif new:
            # Links to the workers we wait for, so that the failure detector
            # watches them (a death or a hang ends the wait, not the timeout).
            for r in ranks:
                live.watch_threadsafe(r)
        return rnd

    def expire(self, key: str, rnd: _Round, timeout: float) -> RpcTimeoutError:
        """The error of a wait on ``rnd`` that ran out; the round is dropped."""
        with self._lock:
            missing = rnd.missing()
            if self._rounds.get(key) is rnd:
                del self._rounds[key]
        return RpcTimeoutError(
            f"_all_gather on {self._agent.name!r}: workers {missing} did not arrive within "
            f"{timeout:g} s"
        )

    def _fail(self, key: str, rnd: _Round, exc: BaseException) -> None:
        """Fail ``rnd`` unless it completed, expired or failed meanwhile."""
        with self._lock:
            if self._rounds.get(key) is not rnd:
                return
            del self._rounds[key]
        rnd.done.set_exception(exc)

    def _fail_where(
        self, pick: Callable[[_Round], bool], error: Callable[[], BaseException]
    ) -> None:
        with self._lock:
            rounds = [(k, r) for k, r in self._rounds.items() if pick(r)]
        for key, rnd in rounds:
            self._fail(key, rnd, error())

    def peer_lost(self, rank: int) -> None:
        name = self._agent.workers[rank].name
        live = self._agent.liveness
        self._fail_where(lambda r: name in r.missing(), lambda: live.error(rank, "_all_gather"))

    def close(self) -> None:
        self._fail_where(lambda r: True, lambda: ClosedError("the rpcdist agent shut down"))

    async def gather(
        self, key: str, name: str, obj: Any, names: list[str], timeout: float | None
    ) -> dict[str, Any]:
        """Bring ``obj`` to round ``key`` (here, at its leader) and wait for
        the whole map, at most ``timeout`` seconds (on the loop)."""
        rnd = self.arrive(key, name, obj, names)
        try:
            return await asyncio.wait_for(rnd.done, timeout)
        except TimeoutError:
            if rnd.done.done():  # (its own error, not the wait's)
                return rnd.done.value()
            raise self.expire(key, rnd, timeout or 0.0) from None

    def statistics(self) -> Mapping[str, int]:
        with self._lock:
            return {"torch_gather_rounds": len(self._rounds)}


def _gathers(agent: Agent) -> _Gathers:
    return agent.extension(_Gathers.name, lambda: _Gathers(agent))


async def gather_at_leader(
    key: str, name: str, obj: Any, names: list[str], timeout: float | None
) -> dict[str, Any]:
    """A follower's object arrives at the leader; the reply is the whole map."""
    return await _gathers(current_agent()).gather(key, name, obj, names, timeout)


def _names(agent: Agent, worker_names: Iterable[str] | None) -> list[str]:
    if not worker_names:
        return sorted(w.name for w in agent.workers)
    if isinstance(worker_names, str):
        raise ConfigError(
            f"_all_gather: worker_names must be a collection of names, got {worker_names!r}"
        )
    names = sorted(set(worker_names))
    for n in names:
        agent.worker(n)  # ConfigError for an unknown name
    if agent.name not in names:
        raise ConfigError(f"_all_gather: this worker ({agent.name!r}) is not in {names}")
    return names


def _seconds(agent: Agent, timeout: Any) -> float | None:
    """torch's ``timeout`` (``-1``: the default, ``0``: none) in seconds."""
    valid = timeout is None or (isinstance(timeout, int | float) and timeout >= 0)
    if not valid and timeout != UNSET_RPC_TIMEOUT:
        raise ConfigError(f"_all_gather: timeout must be seconds >= 0, got {timeout!r}")
    seconds = _timeout(timeout)
    return agent.rpc_timeout if isinstance(seconds, Unset) else seconds


def all_gather(
    obj: Any, worker_names: Iterable[str] | None = None, timeout: float = UNSET_RPC_TIMEOUT
) -> dict[str, Any]:
    """``{name: obj}`` of every worker in ``worker_names`` (default: all).

    Every worker of the set must call it; calls over the same set pair up in
    the order each worker makes them.

    Args:
        obj: This worker's object.
        worker_names: The workers taking part (this one among them).
        timeout: Seconds to wait for all of them; ``-1``: the agent's default
            timeout; ``0``: none.

    Raises:
        ConfigError: an unknown worker, or this one not in the set.
        RpcTimeoutError: some workers did not arrive in time (named).
        WorkerLostError: a worker of the set was lost first.
        WrongThreadError: called on the agent's event-loop thread.
    """
    agent = current_agent()
    agent.check_not_loop_thread("_all_gather()")
    names = _names(agent, worker_names)
    seconds = _seconds(agent, timeout)
    g = _gathers(agent)
    key = g.next_key(names)
    leader = names[0]
    if leader != agent.name:
        got: dict[str, Any] = _api.rpc_sync(
            leader,
            gather_at_leader,
            args=(key, agent.name, obj, names, seconds),
            timeout=None if seconds is None else seconds + _GRACE,
        )
        return got
    return agent.run(g.gather(key, agent.name, obj, names, seconds), "_all_gather()")
