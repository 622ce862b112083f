"""Node 0's membership decisions, in one process: a coordinator and launcher sessions
over the in-memory store, with short heartbeat timings."""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

import pytest

from rpcdist import ProtocolError
from rpcdist.launch import _records as rec
from rpcdist.launch._coordinator import Coordinator, RoundPolicy
from rpcdist.launch._rendezvous import MemoryStore, NodeSession

FIXED = RoundPolicy(
    min_nodes=2,
    max_nodes=2,
    fixed=True,
    max_restarts=1,
    rdzv_timeout=10.0,
    last_call=0.0,
    node_timeout=0.3,
    interval=0.02,
)
ELASTIC = replace(FIXED, min_nodes=1, max_nodes=3, fixed=False)


def in_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run the coroutine test ``test`` in a fresh event loop, under a time limit."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(asyncio.wait_for(test(), 20))

    return run


class Job:
    """A coordinator on node 0 and the sessions of the launchers taking part."""

    def __init__(self, policy: RoundPolicy) -> None:
        self.store = MemoryStore()
        self.policy = policy
        self.ports = itertools.count(5000)
        self.task: asyncio.Task[int] | None = None

    async def node(self, node_rank: int | None = None) -> NodeSession:
        session = NodeSession(self.store, "memory", interval=0.02, node_timeout=0.3)
        await session.register(node_rank)
        return session

    async def start(self, node_rank: int | None = None) -> NodeSession:
        host = await self.node(node_rank)
        coordinator = Coordinator(self.store, self.policy, host.seq, lambda: next(self.ports))
        self.coordinator = coordinator
        self.task = asyncio.create_task(coordinator.run())
        return host

    async def result(self) -> int:
        assert self.task is not None
        async with asyncio.timeout(10):
            return await self.task


async def next_round(session: NodeSession) -> rec.Round:
    async with asyncio.timeout(10):
        message = await session.next_message()
    assert message.kind == "round", message
    return await session.round(message.number)


async def stop(number: int, *sessions: NodeSession) -> None:
    for s in sessions:
        await s.mark(rec.stopped_key(number, s.seq))


async def closed(*sessions: NodeSession) -> list[tuple[int, str]]:
    found = []
    for s in sessions:
        async with asyncio.timeout(10):
            message = await s.next_message()
        assert message.kind == "closed", message
        await s.mark(rec.bye_key(s.seq))
        found.append((message.code, message.reason))
    return found


async def close_all(*sessions: NodeSession) -> None:
    for s in sessions:
        await s.close()


def test_order_members_puts_node_0_first_then_the_previous_order_then_newcomers():
    assert rec.order_members(1, [1, 4, 2], [2, 3, 4, 1, 6], 4) == [1, 4, 2, 3]
    assert rec.order_members(1, [1, 2], [1, 3], 5) == [1, 3]
    assert rec.order_members(1, [], [5, 1, 2], 2) == [1, 2]


def test_records_round_trip_and_garbage_is_a_protocol_error():
    end = rec.End("membership", "lost", 1, lost=[3])
    assert rec.decode(rec.End, rec.encode(end), "k") == end
    with pytest.raises(ProtocolError, match="'k' holds b'nope'"):
        rec.decode(rec.End, b"nope", "k")


@in_loop
async def test_fixed_job_orders_by_node_rank_and_closes_when_all_are_done():
    job = Job(FIXED)
    node1 = await job.node(1)  # arrives first; still node 1
    node0 = await job.start(0)
    rounds = [await next_round(s) for s in (node0, node1)]
    assert rounds[0] == rounds[1] == rec.Round(0, [node0.seq, node1.seq], 5000)
    for s in (node0, node1):
        await s.mark(rec.done_key(0, s.seq))
    assert (await node0.wait_end(0)).kind == "done"
    await stop(0, node0, node1)
    assert await closed(node0, node1) == [(0, "every worker finished successfully")] * 2
    assert await job.result() == 0
    await close_all(node0, node1)


@in_loop
async def test_failure_restarts_every_node_then_gives_up_with_the_child_s_code():
    job = Job(FIXED)
    node0, node1 = await job.start(0), await job.node(1)
    for number in (0, 1):
        for s in (node0, node1):
            assert (await next_round(s)).number == number
        failed = rec.End("failed", f"worker rank 1 exited with code 3 (try {number})", 3)
        await node1.end_round(number, failed)
        await node0.end_round(number, rec.End("failed", "too late: the first end wins", 9))
        assert await node0.wait_end(number) == failed
        await stop(number, node0, node1)
    (code, reason), _ = await closed(node0, node1)
    assert code == 3 and "(try 1); no restarts left (1 used)" in reason
    assert await job.result() == 3
    await close_all(node0, node1)


