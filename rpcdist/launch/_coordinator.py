"""Node 0's launcher decides the membership of every round (``Coordinator``).

It runs beside node 0's own agent, on the same event loop and store. For
each round it waits for enough live nodes, writes the round's record (the
members in node-rank order and a fresh port for the workers' store) and
tells each member; then it watches the round until it ends: every member's
workers succeeded, a worker failed, a member was lost (no heartbeat for
``node_timeout``) or left, a new node arrived while there is room (elastic
jobs only), or node 0 was signalled. Once every member has stopped its
workers it starts the next round, or closes the job when it is over or
``max_restarts`` is used up, and waits for each node to read that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import RpcdistError, RpcTimeoutError
from . import _records as rec
from ._rendezvous import Store, peek

__all__ = ["Coordinator", "RoundPolicy"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundPolicy:
    """The coordinator's settings, from node 0's configuration."""

    min_nodes: int
    max_nodes: int
    fixed: bool  # node ranks given by --node-rank
    max_restarts: int
    rdzv_timeout: float
    last_call: float
    node_timeout: float
    interval: float

    @property
    def chatty(self) -> bool:
        """Whether membership is worth an INFO log line (several nodes)."""
        return self.max_nodes > 1


@dataclass
class _Node:
    seq: int
    info: rec.NodeInfo
    beats: int
    seen: float  # loop time the heartbeat counter last moved
    outbox: int = 0
    gone: str = ""  # why it no longer counts ("" while it does)

    def __str__(self) -> str:
        rank = "" if self.info.node_rank is None else f" (--node-rank {self.info.node_rank})"
        return f"launcher {self.seq}{rank} on {self.info.hostname}, pid {self.info.pid}"


class _Closed(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class Coordinator:
    """Membership decisions for the whole job; run by node 0's launcher.

    Args:
        store: The launchers' store.
        policy: Sizes, restarts and timings.
        host: Sequence number of node 0's own launcher (always node 0).
        worker_port: Returns the workers' ``MASTER_PORT`` for a new round.
    """

    def __init__(
        self, store: Store, policy: RoundPolicy, host: int, worker_port: Callable[[], int]
    ) -> None:
        self.store = store
        self.policy = policy
        self.host = host
        self._worker_port = worker_port
        self._nodes: dict[int, _Node] = {}
        self._shutdown: tuple[int, str] | None = None
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._refreshed = self._loop.time()

    def shutdown(self, code: int, reason: str) -> None:
        """End the job with ``code``: stop the current round and start no other."""
        if self._shutdown is None:
            self._shutdown = (code, reason)
            self._wake.set()

    async def run(self) -> int:
        """Run rounds until the job is closed; the job's exit code."""
        number, previous = 0, [self.host]
        try:
            while True:
                members = await self._gather(previous, first=number == 0)
                port = self._worker_port()
                record = rec.Round(number=number, members=members, master_port=port)
                await self.store.set(rec.round_key(number), rec.encode(record))
                for seq in members:
                    await self._send(seq, rec.Message(kind="round", number=number))
                end = await self._watch(number, members)
                await self._collect(number, members, rec.stopped_key)
                if self._shutdown is not None:
                    raise _Closed(*self._shutdown)
                if end.kind == "done":
                    raise _Closed(0, "every worker finished successfully")
                if number >= self.policy.max_restarts:
                    used = self.policy.max_restarts
                    if used:
                        logger.error("giving up after %d restart(s)", used)
                    raise _Closed(end.code, f"{end.reason}; no restarts left ({used} used)")
                number += 1
                previous = [s for s in members if not self._nodes[s].gone]
        except _Closed as closed:
            return await self._close(closed.code, closed.reason)

    # -- rounds --------------------------------------------------------------

    async def _gather(self, previous: list[int], *, first: bool) -> list[int]:
        """Wait for enough live nodes; the next round's members."""
        p = self.policy
        start = self._loop.time()
        enough_since: float | None = None
        while True:
            await self._refresh()
            if self._shutdown is not None:
                raise _Closed(*self._shutdown)
            live = [n for n in self._nodes.values() if not n.gone]
            now = self._loop.time()
            if p.fixed:
                by_rank = {n.info.node_rank: n.seq for n in live}
                if len(by_rank) == p.max_nodes:
                    return [by_rank[k] for k in range(p.max_nodes)]
            elif len(live) >= p.min_nodes:
                enough_since = now if enough_since is None else enough_since
                # The first round gives late launchers a last call; later rounds
                # take every live launcher at once (a newcomer restarts the job).
                if len(live) >= p.max_nodes or not first or now - enough_since >= p.last_call:
                    seqs = [n.seq for n in live]
                    return rec.order_members(self.host, previous, seqs, p.max_nodes)
            else:
                enough_since = None
            if now - start > p.rdzv_timeout:
                need = p.max_nodes if p.fixed else p.min_nodes
                raise _Closed(
                    1,
                    f"only {len(live)} of the {need} node(s) needed joined within "
                    f"--rdzv-timeout {p.rdzv_timeout} s",
                )
            await self._pause()

    async def _watch(self, number: int, members: list[int]) -> rec.End:
        """Watch round ``number`` until it ends; why it did."""
        ended = asyncio.create_task(self.store.get(rec.end_key(number)))
        keys = [rec.done_key(number, s) for s in members]
        finished = asyncio.create_task(self.store.wait(keys))
        woken = asyncio.create_task(self._wake.wait())  # shutdown() wakes it
        arrival = asyncio.create_task(self._arrival())
        pending: set[asyncio.Task[object]] = {ended, finished, woken, arrival}  # type: ignore[arg-type]
        try:
            while not ended.done():
                await asyncio.wait(
                    pending, timeout=self.policy.interval, return_when=asyncio.FIRST_COMPLETED
                )
                end: rec.End | None
                if ended.done():
                    break
                if finished.done() and finished in pending:
                    pending.discard(finished)  # type: ignore[arg-type]
                    finished.result()
                    end = rec.End("done", "every worker finished successfully")
                elif self._shutdown is not None:
                    code, reason = self._shutdown
                    end = rec.End("shutdown", reason, code)
                    pending.discard(woken)  # type: ignore[arg-type]
                else:
                    await self._refresh()
                    end = self._membership_change(number, members)
                    if arrival.done():  # wait for the next one from now on
                        pending.discard(arrival)  # type: ignore[arg-type]
                        if arrival.exception() is None:
                            arrival = asyncio.create_task(self._arrival())
                            pending.add(arrival)  # type: ignore[arg-type]
                if end is not None:
                    await self.store.compare_set(rec.end_key(number), b"", rec.encode(end))
            ending: rec.End = rec.decode(rec.End, ended.result(), rec.end_key(number))
            return ending
        finally:
            for task in (ended, finished, woken, arrival):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, RpcdistError):
                    await task

    def _membership_change(self, number: int, members: list[int]) -> rec.End | None:
        gone = [self._nodes[s] for s in members if self._nodes[s].gone]
        if gone:
            why = "; ".join(f"{n} {n.gone}" for n in gone)
            return rec.End("membership", why, 1, lost=[n.seq for n in gone])
        p = self.policy
        if p.fixed or len(members) >= p.max_nodes or number >= p.max_restarts:
            return None
        waiting = [n for s, n in self._nodes.items() if not n.gone and s not in members]
        if waiting:
            names = ", ".join(str(n) for n in waiting)
            return rec.End("membership", f"{names} joined; restarting to admit it", 1)
        return None

    async def _collect(self, number: int | None, seqs: list[int], key: Callable[..., str]) -> None:
        """Wait until every node in ``seqs`` set its flag (or is gone)."""
        while True:
            waiting = [s for s in seqs if not self._nodes[s].gone]
            keys = [key(number, s) if number is not None else key(s) for s in waiting]
            try:
                await self.store.wait(keys, timeout=self.policy.interval)
                return
            except RpcTimeoutError:
                await self._refresh()

    async def _close(self, code: int, reason: str) -> int:
        """Tell every live node that the job is over; wait until they read it."""
        level = logging.ERROR if code else logging.INFO if self.policy.chatty else logging.DEBUG
        logger.log(level, "job closed (exit code %d): %s", code, reason)
        live = [s for s, n in self._nodes.items() if not n.gone]
        for seq in live:
            await self._send(seq, rec.Message(kind="closed", code=code, reason=reason))
        await self._collect(None, live, rec.bye_key)
        return code

    async def _send(self, seq: int, message: rec.Message) -> None:
        node = self._nodes[seq]
        await self.store.set(rec.inbox_key(seq, node.outbox), rec.encode(message))
        node.outbox += 1

    async def _pause(self) -> None:
        """Sleep one interval, or less: until shutdown() or a launcher registers."""
        woken = asyncio.create_task(self._wake.wait())
        arrival = asyncio.create_task(self._arrival())
        try:
            await asyncio.wait(
                {woken, arrival}, timeout=self.policy.interval, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (woken, arrival):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, RpcdistError):
                    await task
        self._wake.clear()

    async def _arrival(self) -> None:
        """Return once the next launcher has registered (waits on the store)."""
        await self.store.get(rec.node_key(len(self._nodes) + 1))

    # -- membership ----------------------------------------------------------

    async def _refresh(self) -> None:
        """Admit new registrations; mark nodes that left or stopped beating."""
        now = self._loop.time()
        if now - self._refreshed > self.policy.node_timeout / 2:
            # This loop itself was held up: nobody's silence can be judged over that time.
            for node in self._nodes.values():
                node.seen = max(node.seen, now)
        self._refreshed = now
        count = await self.store.add(rec.SEQ, 0)
        for seq in range(len(self._nodes) + 1, count + 1):
            key = rec.node_key(seq)
            try:
                raw = await self.store.get(key, timeout=self.policy.node_timeout)
                info: rec.NodeInfo = rec.decode(rec.NodeInfo, raw, key)
            except (RpcdistError, ValueError) as exc:  # it died while registering
                info = rec.NodeInfo(node_rank=None, hostname="?", pid=0)
                self._nodes[seq] = _Node(seq, info, 0, now, gone=f"never registered ({exc})")
                continue
            node = self._nodes[seq] = _Node(seq, info, -1, now)
            logger.log(logging.INFO if self.policy.chatty else logging.DEBUG, "%s joined", node)
            await self._check_rank(node)
        for node in self._nodes.values():
            if node.gone or node.seq == self.host:  # node 0 judges, and is alive to do so
                continue
            if await peek(self.store, rec.left_key(node.seq)):
                node.gone = "left"
            else:
                beats = await self.store.add(rec.heartbeat_key(node.seq), 0)
                if beats != node.beats:
                    node.beats, node.seen = beats, now
                elif now - node.seen > self.policy.node_timeout:
                    node.gone = f"lost: no heartbeat for {now - node.seen:.1f} s"
                    # Should it still be alive after all, it must not wait for ever.
                    message = rec.Message(
                        kind="closed", code=1, reason=f"this node was {node.gone}"
                    )
                    await self._send(node.seq, message)
            if node.gone:
                logger.warning("%s %s", node, node.gone)

    async def _check_rank(self, node: _Node) -> None:
        """A fixed-size job refuses a second live launcher with the same --node-rank."""
        rank = node.info.node_rank
        if not self.policy.fixed:
            return
        taken = [
            n
            for n in self._nodes.values()
            if n is not node and not n.gone and n.info.node_rank == rank
        ]
        if rank is None or taken or rank >= self.policy.max_nodes:
            reason = (
                f"--node-rank {rank} is taken by {taken[0]}"
                if taken
                else f"--node-rank {rank} is not in [0, {self.policy.max_nodes})"
            )
            node.gone = f"refused: {reason}"
            await self._send(node.seq, rec.Message(kind="refused", code=2, reason=reason))
