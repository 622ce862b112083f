"""Shutting an agent down: graceful (collective) or at once.

A graceful shutdown first lets every extension drain its own traffic (in
name order, the same on every worker, since drains may be collective), then
waits until no worker has work in flight: in rounds, each worker, once
locally idle (no handler running, no call of its own pending), publishes
``(calls sent, calls handled, idle, lost workers)`` to the store; when two
consecutive rounds find every live worker idle with unchanged counts, no
call can be in flight anywhere: a call is pending at its caller until it is
answered, so an idle caller has none, and unchanged counts across the two
rounds rule out work that started and ended between one worker's reports.
(Sent and handled need not agree: calls that timed out, calls to or from a
worker that died, and stray calls from outside the worker table never
balance, and must not hold the job up.) Fire-and-forget chains started by
handlers are waited for, since their callers stay busy until answered.

**Deaths.** Workers declared lost (:mod:`._liveness`) are skipped: a round
waits only for live workers' reports and starts over without one lost
meanwhile. A worker lost to one survivor is lost to all: reports carry the
lost workers, and a report still missing after a short wait makes the
survivor probe its writer (a ping that cannot be sent or is not answered
within ``peer_timeout`` declares it lost). So survivors finish within about a
second of the death being detected. Rank 0, which serves the store, is a peer like
any other: every store operation of the shutdown is raced against its
verdict (:func:`on_store`, which keeps a link to it watched), so a store
host that hangs (SIGSTOP) ends the rounds within the detector's window
instead of each store call's own deadline. If it is lost, the survivors
cannot coordinate: each waits (briefly) to be locally idle and closes. Either way :func:`shutdown` returns the workers it went on
without and logs a warning naming them.

Rank 0 serves the store and stops it only after every other live rank has
said it is leaving (waiting before it closes its own links, so that a rank
that dies meanwhile is found lost and not waited for).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from .._errors import ClosedError, RpcdistError, RpcTimeoutError, TransportError
from .._worker import WorkerInfo
from . import _doctor

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["barrier_live", "close", "gather_live", "log", "on_store", "shutdown"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How long a round waits for a report before watching its writer.
_SUSPECT_AFTER = 0.25
#: With rank 0 (the store) lost: how long to wait for local idleness.
_LOCAL_IDLE_LIMIT = 2.0
#: How long a round still waits for a worker's report once it is lost.
_LOST_GRACE = 0.1
#: With rank 0 lost: how long to try telling its store that we leave.
_LEAVE_LIMIT = 1.0
#: How long rank 0 waits for the others to leave its store.
_LEAVE_WAIT = 5.0
#: Shutting down at once: how long rank 0 waits for the others to finish
#: their init with its store (an init is short; a rank lost in it is not).
_INIT_WAIT = 5.0
#: The counter of ranks past init, and the key the last one sets.
_PASSED = "rpc/init/passed"


async def shutdown(agent: AgentView, graceful: bool, timeout: float | None) -> list[WorkerInfo]:
    """Shut ``agent`` down (on its loop); see ``rpcdist.shutdown``.

    Returns the workers a graceful shutdown went on without.

    Raises:
        RpcTimeoutError: a graceful shutdown did not finish within ``timeout``.
        RpcdistError: a graceful shutdown failed, or an extension found
            something wrong (for example, leaked RRefs).
    """
    err: BaseException | None = None
    finished: set[int] = set()
    if graceful:
        limit = timeout if timeout is not None else agent.options.shutdown_timeout
        agent.liveness.leaving = True
        try:
            finished = await _coordinated(agent, timeout, limit)
        except TimeoutError:
            err = RpcTimeoutError(
                f"graceful shutdown of {agent.name!r} did not finish within {limit} s "
                f"({len(agent.calls)} calls pending, {agent.activity.inflight} handlers running)"
                f"; {_doctor.summary(_doctor.snapshot(agent))}",
                snapshot=_doctor.snapshot(agent),
            )
        except RpcdistError as e:
            err = e
    ok = graceful and err is None
    skipped = [agent.workers[r] for r in sorted(agent.liveness.lost) if r not in finished]
    if ok and skipped:
        log.warning(
            "%s: graceful shutdown went on without lost workers: %s",
            agent.name,
            "; ".join(f"{w.name!r} (rank {w.id}: {agent.liveness.lost[w.id]})" for w in skipped),
        )
    await close(agent, graceful=ok, leave=ok)
    if err is not None:
        raise err
    if ok:
        for _, ext in sorted(agent.registry.extensions.items()):
            ext.check()
    return skipped if ok else []


async def _coordinated(agent: AgentView, timeout: float | None, limit: float) -> set[int]:
    """Wait for every live worker to call ``shutdown``, then drain the
    extensions and quiesce within ``limit``, through the store; without it
    (rank 0 lost), only wait to be locally idle. Returns the lost workers that
    finished their shutdown first (see :func:`_quiesce`).

    The arrival is bounded by ``timeout`` only: without one, a worker waits
    for its live peers as long as they work (a parameter server for its
    trainers), while dead, hung or cut-off ones are declared lost by the
    failure detector and not waited for.

    Raises:
        TimeoutError: the drain did not finish within ``limit``.
        RpcTimeoutError: a live worker did not arrive within ``timeout``.
    """
    before = set(agent.liveness.lost)
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        if not _store_lost(agent):
            if agent.world_size > 1 and agent.store is not None:
                await barrier_live(agent, "rpcdist/shutdown/arrive", timeout)
            if timeout is not None:  # one bound for the whole shutdown
                limit = max(timeout - (loop.time() - start), 0.001)
            async with asyncio.timeout(limit):
                for _, ext in sorted(agent.registry.extensions.items()):
                    await ext.drain()
                return await _quiesce(agent)
    except TransportError:
        if not await _store_host_lost(agent):
            raise
    await _local_idle(agent)
    # Without the store, a peer that went away since this shutdown began
    # cannot be told from one that finished shutting down (its links end
    # either way): presume it left.
    return set(agent.liveness.lost) - before - {0}


def _store_lost(agent: AgentView) -> bool:
    return agent.rank != 0 and agent.liveness.is_lost(0)


async def _store_host_lost(agent: AgentView) -> bool:
    """After a store failure: whether rank 0 is (found) lost, waiting at most
    the detector's window for the verdict."""
    liveness = agent.liveness
    if agent.rank == 0:
        return False
    liveness.probe(0, "the store it serves failed")
    loop = asyncio.get_running_loop()
    end = loop.time() + (liveness.window(0) if liveness.timeout else 0.0) + liveness.interval
    while not liveness.is_lost(0) and loop.time() < end:
        changed = liveness.changed()
        await asyncio.wait({changed}, timeout=end - loop.time())
        if not changed.done():
            changed.cancel()
    return liveness.is_lost(0)


