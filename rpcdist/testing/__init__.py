"""Helpers to run several workers for tests, examples and benchmarks.

* :func:`local_agents` starts N agents inside this process (each with its own
  event-loop thread), over loopback gRPC.
* :func:`run_workers` runs a function on N worker processes (``spawn``), with
  a hard timeout; every process is killed on exit, even on failure.

Everything listens on 127.0.0.1 on ports the OS picks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import queue
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from .._errors import RpcdistError, RpcTimeoutError
from .._options import RpcOptions
from .._rpc._agent import Agent
from .._rpc._context import bind_agent, reset_agent, set_default_agent
from .._transport._faults import Fault, FaultInjector

__all__ = [
    "Fault",
    "FaultInjector",
    "WorkerFailed",
    "as_current",
    "local_agents",
    "run_workers",
]


class WorkerFailed(RpcdistError):
    """A worker process started by :func:`run_workers` failed or timed out."""

    __module__ = "rpcdist.testing"


def _file_init_method(tmpdir: str) -> str:
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
        init = _file_init_method(tmp)
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


def _worker_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "RPCDIST_INIT_METHOD": init_method}
    )
    try:
        value = fn(rank, world_size, init_method, *args)
        results.put((rank, True, value))
    except BaseException as e:
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        set_default_agent(None)


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    allow_exit: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, init_method, *args)`` in ``world_size`` processes.

    ``fn`` must be importable (module level). Returns the values in rank
    order (``None`` for ranks in ``allow_exit`` whose process ended without a
    value, e.g. one a test kills on purpose). Processes still alive when the
    call returns or raises are killed.

    Raises:
        WorkerFailed: a worker raised, exited abnormally or the timeout passed.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    out: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rpcdist-") as tmp:
        init = _file_init_method(tmp)
        procs = [
            ctx.Process(
                target=_worker_main,
                args=(fn, r, world_size, init, args, dict(env or {}), results),
                name=f"rpcdist-worker-{r}",
                daemon=True,
            )
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            end = time.monotonic() + timeout
            failures: list[str] = []
            expected = set(range(world_size)) - set(allow_exit)
            reported: set[int] = set()
            while not expected <= reported:
                left = end - time.monotonic()
                if left <= 0:
                    raise WorkerFailed(
                        f"workers {sorted(expected - reported)} did not finish within {timeout} s"
                    ) from RpcTimeoutError("run_workers timeout")
                try:
                    rank, ok, value = results.get(timeout=min(left, 0.5))
                except queue.Empty:
                    dead = [
                        p
                        for i, p in enumerate(procs)
                        if i in expected - reported and p.exitcode not in (None, 0)
                    ]
                    if dead and results.empty():
                        codes = {p.name: p.exitcode for p in dead}
                        raise WorkerFailed(f"worker processes died: {codes}") from None
                    continue
                reported.add(rank)
                if ok:
                    out[rank] = value
                else:
                    failures.append(f"rank {rank}: {value}")
            if failures:
                raise WorkerFailed("worker(s) failed:\n" + "\n".join(failures))
            for p in procs:
                p.join(timeout=max(0.1, end - time.monotonic()))
            return [out.get(r) for r in range(world_size)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
            results.close()
            results.join_thread()
