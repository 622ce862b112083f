"""One node's agent: follow the rounds the coordinator announces, run and stop the workers.

The same loop runs every kind of job. A single-node job is a one-node job
whose coordinator and store live in the launcher (:class:`MemoryStore`);
with several nodes the store is the launchers' gRPC store on
``--master-addr:--master-port`` (see ``_hosting``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Iterator
from types import FrameType
from typing import Any, TypeVar

from .._errors import RpcdistError
from . import _records as rec
from ._args import LaunchConfig
from ._children import POLL_INTERVAL, WorkerGroup, child_env, exit_code
from ._coordinator import Coordinator
from ._hosting import Membership, join
from ._rendezvous import NodeSession

__all__ = ["run_node"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_FORWARDED = (signal.SIGINT, signal.SIGTERM)


class _Signals:
    """SIGINT/SIGTERM to the launcher: forward the first to the workers, SIGKILL on the second."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.group: WorkerGroup | None = None
        self.loop = asyncio.get_running_loop()
        self.first: asyncio.Future[int] = self.loop.create_future()
        self.handled = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self.group is not None:
            self.group.send(signum if len(self.received) == 1 else signal.SIGKILL)
        self.loop.call_soon_threadsafe(self._note, signum)

    def _note(self, signum: int) -> None:
        if not self.first.done():
            self.first.set_result(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Route SIGINT/SIGTERM here while inside (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.on_signal) for s in _FORWARDED}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def unhandled(self) -> list[asyncio.Future[int]]:
        """The first-signal future while nobody has acted on it yet."""
        return [] if self.handled else [self.first]


