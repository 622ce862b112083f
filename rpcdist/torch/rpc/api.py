"""``torch.distributed.rpc.api``: the public calls, and the private helpers
that programs and libraries reach for (``_all_gather``, ``_barrier``,
``_get_current_rpc_agent().get_worker_infos()``, ``_require_initialized``).

Where torch's helpers wait without limit or log a failure and go on, these
wait at most the timeout and raise: a barrier that fails says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ..._errors import NotInitializedError
from ..._rpc import _api
from ..._rpc._context import current_agent
from ..._rref._rref import RRef
from ..._worker import WorkerInfo
from .._constants import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT
from .._gather import all_gather
from .._rpc import get_rpc_timeout, get_worker_info, remote, rpc_async, rpc_sync, shutdown

__all__ = [
    "RRef",
    "WorkerInfo",
    "_all_gather",
    "_barrier",
    "_get_current_rpc_agent",
    "_is_current_rpc_agent_set",
    "_require_initialized",
    "_wait_all_workers",
    "get_rpc_timeout",
    "get_worker_info",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

F = TypeVar("F", bound=Callable[..., Any])


class _AgentView:
    """What ``_get_current_rpc_agent()`` returns: the queries programs make of
    torch's agent object."""

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        """This worker's :class:`WorkerInfo`, or that of ``worker_name``."""
        return _api.get_worker_info(worker_name)

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker of the job, in rank order."""
        return list(current_agent().workers)

    def get_debug_info(self) -> dict[str, Any]:
        """rpcdist's snapshot of outstanding work (``rpcdist.debug_info()``)."""
        return _api.debug_info()


def _is_current_rpc_agent_set() -> bool:
    """Whether ``init_rpc`` ran in this process and ``shutdown`` did not yet."""
    try:
        current_agent()
    except NotInitializedError:
        return False
    return True


def _get_current_rpc_agent() -> _AgentView:
    """This process's agent, for ``get_worker_infos()`` and the like.

    Raises:
        NotInitializedError: ``init_rpc`` was not called.
    """
    current_agent()
    return _AgentView()


def _require_initialized(func: F) -> F:
    """``func``, raising ``NotInitializedError`` when called before ``init_rpc``."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        current_agent()
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _all_gather(
    obj: Any, worker_names: Iterable[str] | None = None, timeout: float = UNSET_RPC_TIMEOUT
) -> dict[str, Any]:
    """``{name: obj}`` from every worker in ``worker_names`` (default: all).

    Every worker of the set calls it; calls over one set pair up in order.
    ``timeout``: seconds; ``-1``: the default RPC timeout; ``0``: none.

    Raises:
        RpcTimeoutError: workers missing after ``timeout`` (named).
        WorkerLostError: a worker of the set was lost first.
        ConfigError: an unknown worker name, or this worker not in the set.
    """
    return all_gather(obj, worker_names, timeout)


def _barrier(worker_names: Iterable[str]) -> None:
    """Wait until every worker in ``worker_names`` has called it.

    Raises (where torch logs and returns): see :func:`_all_gather`.
    """
    all_gather(None, set(worker_names))


def _wait_all_workers(timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Wait until every worker of the job has called it (``0``: no limit)."""
    all_gather(None, None, timeout)