async def barrier_live(agent: AgentView, name: str, limit: float | None) -> None:
    """A store barrier of the live workers (lost ones are not waited for).

    Raises:
        RpcTimeoutError: a live worker did not arrive within ``limit``.
        TransportError: the store failed.
    """
    await on_store(agent, agent.store.set(f"{name}/{agent.rank}", b"1"))
    await gather_live(agent, lambda r: f"{name}/{r}", limit)


async def on_store(agent: AgentView, aw: Awaitable[T]) -> T:
    """Await a store operation, failing it as soon as rank 0, which serves
    the store, is declared lost (a stopped store host never answers, and
    its gRPC connection stays open). Rank 0 is watched meanwhile (a link
    with heartbeats), so a hung store host is judged as any peer is.

    Raises:
        WorkerLostError: rank 0 was declared lost.
        TransportError: the store failed.
    """
    liveness = agent.liveness
    if agent.rank == 0:
        return await aw
    liveness.watch(0)
    task = asyncio.ensure_future(aw)
    try:
        while not task.done():
            if liveness.is_lost(0):
                raise liveness.error(0, "the rendezvous store it serves")
            changed = liveness.changed()
            waits: set[asyncio.Future[Any]] = {task, changed}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not changed.done():
                changed.cancel()
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _local_idle(agent: AgentView) -> None:
    """Without the store: wait (briefly) until nothing runs or is pending here."""
    activity = agent.activity
    activity.quiescing = True
    activity.check_idle()
    try:
        async with asyncio.timeout(_LOCAL_IDLE_LIMIT):
            await activity.idle.wait()
    except TimeoutError:
        log.warning("%s: closing with work in flight: rank 0 (the store) is lost", agent.name)


