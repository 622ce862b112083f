"""Worker processes (``spawn``) running one function each, with a hard timeout."""

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

from .._errors import RpcdistError, RpcTimeoutError
from .._rpc._context import set_default_agent
from ._local import file_init_method

__all__ = ["WorkerFailed", "run_workers"]


class WorkerFailed(RpcdistError):
    """A worker process started by :func:`run_workers` failed or timed out."""


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
        init = file_init_method(tmp)
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
