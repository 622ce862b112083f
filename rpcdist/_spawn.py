"""``rpcdist.spawn``: run a function in N local processes, as ranks of one job.

Each process gets the environment the launcher would give it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` and a fresh job token), so ``init_rpc(name)`` and
``init_process_group()`` need no arguments. The first process to fail
takes the others down with it, and its error is raised in the parent.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import traceback
from collections.abc import Callable
from typing import Any

from ._errors import ConfigError, RpcdistError
from .launch._hosting import free_port

__all__ = ["ProcessFailedError", "spawn"]

#: How long the others get to exit after SIGTERM once one has failed.
_GRACE_S = 5.0


class ProcessFailedError(RpcdistError):
    """A process started by :func:`spawn` raised or exited non-zero.

    Attributes:
        rank: The first process that failed.
        exitcode: Its exit code (negative: the signal that ended it).
        remote_traceback: Its exception's traceback, or ``""`` if it died
            without one (killed, or ``os._exit``).
    """

    __module__ = "rpcdist"

    def __init__(self, message: str, rank: int, exitcode: int, remote_traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback


def _child(
    fn: Callable[..., Any],
    rank: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    errors: multiprocessing.connection.Connection,
) -> None:
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    try:
        fn(rank, *args)
    except BaseException:
        errors.send(traceback.format_exc()[-32_000:])  # stays within a pipe's buffer
        errors.close()
        raise SystemExit(1) from None
    errors.close()


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = ()) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes and wait for all.

    ``fn`` must be picklable by reference (a module-level function); the
    processes start with the ``spawn`` method. Each sees the launcher's
    variables (``MASTER_ADDR``/``MASTER_PORT`` from the parent's environment
    when set, else 127.0.0.1 and a free port; ``RPCDIST_TOKEN`` likewise, else
    a fresh one), so the ranks form a job with no further arguments.

    Raises:
        ConfigError: ``nprocs`` is not a positive integer.
        ProcessFailedError: a process raised or exited non-zero; the others
            were stopped (SIGTERM, then SIGKILL after 5 s).
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"spawn: nprocs must be a positive integer, got {nprocs!r}")
    env = {
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port("127.0.0.1")),
        "RPCDIST_TOKEN": os.environ.get("RPCDIST_TOKEN") or secrets.token_hex(16),
    }
    ctx = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    pipes: list[multiprocessing.connection.Connection] = []
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(fn, rank, tuple(args), env, writer), daemon=False)
            p.start()
            writer.close()
            procs.append(p)
            pipes.append(reader)
        _wait(procs, pipes)
    finally:
        _stop(procs)
        for reader in pipes:
            reader.close()


def _wait(procs: list[Any], pipes: list[multiprocessing.connection.Connection]) -> None:
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            rank = running.pop(sentinel)  # type: ignore[call-overload]
            procs[rank].join()
            code = procs[rank].exitcode
            if code == 0:
                continue
            tb = _traceback_from(pipes[rank])
            if code is not None and code < 0:
                how = f"was killed by {signal.Signals(-code).name}"
            else:
                how = f"exited with code {code}"
            last = tb.strip().splitlines()[-1] if tb else "no Python traceback"
            raise ProcessFailedError(
                f"spawn: process {rank} {how} ({last})"
                + (f"\n\n--- process {rank}'s traceback ---\n{tb}" if tb else ""),
                rank,
                code if code is not None else -1,
                tb,
            )


def _traceback_from(reader: multiprocessing.connection.Connection) -> str:
    try:
        return str(reader.recv()) if reader.poll() else ""
    except EOFError:  # it died without sending one
        return ""


def _stop(procs: list[Any]) -> None:
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    for p in alive:
        p.join(_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