@in_loop
async def test_a_lost_node_ends_the_round_and_the_next_one_goes_on_without_it():
    job = Job(replace(ELASTIC, max_restarts=2))
    node0 = await job.start()
    assert (await next_round(node0)).members == [node0.seq]  # no last call: one is enough
    node1 = await job.node()
    end = await node0.wait_end(0)  # its arrival restarts the job
    assert (end.kind, end.lost) == ("membership", [])
    assert end.reason.endswith("joined; restarting to admit it")
    await stop(0, node0)
    assert (await next_round(node1)).members == [node0.seq, node1.seq]
    assert (await next_round(node0)).number == 1
    await node1.close()  # no more heartbeats
    end = await node0.wait_end(1)
    assert (end.kind, end.lost, end.code) == ("membership", [node1.seq], 1)
    assert "lost: no heartbeat" in end.reason
    await stop(1, node0)
    assert (await next_round(node0)).members == [node0.seq]
    await node0.mark(rec.done_key(2, node0.seq))
    await stop(2, node0)
    assert await closed(node0) == [(0, "every worker finished successfully")]
    assert await job.result() == 0
    # Were node 1 alive after all, it would not wait for ever: it was told.
    key = rec.inbox_key(node1.seq, 1)  # after its one round
    told = rec.decode(rec.Message, await job.store.get(key, timeout=1), key)
    assert (told.kind, told.code) == ("closed", 1)
    assert told.reason.startswith("this node was lost: no heartbeat")
    await close_all(node0)


@in_loop
async def test_a_node_that_leaves_is_not_waited_for():
    job = Job(replace(ELASTIC, min_nodes=2, max_restarts=3, last_call=5.0))
    node0 = await job.start()
    node1, node2 = await job.node(), await job.node()
    members = [node0.seq, node1.seq, node2.seq]
    for s in (node0, node1, node2):
        assert (await next_round(s)).members == members  # all three: no last call needed
    await node2.mark(rec.left_key(node2.seq))
    end = await node0.wait_end(0)
    assert (end.kind, end.lost, end.reason) == ("membership", [node2.seq], f"{end.reason}")
    assert "left" in end.reason
    await stop(0, node0, node1)  # node 2 never acknowledges: it left
    for s in (node0, node1):
        assert (await next_round(s)).members == [node0.seq, node1.seq]
    for s in (node0, node1):
        await s.mark(rec.done_key(1, s.seq))
    await stop(1, node0, node1)
    assert [code for code, _ in await closed(node0, node1)] == [0, 0]
    assert await job.result() == 0
    await close_all(node0, node1, node2)


@in_loop
async def test_a_full_elastic_job_keeps_a_newcomer_waiting():
    job = Job(replace(ELASTIC, max_nodes=1))
    node0 = await job.start()
    assert (await next_round(node0)).members == [node0.seq]
    extra = await job.node()
    await asyncio.sleep(0.1)  # let several membership checks pass: nothing must happen
    await node0.mark(rec.done_key(0, node0.seq))
    assert (await node0.wait_end(0)).kind == "done"
    await stop(0, node0)
    assert [code for code, _ in await closed(node0, extra)] == [0, 0]  # told it is over
    assert await job.result() == 0
    await close_all(node0, extra)


@in_loop
async def test_a_second_launcher_for_a_taken_node_rank_is_refused():
    job = Job(FIXED)
    node0 = await job.start(0)
    twin = await job.node(0)
    async with asyncio.timeout(10):
        message = await twin.next_message()
    assert (message.kind, message.code) == ("refused", 2)
    assert message.reason.startswith("--node-rank 0 is taken by launcher 1")
    job.coordinator.shutdown(130, "interrupted")
    assert await closed(node0) == [(130, "interrupted")]
    assert await job.result() == 130
    await close_all(node0, twin)


@in_loop
async def test_shutdown_ends_the_running_round_and_the_job():
    job = Job(FIXED)
    node0, node1 = await job.start(0), await job.node(1)
    for s in (node0, node1):
        await next_round(s)
    job.coordinator.shutdown(143, "launcher 1 received signal 15")
    end = await node1.wait_end(0)
    assert (end.kind, end.code) == ("shutdown", 143)
    await stop(0, node0, node1)
    assert await closed(node0, node1) == [(143, "launcher 1 received signal 15")] * 2
    assert await job.result() == 143
    await close_all(node0, node1)


@in_loop
async def test_too_few_nodes_in_time_closes_the_job_with_code_1():
    job = Job(replace(FIXED, rdzv_timeout=0.1))
    node0 = await job.start(0)
    ((code, reason),) = await closed(node0)
    assert code == 1 and "only 1 of the 2 node(s) needed joined" in reason
    assert await job.result() == 1
    await close_all(node0)
