"""The children of one node: environment, spawning, signals, stopping and reaping.

Children stay in the launcher's process group, so ``kill -- -PGID`` stops a
whole node (and a terminal's Ctrl-C reaches them directly as well). On Linux
each child also asks the kernel for ``SIGKILL`` when the launcher dies
(``PR_SET_PDEATHSIG``), so even a launcher killed with ``SIGKILL`` leaves no
worker running behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from ._args import LaunchConfig
from ._output import OutputPump, prefix_for

__all__ = ["POLL_INTERVAL", "WorkerGroup", "child_env", "exit_code", "worker_argv"]

logger = logging.getLogger(__name__)

#: How often the children are polled for their exit.
POLL_INTERVAL = 0.05
_PR_SET_PDEATHSIG = 1
_DRAIN_TIMEOUT = 1.0


def child_env(
    config: LaunchConfig,
    local_rank: int,
    master_port: int,
    *,
    restart_count: int = 0,
    node_rank: int | None = None,
    nnodes: int | None = None,
    token: str | None = None,
    base: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The environment of local worker ``local_rank``: ``base`` plus the job's variables.

    ``node_rank``, ``nnodes`` and ``token`` default to the configuration's;
    the launcher passes the values of the current round of a multi-node job.
    """
    node = config.node_rank if node_rank is None else node_rank
    nodes = config.nnodes if nnodes is None else nnodes
    env = dict(base)
    env.update(
        RANK=str(node * config.nproc_per_node + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nodes * config.nproc_per_node),
        LOCAL_WORLD_SIZE=str(config.nproc_per_node),
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(master_port),
        RPCDIST_TOKEN=config.token if token is None else token,
        RPCDIST_RESTART_COUNT=str(restart_count),
        RPCDIST_MAX_RESTARTS=str(config.max_restarts),
    )
    return env


def exit_code(returncode: int) -> int:
    """A shell-style exit code: ``128 + n`` for a process killed by signal ``n``."""
    return 128 - returncode if returncode < 0 else returncode


# Started as ``python -S -E -c _DIE_WITH_PARENT <launcher pid> <command...>``: ask
# for SIGKILL when the launcher dies, make sure it had not died already, then
# become the worker (``execv`` keeps the pid and the death signal). Doing this
# in a ``preexec_fn`` instead would fork() a launcher that has gRPC threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, {int(signal.SIGKILL)})\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


def worker_argv(command: Sequence[str]) -> list[str]:
    """The argv that starts one worker running ``python COMMAND``.

    On Linux the worker is asked to get ``SIGKILL`` when the launcher dies.
    """
    if sys.platform.startswith("linux"):
        return [sys.executable, "-S", "-E", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
    return [sys.executable, *command]


class WorkerGroup:
    """The children of one attempt on this node: start, watch, stop and reap them.

    Args:
        config: The launcher configuration (command, grace period, prefixing).
        first_rank: Global rank of local rank 0.
    """

    def __init__(self, config: LaunchConfig, first_rank: int) -> None:
        self.config = config
        self.first_rank = first_rank
        self.procs: list[subprocess.Popen[bytes]] = []
        self._pump: OutputPump | None = None
        self._extra_pumps: list[OutputPump] = []  # of restarted children

    def start(self, envs: Sequence[Mapping[str, str]], stop_if: Callable[[], bool]) -> None:
        """Start one child per environment; stop starting once ``stop_if()`` holds.

        Raises:
            OSError: a child could not be started (those started are kept).
        """
        cfg = self.config
        pump = OutputPump() if cfg.prefix_output else None
        self._pump = pump
        pipe = subprocess.PIPE if pump is not None else None
        try:
            for env in envs:
                if stop_if():  # interrupted while starting: start no more
                    return
                if pump is not None:
                    env = {**env}
                    env.setdefault("PYTHONUNBUFFERED", "1")
                proc = subprocess.Popen(worker_argv(cfg.command), env=env, stdout=pipe, stderr=pipe)
                self.procs.append(proc)
                rank = self.first_rank + len(self.procs) - 1
                if pump is not None:
                    assert proc.stdout is not None and proc.stderr is not None
                    pump.add(proc.stdout, prefix_for(rank), "stdout")
                    pump.add(proc.stderr, prefix_for(rank), "stderr")
                logger.debug("started rank %d as pid %d", rank, proc.pid)
        finally:
            if pump is not None:
                pump.start()

    def restart(self, local: int, env: Mapping[str, str]) -> None:
        """Start local rank ``local`` again in ``env`` (``--restart-policy rank``).

        Raises:
            OSError: the child could not be started.
        """
        cfg = self.config
        pump = OutputPump() if self._pump is not None else None
        pipe = subprocess.PIPE if pump is not None else None
        proc = subprocess.Popen(worker_argv(cfg.command), env=dict(env), stdout=pipe, stderr=pipe)
        self.procs[local] = proc
        if pump is not None:
            assert proc.stdout is not None and proc.stderr is not None
            rank = self.first_rank + local
            pump.add(proc.stdout, prefix_for(rank), "stdout")
            pump.add(proc.stderr, prefix_for(rank), "stderr")
            pump.start()
            self._extra_pumps.append(pump)
        logger.debug("restarted local rank %d as pid %d", local, proc.pid)

    def send(self, sig: int) -> None:
        """Send ``sig`` to every child not yet reaped."""
        for p in self.procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # exited, not yet reaped
                    p.send_signal(sig)

    def running(self) -> int:
        """How many children are still running."""
        return sum(p.poll() is None for p in self.procs)

    def poll(self) -> tuple[int, int] | bool:
        """``(local_rank, code)`` of a failed child; else ``True`` when all succeeded.

        ``False`` while some still run and none failed.
        """
        running = False
        for i, p in enumerate(self.procs):
            rc = p.poll()
            if rc is None:
                running = True
            elif rc != 0:
                return i, rc
        return not running

    async def stop(self, sig: int | None = signal.SIGTERM) -> None:
        """Send ``sig`` to the children still running; SIGKILL them after the grace period; reap.

        With ``sig=None`` only the grace period runs (the children were signalled).
        """
        if sig is not None:
            self.send(sig)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.grace_period
        while self.running() and loop.time() < deadline:
            await asyncio.sleep(POLL_INTERVAL)
        stragglers = self.running()
        if stragglers:
            logger.warning(
                "killing %d worker(s) still running %.1f s after they were signalled",
                stragglers,
                self.config.grace_period,
            )
        self.kill()
        await self._drain(loop.time() + _DRAIN_TIMEOUT)

    def kill(self) -> None:
        """SIGKILL and reap every child at once (blocking; also a last resort)."""
        self.send(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    async def _drain(self, deadline: float) -> None:
        pumps = [p for p in (self._pump, *self._extra_pumps) if p is not None]
        loop = asyncio.get_running_loop()
        for pump in pumps:
            while not pump.finished and loop.time() < deadline:
                await asyncio.sleep(0.01)
            pump.finish()
        self._pump, self._extra_pumps = None, []

    def close(self) -> None:
        """Kill, reap and stop copying output, without waiting (the exceptional path)."""
        self.kill()
        for pump in [p for p in (self._pump, *self._extra_pumps) if p is not None]:
            pump.finish(_DRAIN_TIMEOUT)
        self._pump, self._extra_pumps = None, []
