"""``rpcdist-run`` (also ``python -m rpcdist.launch``): start the worker processes of a job.

Usage::

    rpcdist-run --nproc-per-node N [--nnodes M --node-rank K
                --master-addr A --master-port P] [--max-restarts R]
                [--token T] [--grace-period S] script.py [args...]
    rpcdist-run --nproc-per-node N [...] -m package.module [args...]

Each node runs one launcher, which starts ``N`` children as
``sys.executable script.py args`` with, in their environment:

===========================  ==================================================
``RANK``                     ``node_rank * N + local_rank``
``LOCAL_RANK``               ``0 .. N-1``
``WORLD_SIZE``               ``M * N``
``LOCAL_WORLD_SIZE``         ``N``
``MASTER_ADDR``              ``--master-addr`` (default ``127.0.0.1``)
``MASTER_PORT``              ``--master-port``; on a single node, by default a
                             free port the OS picks (fresh for every restart)
``RPCDIST_TOKEN``            the job token: ``--token``, else ``RPCDIST_TOKEN``
                             from the launcher's environment, else (single node)
                             a fresh random one
``RPCDIST_RESTART_COUNT``    restarts of the group so far (0 on the first run)
``RPCDIST_MAX_RESTARTS``     ``--max-restarts``
===========================  ==================================================

so ``rpcdist.init_rpc(name)`` with the default ``env://`` needs no rank,
world size or address. When a child exits with a non-zero code, the others
are stopped (``SIGTERM``, then ``SIGKILL`` after ``--grace-period``) and the
whole local group is started again, up to ``--max-restarts`` times; after
that the launcher exits with the failing child's code (``128 + n`` for a
child killed by signal ``n``). ``SIGINT`` and ``SIGTERM`` sent to the launcher
are forwarded to the children; a second one kills them at once. Children are
always reaped before the launcher returns. Bad arguments exit with code 2.
The children stay in the launcher's process group, so ``kill -- -PGID`` stops
a whole job (and a terminal's Ctrl-C reaches them directly as well).

With ``--nnodes > 1`` every node must be given the same ``--master-addr``,
``--master-port`` and token; restarts are per node, so they help only when
every node restarts its group (for instance because all of them failed).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from ._errors import ConfigError

__all__ = ["LaunchConfig", "child_env", "free_port", "launch", "main", "parse_args"]

logger = logging.getLogger(__name__)

_DEFAULT_ADDR = "127.0.0.1"
_POLL_INTERVAL = 0.05
_FORWARDED = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class LaunchConfig:
    """A validated launcher configuration (see :func:`parse_args`).

    Attributes:
        nproc_per_node: Children started on this node.
        nnodes: Number of nodes, each running one launcher.
        node_rank: This node's index in ``0 .. nnodes-1``.
        master_addr: Host of rank 0 (it serves the rendezvous store).
        master_port: Port of the store; ``None`` picks a free one per attempt.
        max_restarts: How many times a failed group is started again.
        token: The job token given to every child as ``RPCDIST_TOKEN``.
        command: What each child runs, after ``sys.executable``.
        grace_period: Seconds between ``SIGTERM`` and ``SIGKILL`` on stop.
    """

    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    max_restarts: int
    token: str
    command: tuple[str, ...]
    grace_period: float = 5.0

    @property
    def world_size(self) -> int:
        """Total number of workers on all nodes."""
        return self.nnodes * self.nproc_per_node


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises :class:`ConfigError` instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def _parser() -> _Parser:
    p = _Parser(
        prog="rpcdist-run",
        description="Start the worker processes of an rpcdist job on this node.",
    )
    p.add_argument("--nproc-per-node", type=int, required=True, help="workers on this node")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--master-addr", default=_DEFAULT_ADDR, help="host of rank 0")
    p.add_argument("--master-port", type=int, default=None, help="store port (default: a free one)")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts after a failure")
    p.add_argument(
        "--token",
        default=None,
        help="job token (default: $RPCDIST_TOKEN, else random; "
        "note that arguments are visible to other local users)",
    )
    p.add_argument(
        "--grace-period", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL"
    )
    p.add_argument("-m", "--module", action="store_true", help="run the target as a module")
    p.add_argument("script", help="the Python script (or module with -m) every worker runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def parse_args(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> LaunchConfig:
    """Parse and validate launcher arguments.

    Args:
        argv: The arguments, without the program name.
        env: Environment to read ``RPCDIST_TOKEN`` from.

    Raises:
        ConfigError: a bad or missing argument; the message says which.
    """
    ns = _parser().parse_args(list(argv))
    if ns.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {ns.nproc_per_node}")
    if ns.nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {ns.nnodes}")
    if not 0 <= ns.node_rank < ns.nnodes:
        raise ConfigError(f"--node-rank must be in [0, {ns.nnodes}), got {ns.node_rank}")
    if ns.master_port is not None and not 1 <= ns.master_port <= 65535:
        raise ConfigError(f"--master-port must be in 1..65535, got {ns.master_port}")
    if ns.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {ns.max_restarts}")
    if not ns.grace_period >= 0:
        raise ConfigError(f"--grace-period must be >= 0 seconds, got {ns.grace_period}")
    if not ns.master_addr.strip():
        raise ConfigError("--master-addr must be a host name or address, got ''")
    token = ns.token if ns.token is not None else env.get("RPCDIST_TOKEN") or None
    if ns.nnodes > 1:
        if ns.master_port is None:
            raise ConfigError(
                f"--master-port is required with --nnodes {ns.nnodes}: every node must "
                "be given the same port"
            )
        if token is None:
            raise ConfigError(
                f"a job token is required with --nnodes {ns.nnodes}: pass the same "
                "--token (or RPCDIST_TOKEN) to the launcher on every node"
            )
    if token == "":
        raise ConfigError("--token must not be empty")
    if ns.module:
        command: tuple[str, ...] = ("-m", ns.script, *ns.script_args)
    else:
        if not os.path.isfile(ns.script):
            raise ConfigError(f"script {ns.script!r} not found (use -m to run a module)")
        command = (ns.script, *ns.script_args)
    return LaunchConfig(
        nproc_per_node=ns.nproc_per_node,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        max_restarts=ns.max_restarts,
        token=token if token is not None else secrets.token_hex(16),
        command=command,
        grace_period=ns.grace_period,
    )


def free_port(host: str = _DEFAULT_ADDR) -> int:
    """A TCP port on ``host`` that the OS reports free (bind port 0, read, close).

    Raises:
        ConfigError: ``host`` cannot be bound on this machine.
    """
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.bind(addr)
            port: int = sock.getsockname()[1]
            return port
    except OSError as exc:
        raise ConfigError(
            f"cannot pick a free port on --master-addr {host!r}: {exc}; pass --master-port"
        ) from exc


def child_env(
    config: LaunchConfig,
    local_rank: int,
    master_port: int,
    *,
    restart_count: int = 0,
    base: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The environment of local worker ``local_rank``: ``base`` plus the job's variables."""
    env = dict(base)
    env.update(
        RANK=str(config.node_rank * config.nproc_per_node + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_WORLD_SIZE=str(config.nproc_per_node),
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(master_port),
        RPCDIST_TOKEN=config.token,
        RPCDIST_RESTART_COUNT=str(restart_count),
        RPCDIST_MAX_RESTARTS=str(config.max_restarts),
    )
    return env


def _exit_code(returncode: int) -> int:
    """A shell-style exit code: ``128 + n`` for a process killed by signal ``n``."""
    return 128 - returncode if returncode < 0 else returncode


class _Group:
    """The children of one attempt: start, watch, stop and reap them."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.procs: list[subprocess.Popen[bytes]] = []
        self.signals: list[int] = []  # received by the launcher, in order

    def start(self, master_port: int, restart_count: int) -> None:
        cfg = self.config
        for local_rank in range(cfg.nproc_per_node):
            if self.signals:  # interrupted while starting: start no more
                return
            env = child_env(cfg, local_rank, master_port, restart_count=restart_count)
            self.procs.append(subprocess.Popen([sys.executable, *cfg.command], env=env))
            logger.debug("started rank %s as pid %d", env["RANK"], self.procs[-1].pid)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Signal handler: forward the first signal, kill on the second."""
        self.signals.append(signum)
        sig = signum if len(self.signals) == 1 else signal.SIGKILL
        self._send(sig)

    def _send(self, sig: int) -> None:
        for p in self.procs:
            if p.returncode is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:  # exited, not yet reaped
                    pass

    def wait(self) -> tuple[int, int] | None:
        """Wait until one child fails, ``(local_rank, code)``, or all succeed (``None``).

        Returns ``None`` early as well when the launcher is signalled.
        """
        while not self.signals:
            running = False
            for i, p in enumerate(self.procs):
                rc = p.poll()
                if rc is None:
                    running = True
                elif rc != 0:
                    return i, rc
            if not running:
                return None
            time.sleep(_POLL_INTERVAL)
        return None

    def stop(self, sig: int | None = signal.SIGTERM) -> None:
        """Send ``sig`` to the children still running; SIGKILL them after the grace period; reap.

        With ``sig=None`` only the grace period runs (the children were signalled).
        """
        if sig is not None:
            self._send(sig)
        deadline = time.monotonic() + self.config.grace_period
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        stragglers = [p for p in self.procs if p.returncode is None]
        if stragglers:
            logger.warning(
                "killing %d worker(s) still running %.1f s after they were signalled",
                len(stragglers),
                self.config.grace_period,
            )
        self._send(signal.SIGKILL)
        for p in self.procs:
            p.wait()


@contextmanager
def _forward_signals(group: _Group) -> Iterator[None]:
    """Route SIGINT/SIGTERM to ``group`` while inside (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, group.on_signal) for s in _FORWARDED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@dataclass(frozen=True)
class _Outcome:
    """How one attempt ended: all succeeded, a child failed, or the launcher was signalled."""

    rank: int | None = None  # global rank of the first child that failed
    returncode: int = 0  # its return code (negative: killed by that signal)
    signum: int | None = None  # signal received by the launcher


def _run_once(config: LaunchConfig, master_port: int, attempt: int) -> _Outcome:
    """Run one attempt; every child has been reaped when it returns."""
    group = _Group(config)
    outcome = _Outcome()
    with _forward_signals(group):
        try:
            group.start(master_port, attempt)
            failure = group.wait()
            if failure is not None and not group.signals:
                local, rc = failure
                outcome = _Outcome(config.node_rank * config.nproc_per_node + local, rc)
                logger.error(
                    "worker rank %d (pid %d) exited with code %d; stopping %d other worker(s)",
                    outcome.rank,
                    group.procs[local].pid,
                    rc,
                    sum(p.poll() is None for p in group.procs),
                )
        finally:
            if group.signals:
                logger.warning("received signal %d; stopping the workers", group.signals[0])
            # Forwarded signals were sent already; otherwise SIGTERM whatever runs.
            group.stop(None if group.signals else signal.SIGTERM)
    return _Outcome(signum=group.signals[0]) if group.signals else outcome


def launch(config: LaunchConfig) -> int:
    """Run the job described by ``config`` on this node; return the exit code.

    ``0`` when every child succeeded, the failing child's code when the
    restarts are used up, ``128 + n`` when the launcher got signal ``n``.

    Raises:
        ConfigError: no free port could be picked on ``config.master_addr``.
        OSError: a child could not be started.
    """
    attempt = 0
    while True:
        port = config.master_port
        if port is None:
            port = free_port(config.master_addr)
        logger.info(
            "starting %d worker(s) (ranks %d..%d of %d), master %s:%d, attempt %d/%d",
            config.nproc_per_node,
            config.node_rank * config.nproc_per_node,
            (config.node_rank + 1) * config.nproc_per_node - 1,
            config.world_size,
            config.master_addr,
            port,
            attempt + 1,
            config.max_restarts + 1,
        )
        outcome = _run_once(config, port, attempt)
        if outcome.signum is not None:
            return 128 + outcome.signum
        if outcome.rank is None:
            logger.info("all %d worker(s) finished successfully", config.nproc_per_node)
            return 0
        if attempt >= config.max_restarts:
            if config.max_restarts:
                logger.error("giving up after %d restart(s)", config.max_restarts)
            return _exit_code(outcome.returncode)
        attempt += 1
        logger.warning("restarting the worker group (%d/%d)", attempt, config.max_restarts)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of ``rpcdist-run``; returns the exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[rpcdist-run] %(levelname)s: %(message)s")
    try:
        config = parse_args(args)
        return launch(config)
    except ConfigError as exc:
        sys.stderr.write(f"{_parser().format_usage()}rpcdist-run: error: {exc}\n")
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except OSError as exc:  # the workers could not be started
        logger.error("cannot start the workers: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