class _Agent:
    def __init__(self, config: LaunchConfig, member: Membership, signals: _Signals) -> None:
        self.config = config
        self.member = member
        self.session: NodeSession = member.session
        self.coordinator: Coordinator | None = member.coordinator
        self.signals = signals
        self.rounds = 0  # rounds this node took part in
        self._envs: list[dict[str, str]] = []
        self._rank_restarts: list[int] = []  # per local rank, under --restart-policy rank

    async def run(self) -> int:
        """Follow the coordinator's messages until the job is closed; this node's exit code."""
        while True:
            message = await self._until(self.session.next_message())
            if message is None:  # signalled while no round runs here
                left = await self._on_signal(None)
                if left is not None:
                    return left
                continue
            if message.kind == "refused":
                logger.error("node 0 refused this launcher: %s", message.reason)
                return message.code
            if message.kind == "closed":
                await self.session.mark(rec.bye_key(self.session.seq))
                if self.coordinator is None:  # node 0's coordinator logged it already
                    level = logging.ERROR if message.code else logging.INFO
                    logger.log(level, "job closed (exit code %d): %s", message.code, message.reason)
                return message.code
            left = await self._round(message.number)
            if left is not None:
                return left

    async def _until(self, aw: Awaitable[_T]) -> _T | None:
        """``await aw``; ``None`` if a signal comes first. Raises when the store is lost."""
        task = asyncio.ensure_future(aw)
        try:
            waiting: set[asyncio.Future[Any]] = {task, self.session.lost, *self.signals.unhandled()}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            if self.session.lost.done():
                self.session.lost.result()
            return None
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, RpcdistError):
                    await task

    async def _on_signal(self, number: int | None) -> int | None:
        """Act on the first signal: node 0 ends the job, another node leaves it.

        Returns this launcher's exit code when it leaves, ``None`` otherwise.
        """
        self.signals.handled = True
        signum = self.signals.first.result()
        logger.warning("received signal %d; stopping the workers", signum)
        reason = f"{self.member.describe()} received signal {signum}"
        if self.coordinator is not None:
            self.coordinator.shutdown(128 + signum, reason)
            return None
        seq = self.session.seq
        with contextlib.suppress(RpcdistError):  # leaving anyway
            await self.session.mark(rec.left_key(seq))
            if number is not None:
                end = rec.End("membership", f"{reason} and left", 1, lost=[seq])
                await self.session.end_round(number, end)
        return 128 + signum

    async def _round(self, number: int) -> int | None:
        """Run this node's workers for round ``number``; an exit code if this node leaves."""
        cfg, session = self.config, self.session
        record = await session.round(number)
        node_rank, nnodes = record.members.index(session.seq), len(record.members)
        first = node_rank * cfg.nproc_per_node
        if number and self.rounds:
            logger.warning("restarting the worker group (%d/%d)", number, cfg.max_restarts)
        elif number:
            logger.info("joining the job at restart %d/%d", number, cfg.max_restarts)
        self.rounds += 1
        logger.info(
            "starting %d worker(s) (ranks %d..%d of %d), master %s:%d, attempt %d/%d",
            cfg.nproc_per_node,
            first,
            first + cfg.nproc_per_node - 1,
            nnodes * cfg.nproc_per_node,
            cfg.master_addr,
            record.master_port,
            number + 1,
            cfg.max_restarts + 1,
        )
        envs = [
            child_env(
                cfg,
                local,
                record.master_port,
                restart_count=number,
                node_rank=node_rank,
                nnodes=nnodes,
                token=self.member.job.token,
            )
            for local in range(cfg.nproc_per_node)
        ]
        ft = None
        if cfg.restart_policy == "rank":  # the fault-tolerant mode's coordinator lives here
            from ..parallel import FaultToleranceCoordinator

            ft = FaultToleranceCoordinator(cfg.world_size, host=cfg.master_addr)
            envs = [{**env, "RPCDIST_FT_ADDR": ft.address} for env in envs]
        self._envs, self._rank_restarts = envs, [0] * len(envs)
        group = WorkerGroup(cfg, first)
        self.signals.group = group
        try:
            group.start(envs, stop_if=lambda: bool(self.signals.received))
            try:
                left = await self._watch(number, group, node_rank)
            except RpcdistError:  # the store is lost: stop the workers all the same
                await group.stop(None if self.signals.received else signal.SIGTERM)
                raise
            if left is not None:
                await group.stop(None)
                return left
            await group.stop(None if self.signals.received else signal.SIGTERM)
        finally:
            self.signals.group = None
            group.close()  # nothing left to do unless an error cut the above short
            if ft is not None:
                ft.close()
        await session.mark(rec.stopped_key(number, session.seq))
        return None

    async def _watch(self, number: int, group: WorkerGroup, node_rank: int) -> int | None:
        """Wait for the end of round ``number``, reporting this node's workers' outcome."""
        session = self.session
        ended = asyncio.ensure_future(session.wait_end(number))
        reported = failed_here = False
        try:
            while not ended.done():
                waiting: set[asyncio.Future[Any]] = {ended, session.lost, *self.signals.unhandled()}
                await asyncio.wait(
                    waiting, timeout=POLL_INTERVAL, return_when=asyncio.FIRST_COMPLETED
                )
                if session.lost.done():
                    session.lost.result()
                if self.signals.first.done() and not self.signals.handled:
                    left = await self._on_signal(number)
                    if left is not None:
                        return left
                if reported or ended.done():
                    continue
                state = group.poll()
                if state is True:
                    reported = True
                    logger.info("all %d worker(s) finished successfully", len(group.procs))
                    await session.mark(rec.done_key(number, session.seq))
                elif state is not False and self._restart_rank(group, state):
                    continue
                elif state is not False:
                    reported = failed_here = True
                    await session.end_round(number, self._failure(group, state, node_rank))
            end = ended.result()
            told = (end.kind == "failed" and failed_here) or (
                end.kind == "shutdown" and self.signals.handled
            )
            if end.kind != "done" and not told:
                logger.warning("stopping the workers: %s", end.reason)
            return None
        finally:
            if not ended.done():
                ended.cancel()
                with contextlib.suppress(asyncio.CancelledError, RpcdistError):
                    await ended

    def _restart_rank(self, group: WorkerGroup, state: tuple[int, int]) -> bool:
        """``--restart-policy rank``: start only the failed worker again, if it has restarts left."""
        local, rc = state
        used = self._rank_restarts[local]
        if self.config.restart_policy != "rank" or used >= self.config.max_restarts:
            return False
        self._rank_restarts[local] = used + 1
        logger.warning(
            "worker rank %d exited with code %d; restarting only rank %d (%d/%d)",
            group.first_rank + local,
            rc,
            group.first_rank + local,
            used + 1,
            self.config.max_restarts,
        )
        env = {**self._envs[local], "RPCDIST_RESTART_COUNT": str(used + 1)}
        group.restart(local, env)
        return True

    def _failure(self, group: WorkerGroup, state: tuple[int, int], node_rank: int) -> rec.End:
        local, rc = state
        rank = group.first_rank + local
        logger.error(
            "worker rank %d (pid %d) exited with code %d; stopping %d other worker(s)",
            rank,
            group.procs[local].pid,
            rc,
            group.running(),
        )
        where = f" on node {node_rank}" if self.config.multi_node else ""
        return rec.End("failed", f"worker rank {rank}{where} exited with code {rc}", exit_code(rc))


async def run_node(config: LaunchConfig) -> int:
    """Run this node's part of the job described by ``config``; its exit code.

    Raises:
        ConfigError: this launcher does not fit the job node 0 started.
        ConnectError: the launchers' store can be neither served nor reached.
        OSError: a child could not be started.
    """
    signals = _Signals()
    with signals.installed():
        async with join(config) as member:
            return await _Agent(config, member, signals).run()
