"""The module-level RPC API: ``init_rpc``, ``rpc_sync``, ``rpc_async``, ``shutdown``."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from .._deadline import UNSET, Unset
from .._errors import ConfigError, NotInitializedError
from .._futures import Future
from .._options import RpcOptions
from .._store import parse_init_method
from .._worker import WorkerInfo
from ._agent import Agent
from ._context import current_agent, default_agent, set_default_agent

__all__ = [
    "debug_info",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "release_agent",
    "rpc_async",
    "rpc_sync",
    "set_rpc_timeout",
    "shutdown",
    "start_agent_for",
    "statistics",
]

_init_lock = threading.Lock()
To = str | int | WorkerInfo


def init_rpc(
    name: str,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    init_method: str | None = None,
    rpc_timeout: float | None = 60.0,
    num_worker_threads: int = 16,
    options: RpcOptions | None = None,
) -> None:
    """Start this process's agent and rendezvous with the other workers.

    Blocks until every one of ``world_size`` workers has joined. Without a
    world size (none given, none in ``init_method``'s query, no
    ``WORLD_SIZE``), the worker starts (rank 0) or joins a *dynamic group*,
    as PyTorch's: it returns once every member knows it, and its
    ``shutdown()`` leaves the group while the others go on (see
    ``docs/guides/rpc.md``, "Workers that join and leave").

    Args:
        name: This worker's unique name (1-127 letters, digits, ``_ - :``).
        rank: This worker's rank; defaults to ``RANK`` from the environment.
        world_size: Number of workers; defaults to ``WORLD_SIZE``; none at
            all: a dynamic group.
        init_method: ``env://`` (default), ``tcp://host:port`` or ``file:///path``.
        rpc_timeout: Default timeout of calls in seconds (``None``/0: none).
        num_worker_threads: Size of the pool running plain-function handlers.
        options: Further :class:`RpcOptions`.

    Without a job token (``RpcOptions.token``, ``RPCDIST_TOKEN``) the job
    still authenticates its store and links with a secret rank 0 makes and
    shares through a file only its user can read: such a job runs on one host,
    as one user, on loopback (docs/threat-model.md).

    Raises:
        ConfigError: bad arguments, duplicate names, already initialised,
            listening or meeting beyond loopback without a token or TLS, a
            dynamic worker meeting a job with a world size (or the reverse),
            or a joiner whose rank or name a live member has.
        ConnectError: the rendezvous store could not be reached in time, or
            this rank's job token was refused.
        RpcTimeoutError: a rank did not arrive within ``init_timeout`` (the
            message counts the calls the store refused meanwhile, and from where).
    """
    with _init_lock:
        existing = default_agent()
        if existing is not None and not existing.closed:
            if "rpc" not in existing.roles:
                _adopt(existing, name, rank, world_size, rpc_timeout)
                return
            raise ConfigError(
                f"rpcdist is already initialised in this process as {existing.name!r}; "
                "call rpcdist.shutdown() first"
            )
        agent = Agent(
            name,
            rank,
            world_size,
            init_method=init_method,
            rpc_timeout=rpc_timeout,
            num_worker_threads=num_worker_threads,
            options=options,
        )
        agent.start()
        agent.roles.add("rpc")
        set_default_agent(agent)


def _adopt(
    agent: Agent, name: str, rank: int | None, world_size: int | None, rpc_timeout: float | None
) -> None:
    """Serve RPC on the agent a process group already started (one transport)."""
    if (rank is not None and rank != agent.rank) or (
        world_size is not None and world_size != agent.world_size
    ):
        raise ConfigError(
            f"init_rpc(rank={rank}, world_size={world_size}) does not match the process "
            f"group already running (rank {agent.rank}, world size {agent.world_size})"
        )
    agent.run(agent.rename(name, agent.options.init_timeout), "init_rpc()")
    agent.rpc_timeout = rpc_timeout
    agent.roles.add("rpc")


def start_agent_for(
    role: str,
    rank: int | None,
    world_size: int | None,
    *,
    init_method: str | None,
    timeout: float,
    options: RpcOptions | None = None,
) -> Agent:
    """The process's agent with ``role`` added, starting one if none runs.

    A standalone agent (for ``init_process_group``) is named ``rank<N>``;
    a later ``init_rpc`` adopts it and gives it its own name.
    """
    with _init_lock:
        agent = default_agent()
        if agent is None or agent.closed:
            opts = dataclasses.replace(options or RpcOptions(), init_timeout=timeout)
            # The rank may come from the environment or init_method: resolve it
            # first, so that the transport and the store see the final name.
            spec = parse_init_method(init_method, rank, world_size)
            agent = Agent(
                f"rank{spec.rank}", rank, world_size, init_method=init_method, options=opts
            )
            agent.start()
            set_default_agent(agent)
        elif agent.dynamic:
            raise ConfigError(
                f"this process's agent {agent.name!r} is in a dynamic group (init_rpc without "
                f"a world size), which {role} cannot use: they need a fixed world size"
            )
        agent.roles.add(role)
        return agent


def release_agent(
    agent: Agent, role: str, *, graceful: bool = True, timeout: float | None = None
) -> list[WorkerInfo]:
    """Drop ``role``; shut the agent down when no role is left. Returns the
    lost workers a graceful shutdown went on without."""
    with _init_lock:
        agent.roles.discard(role)
        if agent.roles:
            return []
        try:
            return agent.shutdown(graceful, timeout)
        finally:
            if default_agent() is agent:
                set_default_agent(None)


def shutdown(graceful: bool = True, timeout: float | None = None) -> list[WorkerInfo]:
    """Shut down this process's agent.

    In a dynamic group (``init_rpc`` without a world size) a member's
    graceful shutdown leaves the group alone (the others go on; calls to it
    then raise ``WorkerLostError``), and rank 0's waits until every other
    member has left. Otherwise, a graceful shutdown is collective: it waits
    until every live worker has called ``shutdown`` (as long as they keep
    working, unless ``timeout`` is
    given: a parameter server may call it at once and serve its trainers
    until they finish) and then until no worker has calls in flight
    (fire-and-forget nested chains included, for at most ``timeout`` or
    ``RpcOptions.shutdown_timeout``), then closes. It keeps serving calls
    while it waits. Workers lost before or during it
    (dead, hung or cut off; see ``docs/failure-model.md``) are not waited
    for: it finishes on the survivors within about a second of the loss
    being detected, logs a warning naming them, and returns them. A
    non-graceful one fails pending calls with ``ClosedError`` and closes at
    once.

    Returns:
        The :class:`WorkerInfo` of each lost worker a graceful shutdown went
        on without (empty when none was lost, and after a non-graceful one).

    Raises:
        NotInitializedError: ``init_rpc`` was not called.
        RpcTimeoutError: a graceful shutdown did not finish within ``timeout``
            (or its drain within ``RpcOptions.shutdown_timeout``; the agent is
            closed anyway); its ``snapshot`` says what was outstanding.
    """
    agent = default_agent()
    if agent is None or agent.closed or "rpc" not in agent.roles:
        raise NotInitializedError("rpcdist.shutdown() called but rpcdist is not initialised")
    return release_agent(agent, "rpc", graceful=graceful, timeout=timeout)


def debug_info() -> dict[str, Any]:
    """What this process's agent has outstanding now, for diagnosing a hang.

    Plain data: ``pending_calls`` (per peer: how many, and the oldest with
    their age and remaining deadline), ``blocking_calls``,
    ``handlers_running``, ``calls_sent`` and ``calls_handled``,
    ``lost_workers`` (name -> why), ``links``, and one entry per layer:
    ``collectives`` (each group's issued sequence number, running op and
    counts), ``rref`` (owned and held RRefs) and ``autograd`` (live
    contexts). Every ``RpcTimeoutError`` the agent raises carries the same
    snapshot as ``.snapshot``. Compare the snapshots of two workers to see
    who waits for whom.

    Raises:
        NotInitializedError: no agent is running in this process.
    """
    return current_agent().debug_info()


def rpc_async(
    to: To,
    func: Callable[..., Any],
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | Unset | None = UNSET,
) -> Future[Any]:
    """Run ``func(*args, **kwargs)`` on worker ``to``; return a Future at once.

    Args:
        to: Worker name, rank or :class:`WorkerInfo`.
        func: A module-level function (or static/class method), sent by name.
        args: Positional arguments.
        kwargs: Keyword arguments.
        timeout: Seconds; ``UNSET`` for the default, ``None``/0 for none.

    Raises:
        NotInitializedError: no agent is running.
        ConfigError: unknown worker or bad arguments.
        SerializationError: ``func`` or an argument cannot be sent (raised here,
            naming where it sat).
    """
    return current_agent().rpc_async(to, func, args, kwargs, timeout)


def rpc_sync(
    to: To,
    func: Callable[..., Any],
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | Unset | None = UNSET,
) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    Raises:
        RpcTimeoutError: no reply before the deadline.
        WorkerLostError: the callee went away.
        WrongThreadError: called on the agent's event-loop thread (use
            ``await rpc_async(...)`` there).
        Exception: what ``func`` raised on the callee, with ``remote_traceback``.
    """
    return current_agent().rpc_sync(to, func, args, kwargs, timeout)


