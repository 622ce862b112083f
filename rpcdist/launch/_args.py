"""The launcher's command line: parsing, validation and :class:`LaunchConfig`."""

from __future__ import annotations

import argparse
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._errors import ConfigError

__all__ = ["DEFAULT_ADDR", "LaunchConfig", "parse_args", "parser"]

DEFAULT_ADDR = "127.0.0.1"


@dataclass(frozen=True)
class LaunchConfig:
    """A validated launcher configuration (see :func:`parse_args`).

    Attributes:
        nproc_per_node: Children started on this node.
        nnodes: Number of nodes, each running one launcher; in the elastic
            form (``--nnodes MIN:MAX``) the most that are admitted.
        node_rank: This node's index in ``0 .. nnodes-1`` (fixed-size jobs;
            elastic jobs have their node ranks assigned by the rendezvous).
        master_addr: Host of node 0, which serves the launchers' rendezvous
            store and runs the job's rank 0.
        master_port: On a single node, the workers' store port (``None``:
            a free one per attempt). With several nodes, the port of the
            launchers' rendezvous store; the workers get a fresh port from it
            for every attempt.
        max_restarts: How many times the job is started again, after a
            failure or a change of membership.
        token: On a single node, the job token given to every child as
            ``RPCDIST_TOKEN``. With several nodes, the secret that guards the
            launchers' store; the children get a job token made by node 0.
        command: What each child runs, after ``sys.executable``.
        grace_period: Seconds between ``SIGTERM`` and ``SIGKILL`` on stop.
        min_nodes: ``None`` for a fixed-size job; the elastic form's ``MIN``.
        prefix_output: Prefix every line the children print with their rank.
        rdzv_timeout: Seconds to wait for enough nodes to join.
        rdzv_last_call: Elastic jobs: once ``MIN`` nodes joined the first
            round, seconds to wait for more (up to ``MAX``).
        node_timeout: Seconds without a heartbeat after which a node is lost.
        restart_policy: ``"job"``: a failure restarts every worker;
            ``"rank"`` (one node): only the failed worker is restarted, up
            to ``max_restarts`` times per rank, for the fault-tolerant mode
            (the launcher runs its coordinator: ``RPCDIST_FT_ADDR``).
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
    min_nodes: int | None = None
    prefix_output: bool = True
    rdzv_timeout: float = 300.0
    rdzv_last_call: float = 3.0
    node_timeout: float = 5.0
    restart_policy: str = "job"

    @property
    def world_size(self) -> int:
        """Total number of workers on all nodes (the most, for an elastic job)."""
        return self.nnodes * self.nproc_per_node

    @property
    def elastic(self) -> bool:
        """Whether the number of nodes may change (``--nnodes MIN:MAX``)."""
        return self.min_nodes is not None

    @property
    def multi_node(self) -> bool:
        """Whether other launchers take part (a launchers' rendezvous store is used)."""
        return self.nnodes > 1


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises :class:`ConfigError` instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def parser() -> argparse.ArgumentParser:
    """The ``rpcdist-run`` argument parser (errors raise :class:`ConfigError`)."""
    p = _Parser(
        prog="rpcdist-run",
        description="Start the worker processes of an rpcdist job on this node.",
    )
    p.add_argument("--nproc-per-node", type=int, required=True, help="workers on this node")
    p.add_argument(
        "--nnodes", default="1", help="number of nodes, or MIN:MAX for an elastic job (default 1)"
    )
    p.add_argument(
        "--node-rank", type=int, default=None, help="this node's index (fixed size; default 0)"
    )
    p.add_argument("--master-addr", default=DEFAULT_ADDR, help="host of node 0")
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="one node: the workers' store port (default: a free one); "
        "several: the launchers' rendezvous port (required)",
    )
    p.add_argument(
        "--max-restarts", type=int, default=0, help="restarts after a failure or membership change"
    )
    p.add_argument(
        "--restart-policy",
        choices=["job", "rank"],
        default="job",
        help="job: a failure restarts every worker; rank (one node): only the failed one, "
        "for rpcdist.parallel.FaultTolerance (the launcher runs its coordinator)",
    )
    p.add_argument(
        "--token",
        default=None,
        help="job secret (default: $RPCDIST_TOKEN, else random on one node; "
        "note that arguments are visible to other local users)",
    )
    p.add_argument(
        "--grace-period", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL"
    )
    p.add_argument(
        "--no-prefix",
        dest="prefix",
        action="store_false",
        help="let the children write to the launcher's stdout/stderr as they are",
    )
    p.add_argument(
        "--rdzv-timeout", type=float, default=300.0, help="seconds to wait for enough nodes"
    )
    p.add_argument(
        "--rdzv-last-call",
        type=float,
        default=3.0,
        help="elastic: seconds to wait for more nodes once MIN joined (first round)",
    )
    p.add_argument(
        "--node-timeout",
        type=float,
        default=5.0,
        help="seconds without a heartbeat before a node counts as lost",
    )
    p.add_argument("-m", "--module", action="store_true", help="run the target as a module")
    p.add_argument("script", help="the Python script (or module with -m) every worker runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _nodes(raw: str) -> tuple[int | None, int]:
    """``"N"`` -> ``(None, N)``; ``"MIN:MAX"`` -> ``(MIN, MAX)``."""
    lo, sep, hi = raw.partition(":")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ConfigError(f"--nnodes must be N or MIN:MAX (integers), got {raw!r}") from None
    if low < 1 or high < low:
        expected = "MIN:MAX with 1 <= MIN <= MAX" if sep else ">= 1"
        raise ConfigError(f"--nnodes must be {expected}, got {raw!r}")
    if not sep or high == 1:
        return None, high
    return low, high


def _seconds(value: float, flag: str, *, positive: bool = False) -> float:
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise ConfigError(f"{flag} must be {'>' if positive else '>='} 0 seconds, got {value}")
    return value


def parse_args(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> LaunchConfig:
    """Parse and validate launcher arguments.

    Args:
        argv: The arguments, without the program name.
        env: Environment to read ``RPCDIST_TOKEN`` from.

    Raises:
        ConfigError: a bad or missing argument; the message says which.
    """
    ns = parser().parse_args(list(argv))
    if ns.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {ns.nproc_per_node}")
    min_nodes, nnodes = _nodes(ns.nnodes)
    if min_nodes is not None and ns.node_rank is not None:
        raise ConfigError(
            f"--node-rank cannot be given with --nnodes {ns.nnodes}: an elastic job's "
            "node ranks are assigned by the rendezvous"
        )
    node_rank = 0 if ns.node_rank is None else ns.node_rank
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank must be in [0, {nnodes}), got {node_rank}")
    if ns.master_port is not None and not 1 <= ns.master_port <= 65535:
        raise ConfigError(f"--master-port must be in 1..65535, got {ns.master_port}")
    if ns.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {ns.max_restarts}")
    if ns.restart_policy == "rank" and (min_nodes is not None or nnodes != 1):
        raise ConfigError("--restart-policy rank needs a single node (--nnodes 1)")
    grace = _seconds(ns.grace_period, "--grace-period")
    rdzv_timeout = _seconds(ns.rdzv_timeout, "--rdzv-timeout", positive=True)
    last_call = _seconds(ns.rdzv_last_call, "--rdzv-last-call")
    node_timeout = _seconds(ns.node_timeout, "--node-timeout", positive=True)
    if not ns.master_addr.strip():
        raise ConfigError("--master-addr must be a host name or address, got ''")
    token = ns.token if ns.token is not None else env.get("RPCDIST_TOKEN") or None
    if nnodes > 1:
        if ns.master_port is None:
            raise ConfigError(
                f"--master-port is required with --nnodes {ns.nnodes}: every node must "
                "be given the same port (node 0's launcher serves the rendezvous there)"
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
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        max_restarts=ns.max_restarts,
        token=token if token is not None else secrets.token_hex(16),
        command=command,
        grace_period=grace,
        min_nodes=min_nodes,
        prefix_output=ns.prefix,
        rdzv_timeout=rdzv_timeout,
        rdzv_last_call=last_call,
        node_timeout=node_timeout,
        restart_policy=ns.restart_policy,
    )
