"""Shutting an agent down: graceful (collective) or at once.

A graceful shutdown first lets every extension drain its own traffic (in
name order, the same on every worker, since drains may be collective), then
waits until no worker has work in flight: each worker, once locally idle,
publishes ``(calls sent, calls handled, idle)`` to the store; when every
worker is idle, the sums of sent and handled calls agree, and they are
unchanged from the previous round, no call can be in flight anywhere (the
four-counter termination test), so fire-and-forget chains started by
handlers are waited for. Rank 0 serves the store and stops it only after
every other rank has said it is leaving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING

import msgpack

from .._errors import ClosedError, RpcdistError, RpcTimeoutError

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["close", "log", "shutdown"]

log = logging.getLogger(__name__)


async def shutdown(agent: Agent, graceful: bool, timeout: float | None) -> None:
    """Shut ``agent`` down (on its loop); see ``rpcdist.shutdown``.

    Raises:
        RpcTimeoutError: a graceful shutdown did not finish within ``timeout``.
        RpcdistError: a graceful shutdown failed, or an extension found
            something wrong (for example, leaked RRefs).
    """
    err: BaseException | None = None
    if graceful:
        limit = timeout if timeout is not None else agent.options.shutdown_timeout
        try:
            async with asyncio.timeout(limit):
                for _, ext in sorted(agent.registry.extensions.items()):
                    await ext.drain()
                await _quiesce(agent, limit)
        except TimeoutError:
            err = RpcTimeoutError(
                f"graceful shutdown of {agent.name!r} did not finish within {limit} s "
                f"({len(agent.calls)} calls pending, {agent.activity.inflight} handlers running)"
            )
        except RpcdistError as e:
            err = e
    ok = graceful and err is None
    await close(agent, graceful=ok, leave=ok)
    if err is not None:
        raise err
    if ok:
        for _, ext in sorted(agent.registry.extensions.items()):
            ext.check()


async def _quiesce(agent: Agent, limit: float) -> None:
    """Wait until no worker has work in flight (two stable rounds)."""
    activity = agent.activity
    store = agent.store
    previous: tuple[int, int] | None = None
    pause = 0.002
    # From here on, threads finishing work wake the loop (see
    # Activity.handler_done_threadsafe); what finished before is checked now.
    activity.quiescing = True
    for round_no in itertools.count():
        activity.check_idle()
        await activity.idle.wait()
        report = [activity.sent, activity.handled, int(activity.idle.is_set())]
        await store.set(f"rpc/quiesce/{round_no}/{agent.rank}", msgpack.packb(report))
        got = await asyncio.gather(
            *(store.get(f"rpc/quiesce/{round_no}/{r}", limit) for r in range(agent.world_size))
        )
        reports = [msgpack.unpackb(g) for g in got]
        sent = sum(r[0] for r in reports)
        handled = sum(r[1] for r in reports)
        idle = all(r[2] for r in reports)
        if idle and sent == handled and previous == (sent, handled):
            return
        previous = (sent, handled) if idle and sent == handled else None
        if previous is None:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)


async def close(agent: Agent, *, graceful: bool = False, leave: bool = False) -> None:
    """Close ``agent`` (on its loop): fail what is pending, end links and tasks,
    leave and close the store. ``leave``: tell rank 0's store we are done."""
    exc = ClosedError(f"agent {agent.name!r} shut down")
    agent.closed = True
    agent.sync.close()
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
            if leave:
                await _leave_store(agent)
        except RpcdistError as e:
            log.debug("store leave on %s: %s", agent.name, e)
        await store.close()
    if agent._store_server is not None:
        await agent._store_server.stop(1.0)


async def _leave_store(agent: Agent) -> None:
    """Rank 0 serves the store: it stops only after the others are done with it."""
    if agent.rank != 0:
        await agent.store.set(f"rpc/left/{agent.rank}", b"1")
    else:
        keys = [f"rpc/left/{r}" for r in range(1, agent.world_size)]
        if keys:
            await agent.store.wait(keys, 5.0)