def get_worker_info(name: str | None = None) -> WorkerInfo:
    """This worker's :class:`WorkerInfo`, or that of the worker called ``name``.

    Raises:
        ConfigError: no worker has that name.
    """
    agent = current_agent()
    return agent.info if name is None else agent.worker(name)


def get_rpc_timeout() -> float | None:
    """The current agent's default timeout in seconds (``None``: no timeout)."""
    return current_agent().rpc_timeout


def set_rpc_timeout(timeout: float | None) -> None:
    """Change the default timeout; calls already made keep theirs.

    Raises:
        ConfigError: a negative or non-numeric timeout.
    """
    if timeout is not None and not isinstance(timeout, int | float):
        raise ConfigError(f"timeout must be seconds or None, got {timeout!r}")
    current_agent().rpc_timeout = timeout


def statistics() -> dict[str, int]:
    """What this process's agent has in flight and has done, for debugging
    leaks and hangs: one flat dict.

    Gauges (0 when idle): ``pending_calls``, ``inflight_handlers``,
    ``queued_frames``, ``outgoing_streams`` and ``incoming_streams`` (links),
    ``p2p_unclaimed`` and ``p2p_posted``; RRefs: ``rref_owners`` (values
    owned here), ``rref_forks`` (user RRefs elsewhere that hold them),
    ``rref_users``, ``rref_pending_users`` and ``rref_pending_children``
    (forks waiting for the owner's confirmation), ``rref_outbox``;
    collectives (when a process group is up): ``collectives_queued`` and
    ``collectives_inflight``; distributed autograd: ``autograd_contexts``;
    CUDA IPC: ``cuda_ipc_lends`` (CuPy arrays sent by handle whose receiver
    has not yet released them) and ``cuda_ipc_block_bytes`` (device memory
    held for sending them; back to 0 about a minute after the last one).
    ``lost_workers``: workers declared lost (it stays up after a loss);
    ``members``: in a dynamic group, the members this worker knows.
    Counters: ``calls_sent``, ``calls_handled``, ``direct_sync_calls``,
    ``busy_polls``, ``busy_poll_hits`` and ``busy_poll_yields`` (waits on
    those calls' connections, at either end, that began by polling, those
    whose bytes came meanwhile, and those that stopped polling, or did not
    start, because bytes came for another thread of the worker or the host
    was crowded: ``RpcOptions.busy_poll_us``),
    ``heartbeats_sent``,
    ``collectives_completed``, ``collectives_failed``, ``cuda_ipc_sent``, ``cuda_ipc_received`` and others. ``debug_info()``
    says more about what is outstanding.

    Raises:
        NotInitializedError: no agent is running in this process.
    """
    return current_agent().statistics()
