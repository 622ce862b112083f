"""Jobs of worker processes for the fault tests: started fast, always cleaned up.

Worker processes come from a ``forkserver`` that has imported rpcdist, NumPy
and gRPC once (a fork costs milliseconds, a fresh interpreter half a second),
so fifty kill -9 trials fit the suite's budget. Each job has a hard timeout:
whatever is still alive then is killed and the job reported as hung; every
process is killed and reaped before :func:`run_job` returns or raises.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
_PRELOAD = [
    "rpcdist",
    "rpcdist._rpc._api",
    "rpcdist._rref._extension",
    "rpcdist.autograd._extension",
    "rpcdist.collectives",
    "numpy",
    "grpc",
    "rel_funcs",
    "rel_workers",
    "live_workers",
    "netlab",
]
_ctx: Any = None
#: Held around everything that polls a child process. ``Process.start()``
#: polls every child of this process (``multiprocessing.process._cleanup``),
#: and two threads polling one forkserver child race: the loser reads EOF
#: where the exit code was and records 255 for a process that exited 0.
#: The kill -9 test runs two jobs at a time, on two threads.
_POLL = threading.Lock()


def context() -> Any:
    """The forkserver context (made once per test process)."""
    global _ctx
    if _ctx is None:
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p
        )
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _ctx = ctx
    return _ctx


@dataclass
class JobResult:
    """What each rank of a job reported (``None``: it died without a word)."""

    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)
    seconds: float = 0.0


def _main(
    fn: Callable[..., Any], rank: int, args: tuple[Any, ...], conn: Any, dump_after: float
) -> None:
    faulthandler.dump_traceback_later(dump_after, exit=False)  # a hang explains itself
    try:
        conn.send((True, fn(rank, *args)))
    except BaseException as e:
        conn.send((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_job(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    timeout: float = 60.0,
    expect: set[int] | None = None,
) -> JobResult:
    """Run ``fn(rank, world_size, init_method, *args)`` in ``world_size`` processes.

    Waits for a report from each rank in ``expect`` (default: all) or for
    its process to end, at most ``timeout`` seconds; ranks in ``expect``
    still running then are killed and listed in ``hung``. Each rank reports
    on a pipe of its own (a process killed while writing to a shared queue
    would hold its lock forever).
    """
    ctx = context()
    out = JobResult()
    expect = set(range(world_size)) if expect is None else expect
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rpcdist-rel-") as tmp:
        init = f"file://{tmp}/rendezvous"
        pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
        procs = [
            ctx.Process(
                target=_main,
                args=(fn, r, (world_size, init, *args), pipes[r][1], max(1.0, timeout - 2.0)),
                name=f"rel-worker-{r}",
                daemon=True,
            )
            for r in range(world_size)
        ]
        readers = {pipes[r][0]: r for r in range(world_size)}
        try:
            for r, p in enumerate(procs):
                with _POLL:
                    p.start()
                pipes[r][1].close()  # the child holds the only writing end
            end = started + timeout
            while readers and not expect <= set(out.values) | set(out.errors):
                left = end - time.monotonic()
                if left <= 0:
                    break
                for conn in mp.connection.wait(list(readers), timeout=left):
                    r = readers.pop(conn)  # type: ignore[call-overload]
                    try:
                        ok, value = conn.recv()  # type: ignore[union-attr]
                    except (EOFError, OSError):
                        continue  # it died without a word
                    (out.values if ok else out.errors)[r] = value
            for r, p in enumerate(procs):
                if r in expect:  # (waiting on the sentinel reads nothing from it)
                    mp.connection.wait([p.sentinel], max(0.0, min(5.0, end - time.monotonic())))
            with _POLL:
                out.hung = [r for r, p in enumerate(procs) if p.is_alive() and r in expect]
        finally:
            with _POLL:
                live = [p for p in procs if p.pid is not None]  # (started)
                for p in live:
                    if p.is_alive():
                        p.kill()
            for p in live:
                mp.connection.wait([p.sentinel], 5)
            for conn, r in readers.items():  # reports that raced with the end
                try:
                    if conn.poll():  # type: ignore[union-attr]
                        ok, value = conn.recv()  # type: ignore[union-attr]
                        (out.values if ok else out.errors).setdefault(r, value)
                except (EOFError, OSError):
                    pass
            for reader, _ in pipes:
                reader.close()
        with _POLL:
            out.exitcodes = {r: p.exitcode for r, p in enumerate(procs)}
    out.seconds = time.monotonic() - started
    return out
