"""Process-group lifecycle: ``init_process_group``, ``new_group``, ranks, ``destroy``.

The collective calls themselves are in :mod:`._calls`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .._errors import ConfigError, NotInitializedError, RpcdistError
from .._rpc._api import release_agent, start_agent_for
from .._rpc._context import current_agent, default_agent
from ._group import ABORT, ProcessGroup, on_abort
from ._state import CollectiveState, normalize_backend

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = [
    "attach",
    "destroy_process_group",
    "detach",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "state",
]

_log = logging.getLogger(__name__)
_KEY = "collectives"
#: Default seconds a collective may take before ``RpcTimeoutError``.
DEFAULT_TIMEOUT = 300.0


def state() -> CollectiveState:
    """The current agent's collective state.

    Raises:
        NotInitializedError: no process group is initialised.
    """
    try:
        agent = current_agent()
    except NotInitializedError:
        agent = None
    st = agent.registry.extensions.get(_KEY) if agent is not None else None
    if not isinstance(st, CollectiveState):
        raise NotInitializedError(
            "no process group: call rpcdist.collectives.init_process_group() first"
        )
    return st


def _check_backend(backend: str) -> str:
    return normalize_backend(backend)


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0
    ):
        raise ConfigError(f"timeout must be seconds or None, got {timeout!r}")
    return float(timeout) if timeout else None


def attach(
    agent: Agent, backend: str = "auto", timeout: float | None = DEFAULT_TIMEOUT
) -> CollectiveState:
    """Set up the collective layer on a running agent (collective over all ranks).

    ``init_process_group`` uses this; tests use it on in-process agents.

    Raises:
        ConfigError: a bad backend, or already attached.
        RpcTimeoutError: a rank did not join in time.
    """
    _check_backend(backend)
    timeout = _check_timeout(timeout)
    if agent.registry.extensions.get(_KEY) is not None:
        raise ConfigError("a process group is already initialised on this agent")
    # Peers may send aborts as soon as their setup passed its store barrier.
    agent.registry.add_handler(ABORT, on_abort)
    st = CollectiveState(agent, backend, timeout)
    agent.run(st.setup(agent.options.init_timeout), "init_process_group()")
    agent.registry.install(st)
    return st


def detach(agent: Agent) -> bool:
    """Tear the collective layer off ``agent``; whether it ended cleanly."""
    st = agent.registry.extensions.get(_KEY)
    if not isinstance(st, CollectiveState):
        return True
    agent.registry.remove(_KEY)
    clean = not any(g.broken for g in st.groups.values()) and not st.dead_peers(
        range(agent.world_size)
    )
    agent.check_not_loop_thread("destroy_process_group()")
    st.destroy()
    return clean


def init_process_group(
    backend: str = "auto",
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> None:
    """Join the default process group (blocks until every rank has joined).

    Standalone it starts this process's agent; after ``rpcdist.init_rpc`` it
    uses the same agent (one transport for both); a later ``init_rpc``
    adopts the agent started here.

    Args:
        backend: ``"auto"`` (shared memory on one host, the message ring
            over the agent's links across hosts, NCCL for CuPy buffers when
            every rank has its own GPU), ``"shm"``, ``"ring"`` (``"grpc"``,
            its former name, is accepted) or ``"nccl"``.
        init_method: ``env://`` (default), ``tcp://host:port`` or ``file://``.
        rank: This process's rank (default: ``RANK``).
        world_size: Number of processes (default: ``WORLD_SIZE``).
        timeout: Seconds a collective may take (``None``: no limit); also
            bounds the rendezvous.

    Raises:
        ConfigError: bad arguments, or already initialised.
        ConnectError: the rendezvous store could not be reached.
        RpcTimeoutError: not every rank joined in time.
    """
    _check_backend(backend)
    timeout = _check_timeout(timeout)
    existing = default_agent()
    if existing is not None and not existing.closed:
        if existing.registry.extensions.get(_KEY) is not None:
            raise ConfigError("init_process_group() was already called in this process")
        if (rank is not None and rank != existing.rank) or (
            world_size is not None and world_size != existing.world_size
        ):
            raise ConfigError(
                f"init_process_group(rank={rank}, world_size={world_size}) does not match the "
                f"running agent (rank {existing.rank}, world size {existing.world_size})"
            )
    agent = start_agent_for(
        "collectives", rank, world_size, init_method=init_method, timeout=timeout or 60.0
    )
    try:
        attach(agent, backend, timeout)
    except BaseException:
        release_agent(agent, "collectives", graceful=False)
        raise


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or (``None``) every group and leave the collective layer.

    Leaving is collective when no RPC role keeps the agent: every rank should
    call it. After a failure (a broken group or a dead peer) the agent shuts
    down at once instead of waiting for the others.

    Raises:
        NotInitializedError: no process group is initialised.
    """
    st = state()
    agent = st.agent
    if group is not None and group is not st.world:
        agent.check_not_loop_thread("destroy_process_group()")
        st.destroy(group.gid)
        return
    clean = detach(agent)
    try:
        release_agent(agent, "collectives", graceful=clean)
    except RpcdistError as e:
        _log.warning("leaving the process group: %s", e)


def is_initialized() -> bool:
    """Whether this process (or the current agent) has a process group."""
    try:
        state()
    except NotInitializedError:
        return False
    return True


def new_group(
    ranks: Iterable[int] | None = None, timeout: float | None = None, backend: str | None = None
) -> ProcessGroup:
    """Create a group of ``ranks`` (default: all); every process must call it, in the same order.

    Members set the group up together (shared memory, for instance); a
    non-member gets a group object whose collectives raise ``CollectiveError``
    and whose ``get_rank``/``get_world_size`` are ``-1``.

    Raises:
        ConfigError: ranks out of range or repeated, or a bad backend.
    """
    st = state()
    n = st.agent.world_size
    members = list(range(n)) if ranks is None else list(ranks)
    for r in members:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
            raise ConfigError(f"new_group: rank {r!r} is not in [0, {n})")
    if len(set(members)) != len(members) or not members:
        raise ConfigError(f"new_group: ranks must be distinct and non-empty, got {members}")
    chosen = _check_backend(backend or st.backend)
    limit = st.timeout if timeout is None else _check_timeout(timeout)
    gid = st.next_gid()
    group: ProcessGroup = st.agent.run(
        st.make_group(gid, tuple(sorted(members)), chosen, limit), "new_group()"
    )
    return group


def resolve(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the default group for ``None``."""
    if group is None:
        world = state().world
        assert world is not None
        return world
    if not isinstance(group, ProcessGroup):
        raise ConfigError(f"group must be a ProcessGroup or None, got {type(group).__name__}")
    return group


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default group: the global rank); -1 if not a member.

    Raises:
        NotInitializedError: no process group is initialised.
    """
    return resolve(group).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group``; -1 if this process is not a member.

    Raises:
        NotInitializedError: no process group is initialised.
    """
    g = resolve(group)
    return g.size if g.is_member else -1


def get_backend(group: ProcessGroup | None = None) -> str:
    """The engine ``group`` uses for NumPy buffers (``"shm"`` or ``"ring"``).

    Raises:
        NotInitializedError: no process group is initialised.
    """
    return resolve(group).backend