async def gather_live(
    agent: AgentView, key: Callable[[int], str], limit: float | None
) -> dict[int, bytes]:
    """Every live worker's value under ``key(rank)`` in the store (on the loop).

    Waits for workers not declared lost; one lost meanwhile is waited for
    only ``_LOST_GRACE`` seconds more (a worker that finished shutting down
    first looks lost to the slower ones, yet has written its value), counted
    from when this wait first sees it lost (the loss itself may have kept
    the loop busy past the grace, with the value's reply queued behind). A
    worker whose value is late is probed
    (:meth:`~._liveness.Liveness.probe`), so a dead one is declared lost
    within the detector's window. Collective.

    Raises:
        RpcTimeoutError: a live worker's value did not come within ``limit``.
        TransportError: the store failed.
    """
    store = agent.store
    liveness = agent.liveness
    tasks = {r: asyncio.ensure_future(store.get(key(r), limit)) for r in range(agent.world_size)}
    out: dict[int, bytes] = {}
    loop = asyncio.get_running_loop()
    probe_at: float | None = loop.time() + _SUSPECT_AFTER
    #: When each lost worker's grace ends (from when it was first seen lost).
    grace: dict[int, float] = {}
    try:
        while True:
            now = loop.time()
            for r in liveness.lost:
                grace.setdefault(r, now + _LOST_GRACE)
            for r, t in tasks.items():
                if t.done() and r not in out and not t.cancelled():
                    if t.exception() is not None and not liveness.is_lost(r):
                        raise t.exception()  # type: ignore[misc]
                    if t.exception() is None:
                        out[r] = t.result()
            waiting = [
                t
                for r, t in tasks.items()
                if not t.done() and (not liveness.is_lost(r) or now < grace[r])
            ]
            if not waiting:
                return out
            if agent.rank != 0 and liveness.is_lost(0):  # nobody serves the store
                raise liveness.error(0, "the rendezvous store it serves")
            wake = [probe_at] if probe_at is not None else []
            wake += [grace[r] for r in liveness.lost if r in tasks]
            wake = [w for w in wake if w > now]
            lost = liveness.changed()
            pending: set[asyncio.Future[Any]] = {*waiting, lost}
            await asyncio.wait(
                pending,
                timeout=min(wake) - now if wake else None,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not lost.done():
                lost.cancel()
            if probe_at is not None and loop.time() >= probe_at:
                probe_at = None
                for r, t in tasks.items():
                    if not t.done():
                        liveness.probe(r, "it is late for a shutdown round")
    finally:
        for t in tasks.values():
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def _quiesce(agent: AgentView) -> set[int]:
    """Wait until no live worker has work in flight (two stable rounds).

    Returns the lost workers that reported the deciding round anyway (they
    finished, then left).
    """
    activity = agent.activity
    liveness = agent.liveness
    store = agent.store
    previous: dict[int, tuple[int, int]] | None = None
    pause = 0.002
    limit = agent.options.shutdown_timeout
    # From here on, threads finishing work wake the loop (see
    # Activity.handler_done_threadsafe); what finished before is checked now.
    activity.quiescing = True
    for round_no in itertools.count():
        activity.check_idle()
        await activity.idle.wait()
        report = [
            activity.sent,
            activity.handled,
            int(activity.idle.is_set()),
            sorted(liveness.lost),
        ]
        await on_store(
            agent, store.set(f"rpc/quiesce/{round_no}/{agent.rank}", msgpack.packb(report))
        )
        got = await gather_live(agent, functools.partial(_report_key, round_no), limit)
        reports = {r: msgpack.unpackb(v) for r, v in got.items()}
        for r, rep in reports.items():
            for lost in rep[3]:  # a death one survivor saw is a death for all
                liveness.declare(lost, f"worker rank {r} reported it lost")
        live = {r: rep for r, rep in reports.items() if not liveness.is_lost(r)}
        counts = {r: (rep[0], rep[1]) for r, rep in live.items()}
        idle = all(rep[2] for rep in live.values())
        if idle and previous is not None and all(previous.get(r) == c for r, c in counts.items()):
            return {r for r in reports if liveness.is_lost(r)}
        previous = counts if idle else None
        if previous is None:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
    raise AssertionError("unreachable")  # pragma: no cover


def _report_key(round_no: int, rank: int) -> str:
    return f"rpc/quiesce/{round_no}/{rank}"


async def passed_init(agent: AgentView) -> None:
    """Tell the store this rank is done with init (the last rank marks it)."""
    if await agent.store.add(_PASSED, 1) == agent.world_size:
        await agent.store.set(f"{_PASSED}/done", b"1")


async def close(agent: AgentView, *, graceful: bool = False, leave: bool = False) -> None:
    """Close ``agent`` (on its loop): fail what is pending, end links and tasks,
    leave and close the store. ``leave``: tell rank 0's store we are done (rank
    0: wait for the others to be done with it, still watching them). Rank 0
    never stops its store under a rank still in init (``shutdown(graceful=False)``
    right after ``init_rpc``), waiting at most ``_INIT_WAIT`` for them."""
    if agent.rank == 0 and agent.store is not None and not agent.closed:
        try:
            if leave:
                async with asyncio.timeout(_LEAVE_WAIT):
                    await _wait_for_leavers(agent)
            elif agent._store_server is not None and agent.workers and not agent.dynamic:
                await agent.store.get(f"{_PASSED}/done", _INIT_WAIT)
        except (RpcdistError, TimeoutError) as e:
            log.debug("store leave on %s: %s", agent.name, e)
    exc = ClosedError(f"agent {agent.name!r} shut down")
    agent.closed = True
    agent.liveness.stop()
    agent.sync.close()
    agent.sync_serving.close()
    agent.busy_poll.close()
    agent.calls.fail_all(exc)
    agent.mailbox.fail_all(None, ClosedError(str(exc)))
    for ext in list(agent.registry.extensions.values()):
        try:
            ext.close()
        except Exception:
            log.exception("closing extension %r of %s", ext.name, agent.name)
    tasks = list(agent._tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await agent.links.close(0.5 if graceful else 0)
    store = agent.store
    if store is not None:
        try:
            if leave:  # (rank 0 "lost" may only have finished first: try briefly)
                async with asyncio.timeout(_LEAVE_LIMIT if _store_lost(agent) else None):
                    await _leave_store(agent)
        except (RpcdistError, TimeoutError) as e:
            log.debug("store leave on %s: %s", agent.name, e)
        await store.close()
    if agent._store_server is not None:
        await agent._store_server.stop(1.0)


async def _leave_store(agent: AgentView) -> None:
    """Tell rank 0's store that this rank is done with it (not rank 0)."""
    if agent.rank != 0:
        await agent.store.set(f"rpc/left/{agent.rank}", b"1")


async def _wait_for_leavers(agent: AgentView) -> None:
    """Rank 0 serves the store: before closing, wait until every other live
    rank has said it is leaving (a rank lost meanwhile is not waited for)."""
    server = agent._store_server
    if server is not None and not agent.workers:
        return  # the job never formed: nobody read the worker table, nobody waits
    await agent.store.set("rpc/left/0", b"1")
    await gather_live(agent, _left_key, _LEAVE_WAIT)


def _left_key(rank: int) -> str:
    return f"rpc/left/{rank}"
