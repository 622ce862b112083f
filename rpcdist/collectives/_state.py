"""Per-agent collective state: groups, backend choice, liveness, statistics.

One :class:`CollectiveState` lives in ``agent.extensions["collectives"]``
while a process group is initialised; its :meth:`statistics` merge into
``agent.statistics()``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from .._rpc._procview import GONE, process_state
from .._rpc._registry import BaseExtension
from ._engine import HostEngine
from ._group import ProcessGroup
from ._link import AgentLink
from ._ring_engine import RingEngine
from ._shm import SLOT_BYTES, setup_segments
from ._shm_algos import ShmEngine

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = ["BACKENDS", "CollectiveState", "cpu_backend", "normalize_backend"]

_log = logging.getLogger(__name__)

BACKENDS = ("auto", "shm", "ring", "nccl")
#: Older names still accepted: the message ring was first called "grpc",
#: after the transport it ran on then.
_ALIASES = {"grpc": "ring"}


def normalize_backend(requested: str) -> str:
    """``requested`` with aliases resolved (pure).

    Raises:
        ConfigError: an unknown backend.
    """
    name = _ALIASES.get(requested, requested)
    if name not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {requested!r}")
    return name


def cpu_backend(requested: str, hosts: Sequence[str]) -> str:
    """The engine for host buffers of a group whose members run on ``hosts`` (pure).

    ``auto`` (and ``nccl``, whose CPU side is ``auto``'s) picks shared memory
    when every member is on one host, the message ring (over the agent's
    links: sockets or gRPC streams) otherwise. Shared memory is only the
    candidate here: the members then probe each other's doorbells
    (``setup_segments``) and fall back to the ring together if that fails.

    Raises:
        ConfigError: ``shm`` asked for a group that spans hosts, or an
            unknown backend.
    """
    requested = normalize_backend(requested)
    same_host = len(set(hosts)) <= 1
    if requested == "ring":
        return "ring"
    if requested == "shm" and not same_host:
        raise ConfigError("backend='shm' needs every member of the group on one host")
    return "shm" if same_host else "ring"


def _alive(pid: int) -> bool:
    return process_state(pid) != GONE


class CollectiveState(BaseExtension):
    """The collective layer of one agent (its ``"collectives"`` extension)."""

    name = "collectives"

    def __init__(
        self, agent: Agent, backend: str, timeout: float | None, slot_bytes: int = SLOT_BYTES
    ) -> None:
        self.agent = agent
        self.backend = backend
        self.timeout = timeout
        self.slot_bytes = slot_bytes
        self.tag = ""
        self.job = ""
        self.pids: dict[int, int] = {}
        self.groups: dict[int, ProcessGroup] = {}
        self._next_gid = 1
        self._gid_lock = threading.Lock()
        self.world: ProcessGroup | None = None

    async def setup(self, timeout: float) -> None:
        """Agree on a tag and job id, share pids, make the default group (collective)."""
        store, r, n = self.agent.store, self.agent.rank, self.agent.world_size
        epoch = await store.add(f"coll/epoch/{r}", 1)
        self.tag = f"c{epoch}"
        if r == 0:
            await store.set(f"{self.tag}/job", secrets.token_hex(4).encode())
        self.job = (await store.get(f"{self.tag}/job", timeout)).decode()
        await store.set(f"{self.tag}/pid/{r}", str(os.getpid()).encode())
        got = await asyncio.gather(*(store.get(f"{self.tag}/pid/{q}", timeout) for q in range(n)))
        self.pids = {q: int(v) for q, v in enumerate(got)}
        self.world = await self.make_group(0, tuple(range(n)), self.backend, self.timeout)

    def next_gid(self) -> int:
        with self._gid_lock:
            gid = self._next_gid
            self._next_gid += 1
            return gid

    async def make_group(
        self, gid: int, ranks: tuple[int, ...], backend: str, timeout: float | None
    ) -> ProcessGroup:
        """Create group ``gid``; its members set up their engine together (on the loop).

        Raises:
            ConfigError: ``backend`` cannot serve these ranks.
            RpcTimeoutError: a member did not take part in time.
        """
        group = ProcessGroup(self, gid, ranks, timeout)
        if group.is_member:
            backend = normalize_backend(backend)
            group.backend, inner = await self._engine(group, backend)
            group.engine = HostEngine(inner, group)
            group.requested = backend
            if isinstance(inner, ShmEngine):
                inner.seg.check = group.check
        self.groups[gid] = group
        return group

    async def _engine(self, group: ProcessGroup, backend: str) -> tuple[str, Any]:
        kind = cpu_backend(backend, [self.agent.hosts[g] for g in group.ranks])
        limit = self.agent.options.init_timeout
        if kind == "shm" and group.size > 1:
            seg = await setup_segments(
                self.agent.store,
                f"{self.tag}/g{group.gid}/shm",
                f"rpcdist-{self.job}-{self.tag}-g{group.gid}",
                group.ranks,
                group.rank,
                limit,
                self.slot_bytes,
            )
            if not isinstance(seg, str):
                return "shm", ShmEngine(seg)
            if backend == "shm":
                raise ConfigError(f"backend='shm': shared memory is not usable: {seg}")
            _log.warning(
                "%s: shared memory is not usable (%s); using the message ring",
                group.describe(),
                seg,
            )
            kind = "ring"
        # A group of one moves no data: any engine will do; keep the chosen name.
        link = AgentLink(self.agent, group.ranks, group.rank)
        return kind, RingEngine(link, group.prefix)

    def dead_peers(self, ranks: Sequence[int]) -> list[int]:
        """Members on this host whose process has exited."""
        hosts, me = self.agent.hosts, self.agent.rank
        return [
            q
            for q in ranks
            if q != me
            and hosts.get(q) == hosts.get(me)
            and q in self.pids
            and not _alive(self.pids[q])
        ]

    def watch(self, ranks: Sequence[int]) -> None:
        """Make the failure detector watch these members (any thread)."""
        liveness = self.agent.liveness
        for q in ranks:
            if q != self.agent.rank and not liveness.is_lost(q):
                liveness.watch_threadsafe(q)

    def peer_lost(self, rank: int) -> None:
        """Worker ``rank`` was declared lost: fail the groups it belongs to (on the loop)."""
        liveness = self.agent.liveness
        error = liveness.error(rank) if liveness.is_lost(rank) else None
        for group in list(self.groups.values()):
            if error is not None and group.is_member and rank in group.ranks and not group.closed:
                group.on_lost(rank, error)

    def debug_info(self) -> dict[str, Any]:
        """Each group's sequence numbers and running op, for hang diagnosis."""
        return {
            "collectives": {
                f"group {gid}": g.debug_info() for gid, g in self.groups.items() if g.is_member
            }
        }

    def statistics(self) -> dict[str, int]:
        """Collectives queued, in flight (gauges) and completed, failed (counters)."""
        groups = list(self.groups.values())
        return {
            "collectives_queued": sum(g.queued for g in groups),
            "collectives_inflight": sum(g.inflight for g in groups),
            "collectives_completed": sum(g.completed for g in groups),
            "collectives_failed": sum(g.failed for g in groups),
        }

    def destroy(self, gid: int | None = None) -> None:
        """Destroy one group, or all (not on the loop: it joins worker threads)."""
        for g in [gid] if gid is not None else list(self.groups):
            group = self.groups.pop(g, None)
            if group is not None:
                group.close()
