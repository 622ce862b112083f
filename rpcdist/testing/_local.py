"""Several agents inside one process, each with its own event-loop thread."""

import contextlib
import dataclasses
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence

from .._options import RpcOptions
from .._rpc._agent import Agent
from .._rpc._context import bind_agent, reset_agent

__all__ = ["as_current", "file_init_method", "local_agents"]


def file_init_method(tmpdir: str) -> str:
    return "file://" + os.path.join(tmpdir, "rendezvous")


@contextlib.contextmanager
def local_agents(
    n: int,
    *,
    names: Sequence[str] | None = None,
    options: RpcOptions | Sequence[RpcOptions] | None = None,
    rpc_timeout: float | None = 30.0,
    num_worker_threads: int = 4,
    graceful: bool = False,
    shutdown_timeout: float = 30.0,
) -> Iterator[list[Agent]]:
    """Start ``n`` agents in this process; shut them all down on exit.

    The agents share this process's interpreter lock: a full garbage
    collection over a large heap, repeated in a loop, can starve them all
    until their failure detectors declare one another lost (see the RPC
    guide, "Several workers in one process").

    Args:
        n: Number of agents.
        names: Their names (default ``worker0``, ``worker1``, ...).
        options: One RpcOptions for all, or one per agent.
        rpc_timeout: Default call timeout.
        num_worker_threads: Pool size of each agent.
        graceful: Shut down gracefully (collectively) on exit.
        shutdown_timeout: Bound on the graceful shutdown.
    """
    names = list(names or [f"worker{i}" for i in range(n)])
    opts = (
        list(options) if isinstance(options, Sequence) else [options or RpcOptions(token=None)] * n
    )
    with tempfile.TemporaryDirectory(prefix="rpcdist-") as tmp:
        init = file_init_method(tmp)
        agents: list[Agent | None] = [None] * n
        errors: list[BaseException] = []

        def start(i: int) -> None:
            try:
                agents[i] = Agent(
                    names[i],
                    i,
                    n,
                    init_method=init,
                    rpc_timeout=rpc_timeout,
                    num_worker_threads=num_worker_threads,
                    options=dataclasses.replace(opts[i]),
                ).start()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        started = [a for a in agents if a is not None]
        try:
            if errors:
                raise errors[0]
            yield started
        finally:
            _shutdown_all(started, graceful, shutdown_timeout)


def _shutdown_all(agents: list[Agent], graceful: bool, timeout: float) -> None:
    errors: list[BaseException] = []

    def stop(a: Agent) -> None:
        try:
            a.shutdown(graceful=graceful, timeout=timeout)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=stop, args=(a,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors and graceful:
        raise errors[0]


@contextlib.contextmanager
def as_current(agent: Agent) -> Iterator[Agent]:
    """Make ``agent`` the one module-level calls (``rpcdist.rpc_sync``...) use."""
    token = bind_agent(agent)
    try:
        yield agent
    finally:
        reset_agent(token)
