"""Which peers are alive: the failure detector and the table of lost workers.

A peer is *lost* when

* dialling it fails once the job is up (every worker listened before the
  job started: its listener is gone, it is unreachable, or it refuses us);
* a link with it ends under us (a killed process's sockets close cleanly
  too, and so does a link the peer dropped for a protocol error, or a
  connection an impostor with the token opened in its name): then it is
  *probed* with internal pings; a dial that fails declares it lost,
  typically within a millisecond of a death (the dial is refused), and so
  do pings left unanswered for as long as silence would be (above);
* nothing at all has come from it on a link for long enough: it is hung,
  stopped (SIGSTOP), or the network between us is partitioned. Silence is
  not a verdict at once, since a paused peer is silent too (a full garbage
  collection, a native call holding the GIL: its heartbeats wait for the
  GIL). After ``RpcOptions.peer_timeout`` seconds the peer is *suspected*,
  and the verdict takes a second opinion (:mod:`._procview`) where one is
  available:

  - a peer on this host (same kernel, pid and network namespaces) whose
    process is stopped (``T``) is declared lost then, and one whose process
    is gone at once; one whose process runs or sleeps is only paused, and
    is declared lost only after ``RpcOptions.pause_timeout`` seconds;
  - a peer without that view (another host) is declared lost after an
    adaptive window: ``REMOTE_FACTOR`` (4) times ``peer_timeout``, or twice
    the longest silence it has ever ended itself (a peer known to pause for
    8 s gets 16 s), at most ``pause_timeout``.

  Only time this worker was listening counts: when its own loop was held
  up (a starved or paused process), the stall is not counted against its
  peers. Every ``heartbeat_interval`` the detector sends a heartbeat on
  each link that sent nothing since the last look, so a live peer's links
  are never silent that long; links that carry calls send no heartbeats.

Every layer learns of a loss from this one detector, with the same
window: calls and blocking calls here, RRefs and every collective backend
through ``Extension.peer_lost`` (a blocked collective makes the detector
watch its members), the shutdown through :meth:`Liveness.changed`.

Losing a peer is final (fail-stop): every call pending on it fails with
``WorkerLostError`` naming it, its links are closed, threads waiting on its
blocking connections are woken, it is never dialled again and its
connections are refused, and the extensions hear of it once
(``Extension.peer_lost``: RRefs it owns fail, collectives with it fail,
distributed-autograd contexts it created are freed after their lease).

Costs on the call path: none. The detector is one timer per agent, and it
reads counters the links keep anyway (envelopes in and out; receives of
large payloads).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from .._errors import ConnectError, RpcdistError, RpcTimeoutError, WorkerLostError
from .._transport import Link
from .._transport._frames import HEARTBEAT, P2P, OutMessage
from . import _procview

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["PING", "Liveness"]

log = logging.getLogger(__name__)

#: The internal method of a probe (answered by every agent).
PING = "rpc.ping"
#: Without a view of its process (another host), a silent peer is declared
#: lost after this many ``peer_timeout``: long enough for the longest GIL
#: holds measured (``docs/benchmarks.md``, "GIL holds": unpickling millions
#: of objects), short enough to end a partition's calls.
REMOTE_FACTOR = 4
#: A probe's bound when the detector is off.
_PROBE_LIMIT = 5.0


async def on_ping(agent: AgentView, src: Any, payload: Any) -> None:
    """Answer a probe (internal method ``PING``)."""
    return None


class Liveness:
    """One agent's failure detector and lost-worker table (see the module docstring)."""

    def __init__(self, agent: AgentView) -> None:
        self._agent = agent
        self._loop = agent.loop
        opts = agent.options
        self.interval = float(opts.heartbeat_interval)
        self.timeout = None if opts.peer_timeout is None else float(opts.peer_timeout)
        #: The longest silence tolerated from a peer known to be running.
        self.pause_limit = float(opts.pause_timeout)
        #: Same-host peers whose process this worker can see: rank -> pid.
        self._pids: dict[int, int] = {}
        #: The longest silence each peer ended itself (adaptive window).
        self._gaps: dict[int, float] = {}
        #: Peers suspected (silent past ``timeout``) and not yet judged lost.
        self.suspected: set[int] = set()
        #: Lost workers: rank -> why (written on the loop; read anywhere).
        self.lost: dict[int, str] = {}
        #: When each was declared lost (the loop's clock).
        self.lost_at: dict[int, float] = {}
        #: Per watched link: [envelopes and bulk reads in, envelopes out, last heard].
        self._seen: dict[Link, list[float]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._probing: set[int] = set()
        #: Set by a graceful shutdown once every worker is known idle: links
        #: ending after that are peers leaving, not failing.
        self.leaving = False
        self.heartbeats_sent = 0
        #: When the detector last looked (the loop's clock).
        self._last_tick: float | None = None

    def learn(self, infos: list[dict[str, Any]]) -> None:
        """Note which peers' processes this worker can see (their rendezvous entries)."""
        me, pid = _procview.seat(), os.getpid()
        self._pids.update(
            (i["rank"], int(i["pid"]))
            for i in infos
            if me and i.get("seat") == me and i.get("pid") not in (None, pid)
        )

    def forget(self, rank: int) -> None:
        """A worker joins the dynamic group with ``rank``: nothing known of an
        earlier one of that rank holds for it (on the loop)."""
        for table in (self.lost, self.lost_at, self._gaps, self._pids):
            table.pop(rank, None)
        self.suspected.discard(rank)

    def start(self) -> None:
        """Start the detector (on the loop, once the workers table is known)."""
        if self.timeout is not None and self._timer is None:
            self._last_tick = self._loop.time()
            self._timer = self._loop.call_later(self.interval, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters.clear()

    # ------------------------------------------------------------- the table

    def is_lost(self, rank: int) -> bool:
        return rank in self.lost

    def error(self, rank: int, what: str = "") -> WorkerLostError:
        """The error for using lost worker ``rank`` (``what``: the operation)."""
        prefix = f"{what}: " if what else ""
        return WorkerLostError(f"{prefix}{self._describe(rank)} was lost: {self.lost[rank]}")

    def _describe(self, rank: int) -> str:
        try:
            name = self._agent.workers[rank].name
        except IndexError:
            name = "?"
        return f"worker {name!r} (rank {rank})"

    def declare(self, rank: int, why: str) -> None:
        """Declare worker ``rank`` lost for ``why`` (on the loop; idempotent)."""
        agent = self._agent
        if rank == agent.rank or rank in self.lost or agent.closed:
            return
        if not agent.workers.knows(rank):
            return
        self.lost[rank] = why
        self.suspected.discard(rank)
        self.lost_at[rank] = self._loop.time()
        level = logging.DEBUG if self.leaving else logging.WARNING
        log.log(level, "%s: %s is lost: %s", agent.name, self._describe(rank), why)
        exc = self.error(rank)
        agent.calls.fail_peer(rank, exc)
        agent.mailbox.fail_all(rank, WorkerLostError(str(exc)))
        agent.sync.drop_peer(rank)
        agent.sync_serving.drop_peer(rank)
        agent.links.drop(rank, exc)
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters.clear()
        agent.peer_lost(rank)

    def changed(self) -> asyncio.Future[None]:
        """A future done at the next loss (on the loop)."""
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(fut)
        return fut

    def watch(self, rank: int) -> None:
        """Keep a link to ``rank`` open, so that the detector watches it (on
        the loop; a blocking call waits long for it)."""
        agent = self._agent
        if rank == agent.rank or rank in self.lost or agent.closed:
            return
        try:
            agent.links.link(rank)
        except RpcdistError as e:
            log.debug("%s: cannot watch rank %d: %s", agent.name, rank, e)

    def watch_threadsafe(self, rank: int) -> None:
        try:
            self._loop.call_soon_threadsafe(self.watch, rank)
        except RuntimeError:  # the loop is gone: the agent shut down
            pass

    def probe(self, rank: int, why: str) -> None:
        """Something hints that ``rank`` may be gone (``why``: a link of its
        ended, a shutdown waits for it): ping it, and declare it lost if the
        ping cannot be sent or is not answered in time (on the loop)."""
        agent = self._agent
        if rank == agent.rank or rank in self.lost or agent.closed or rank in self._probing:
            return
        if not agent.workers.knows(rank):
            return
        self._probing.add(rank)
        agent.spawn(self._probe(rank, why))

    def probe_threadsafe(self, rank: int, why: str) -> None:
        try:
            self._loop.call_soon_threadsafe(self.probe, rank, why)
        except RuntimeError:  # the loop is gone: the agent shut down
            pass

    async def _probe(self, rank: int, why: str) -> None:
        step = self.timeout if self.timeout is not None else _PROBE_LIMIT
        started = time.monotonic()
        try:
            while True:
                deadline = time.monotonic() + step
                try:
                    await self._agent.call(
                        rank, PING, None, deadline=deadline, meta=None, internal=True
                    )
                    return
                except RpcTimeoutError:
                    quiet = time.monotonic() - started
                    verdict = self.judge(rank, quiet)
                    if verdict is not None:
                        self.declare(rank, f"{why}, and it did not answer pings: {verdict}")
                        return
        except (WorkerLostError, ConnectError) as e:
            self.declare(rank, f"{why}, and a ping failed: {e}")
        except RpcdistError as e:  # we are shutting down
            log.debug("probing rank %d: %s", rank, e)
        finally:
            self._probing.discard(rank)

    # ----------------------------------------------------------- the verdict

    def window(self, rank: int) -> float:
        """Seconds of silence after which ``rank`` is declared lost, when no
        second opinion speaks (another host): ``REMOTE_FACTOR`` times the
        suspicion threshold, or twice the longest silence it ended itself, at
        most ``pause_limit``."""
        base = self.timeout if self.timeout is not None else _PROBE_LIMIT
        longest = 2 * self._gaps.get(rank, 0.0)
        return min(max(self.pause_limit, base), max(REMOTE_FACTOR * base, longest))

    def judge(self, rank: int, quiet: float) -> str | None:
        """Why ``rank``, silent for ``quiet`` seconds, is lost; ``None``: not (yet)."""
        base = self.timeout if self.timeout is not None else _PROBE_LIMIT
        pid = self._pids.get(rank)
        state = None if pid is None else _procview.process_state(pid)
        if state == _procview.GONE:
            return f"its process (pid {pid}) has exited"
        if quiet < base:
            self.suspected.discard(rank)
            return None
        if rank not in self.suspected:
            self.suspected.add(rank)
            log.info(
                "%s: %s is silent for %.1f s (%s)",
                self._agent.name,
                self._describe(rank),
                quiet,
                state or "no view of its process",
            )
        said = f"nothing came from it for {quiet:.1f} s, heartbeats included"
        if state == _procview.STOPPED:
            return f"{said}, and its process (pid {pid}) is stopped"
        if state == _procview.RUNNING:
            if quiet < self.pause_limit:
                return None  # paused, not hung: its process runs
            return (
                f"{said}, though its process (pid {pid}) runs (hung; "
                f"RpcOptions.pause_timeout={self.pause_limit})"
            )
        if quiet < self.window(rank):
            return None
        return (
            f"{said} (its process is hung or stopped, or the network to it is "
            f"partitioned; RpcOptions.peer_timeout={self.timeout}, window "
            f"{self.window(rank):.1f} s)"
        )

    # ---------------------------------------------------------- the detector

    def _tick(self) -> None:
        self._timer = None
        agent = self._agent
        if agent.closed or self.timeout is None:
            return
        now = self._loop.time()
        # A look that comes late means this loop could not run (a starved or
        # paused process): the peers' silence meanwhile is not theirs to answer
        # for, so only the time this worker was listening counts.
        last, self._last_tick = self._last_tick, now
        stalled = 0.0 if last is None else max(0.0, now - last - 2 * self.interval)
        seen: dict[Link, list[float]] = {}
        silent: dict[int, float] = {}
        for link in agent.links.watched():
            if link.closed is not None:
                continue
            rx = link.messages_in + link.bulk_reads
            st = self._seen.get(link)
            if st is None:
                st = [rx, -1, now]
            elif rx != st[0]:
                gap = now - st[2]
                if gap > self._gaps.get(link.peer_rank, 0.0):
                    self._gaps[link.peer_rank] = gap
                st[0], st[2] = rx, now
            elif stalled:
                st[2] = min(now, st[2] + stalled)
            if link.messages_out == st[1] and not link.queued():
                try:
                    link.send(OutMessage(P2P, HEARTBEAT, b"", []))
                    self.heartbeats_sent += 1
                except RpcdistError:
                    pass
            st[1] = link.messages_out
            seen[link] = st
            quiet = now - st[2]
            if quiet >= self.timeout and quiet > silent.get(link.peer_rank, 0.0):
                silent[link.peer_rank] = quiet
        self._seen = seen
        for rank in [r for r in self.suspected if r not in silent]:
            self.judge(rank, 0.0)  # it spoke again: no longer suspected
        for rank, quiet in silent.items():
            verdict = self.judge(rank, quiet)
            if verdict is not None:
                self.declare(rank, verdict)
        if not agent.closed:
            self._timer = self._loop.call_later(self.interval, self._tick)

    def statistics(self) -> dict[str, int]:
        return {"lost_workers": len(self.lost), "heartbeats_sent": self.heartbeats_sent}
