"""Collectives among agents inside this process (one thread per rank), both backends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import rpc_funcs as rf
from agent_support import ok, on_all

import rpcdist
from rpcdist import CollectiveError, ConfigError, RpcTimeoutError, WrongThreadError
from rpcdist import collectives as dist
from rpcdist.collectives import ReduceOp
from rpcdist.collectives._api import attach, detach
from rpcdist.testing import as_current, local_agents

GAUGES = ("collectives_queued", "collectives_inflight", "p2p_posted", "p2p_unclaimed")


def settle(agents: list[Any]) -> dict[str, int]:
    end = time.monotonic() + 5
    while True:
        totals = {k: sum(a.statistics().get(k, 0) for a in agents) for k in GAUGES}
        if not any(totals.values()) or time.monotonic() > end:
            return totals
        time.sleep(0.01)


@pytest.fixture(params=["shm", "ring"])
def group3(request: pytest.FixtureRequest) -> Iterator[list[Any]]:
    with local_agents(3) as agents:
        ok(on_all(agents, lambda r: attach(agents[r], request.param, 20)))
        yield agents
        assert settle(agents) == dict.fromkeys(GAUGES, 0)
        ok(on_all(agents, lambda r: detach(agents[r])))


def test_every_collective_matches_numpy(group3):
    agents = group3

    def work(r: int) -> None:
        p = dist.get_world_size()
        assert dist.get_rank() == r and p == 3 and dist.is_initialized()
        assert dist.get_backend() in ("shm", "ring")
        for n in (0, 1, 2, 5, 1000):
            x = np.arange(n, dtype="f8").reshape(-1) * (r + 1)
            dist.all_reduce(x)
            np.testing.assert_array_equal(x, np.arange(n) * 6.0)
        x = np.full((2, 3), r + 1, "i4")
        out = np.zeros_like(x)
        dist.all_reduce(x, ReduceOp.MAX, out=out)
        assert (out == 3).all() and (x == r + 1).all()
        strided = np.arange(20, dtype="i8").reshape(4, 5)[:, ::2]  # not contiguous
        dist.all_reduce(strided)
        np.testing.assert_array_equal(strided, np.arange(20).reshape(4, 5)[:, ::2] * 3)
        zero_d = np.array(r + 1.5)
        dist.all_reduce(zero_d, ReduceOp.AVG)
        assert zero_d == 2.5
        for root in range(p):
            b = np.full(4, r, "u2") if r == root else np.zeros(4, "u2")
            dist.broadcast(b, root)
            assert (b == root).all()
            e = np.zeros(0, "f4")
            dist.broadcast(e, root)
            red = np.full(3, r + 1, "i8")
            dist.reduce(red, root, ReduceOp.PROD)
            np.testing.assert_array_equal(red, 6 if r == root else r + 1)
        outs = [np.empty((q, 2), "f4") for q in range(p)]  # uneven, one empty
        mine = np.arange(2 * r, dtype="f4").reshape(2, r).T  # not contiguous
        dist.all_gather(outs, mine)
        for q in range(p):
            np.testing.assert_array_equal(outs[q], np.arange(2 * q, dtype="f4").reshape(2, q).T)
        rs = np.empty(r, "i4")
        dist.reduce_scatter(rs, [np.full(q, q + r, "i4") for q in range(p)])
        np.testing.assert_array_equal(rs, np.full(r, 3 * r + 3))
        gl = [np.empty(q + 1, "i2") for q in range(p)] if r == 1 else None
        assert dist.gather(np.full(r + 1, r, "i2"), gl, dst=1) is None
        if r == 1:
            assert all((gl[q] == q).all() for q in range(p))
        sc = np.empty(r, "f8")
        dist.scatter(sc, [np.full(q, q * 1.5) for q in range(p)] if r == 2 else None, src=2)
        np.testing.assert_array_equal(sc, np.full(r, r * 1.5))
        a2a_out = [np.empty(q + r, "i8") for q in range(p)]
        dist.all_to_all(a2a_out, [np.full(r + q, 10 * r + q, "i8") for q in range(p)])
        for q in range(p):
            np.testing.assert_array_equal(a2a_out[q], np.full(q + r, 10 * q + r))
        dist.barrier()

    ok(on_all(agents, work))


def test_async_ops_complete_in_issue_order_and_barrier_implies_done(group3):
    agents = group3

    def work(r: int) -> list[Any]:
        bufs = [np.full(5, float(k + r)) for k in range(300)]
        works = [dist.all_reduce(b, async_op=True) for b in bufs]
        dist.barrier()
        assert all(w.is_completed() for w in works)
        done_order = []
        more = [dist.all_reduce(np.ones(3), async_op=True) for _ in range(20)]
        for i, w in enumerate(more):
            w.get_future().add_done_callback(lambda _f, i=i: done_order.append(i))
        assert more[-1].wait() is True
        assert done_order == list(range(20))
        for k, (b, w) in enumerate(zip(bufs, works)):
            assert w.is_success() and w.exception() is None
            assert w.result() is b and (b == 3 * k + 3).all()
        return [agents[r].statistics()[k] for k in ("collectives_completed", "collectives_failed")]

    for completed, failed in ok(on_all(agents, work)):
        assert completed >= 321 and failed == 0


def test_works_are_awaitable_from_another_event_loop(group3):
    import asyncio

    agents = group3

    def work(r: int) -> float:
        async def main() -> float:
            x = np.full(7, float(r))
            got = await dist.all_reduce(x, async_op=True)
            assert got is x
            await dist.barrier(async_op=True)
            return float(x[0])

        return asyncio.run(main())

    assert ok(on_all(agents, work)) == [3.0, 3.0, 3.0]


def test_send_recv_match_by_source_and_tag(group3):
    agents = group3

    def work(r: int) -> None:
        if r == 0:
            dist.send(np.full(3, 1.0), 1, tag=7)
            dist.send(np.full(3, 2.0), 1, tag=5)
            w = dist.isend(np.arange(4, dtype="i4"), 2, tag=0)
            w.wait()
        elif r == 1:
            a, b = np.empty(3), np.empty(3)
            assert dist.recv(b, 0, tag=5) == 0  # out of send order: matched by tag
            dist.recv(a, 0, tag=7)
            assert (a == 1).all() and (b == 2).all()
        else:
            c = np.empty(4, "i4")
            assert dist.irecv(c, 0).result() == 0
            np.testing.assert_array_equal(c, np.arange(4))

    ok(on_all(agents, work))


def test_rpc_and_collectives_interleave_on_one_agent(group3):
    agents = group3

    def work(r: int) -> None:
        for k in range(5):
            x = np.full(100, float(k))
            w = dist.all_reduce(x, async_op=True)
            assert rpcdist.rpc_sync((r + 1) % 3, rf.add, args=(r, k)) == r + k
            w.wait()
            assert (x == 3 * k).all()

    ok(on_all(agents, work))


def test_subgroups_run_independently(group3):
    agents = group3

    def work(r: int) -> None:
        pair = dist.new_group([0, 2])
        solo = dist.new_group([1])
        if r == 1:
            assert dist.get_rank(pair) == -1 and dist.get_world_size(pair) == -1
            with pytest.raises(CollectiveError, match="not a member"):
                dist.all_reduce(np.ones(2), group=pair)
            x = np.ones(4)
            for _ in range(50):
                dist.all_reduce(x, group=solo)  # a group of one
            assert dist.get_world_size(solo) == 1
        else:
            assert dist.get_rank(pair) == r // 2 and dist.get_world_size(pair) == 2
            x = np.full(4, float(r))
            for _ in range(10):
                dist.all_reduce(x, group=pair, op=ReduceOp.MAX)
            assert (x == 2).all()
            with pytest.raises(CollectiveError, match="rank 1 is not a member"):
                dist.broadcast(x, 1, group=pair)
        y = np.ones(3)
        dist.all_reduce(y)
        assert (y == 3).all()
        dist.destroy_process_group(pair)
        dist.destroy_process_group(solo)

    ok(on_all(agents, work))


def test_local_argument_errors(group3):
    agents = group3

    def work(r: int) -> None:
        with pytest.raises(CollectiveError, match="rank 7 is not a member"):
            dist.broadcast(np.ones(2), 7)
        with pytest.raises(ConfigError, match="NumPy or CuPy"):
            dist.all_reduce([1, 2, 3])
        with pytest.raises(ConfigError, match="dtype"):
            dist.all_reduce(np.array(["a"]))
        with pytest.raises(ConfigError, match="AVG"):
            dist.all_reduce(np.ones(2, "i4"), ReduceOp.AVG)
        with pytest.raises(ConfigError, match="read-only"):
            ro = np.ones(2)
            ro.flags.writeable = False
            dist.all_reduce(ro)
        with pytest.raises(ConfigError, match="list of 3"):
            dist.all_gather([np.ones(1)], np.ones(1))
        with pytest.raises(ConfigError, match="out_list"):
            dist.all_gather([np.ones(1)] * 3, np.ones(2))
        with pytest.raises(ConfigError, match="new_group"):
            dist.new_group([0, 0])
        with pytest.raises(ConfigError):
            dist.new_group([5])
        # Nothing was sent: the group is still fine.
        x = np.ones(2)
        dist.all_reduce(x)
        assert (x == 3).all()

    ok(on_all(agents, work))


def test_blocking_call_on_the_loop_thread_is_refused(group3):
    agents = group3
    fut = agents[0].loop.call_soon_threadsafe

    done = threading.Event()
    caught: list[BaseException] = []

    def on_loop() -> None:
        with as_current(agents[0]):
            try:
                dist.barrier()
            except WrongThreadError as e:
                caught.append(e)
        done.set()

    fut(on_loop)
    done.wait(5)
    assert caught and "blocks" in str(caught[0])


@pytest.mark.parametrize("backend", ["shm", "ring"])
def test_mismatch_fails_on_every_rank_and_breaks_only_that_group(backend):
    with local_agents(3) as agents:
        ok(on_all(agents, lambda r: attach(agents[r], backend, 20)))

        def work(r: int) -> list[str]:
            sub = dist.new_group([0, 1, 2])
            errors = []
            dtype = "f8" if r == 2 else "f4"
            try:
                dist.all_reduce(np.ones(10, dtype), group=sub)
            except CollectiveError as e:
                errors.append(str(e))
            try:
                dist.all_reduce(np.ones(2), group=sub)
            except CollectiveError as e:
                errors.append(str(e))
            x = np.ones(3)
            dist.all_reduce(x)  # the default group is unaffected
            assert (x == 3).all()
            dist.destroy_process_group(sub)
            return errors

        results = ok(on_all(agents, work))
        for errs in results:
            assert len(errs) == 2, results
            assert "unusable" in errs[1]
        # Some neighbour names the difference: dtypes, or (gRPC) the byte counts.
        assert any(("float64" in e[0] and "float32" in e[0]) or "size" in e[0] for e in results), (
            results
        )
        assert all("#0" in e[0] for e in results)
        assert settle(agents) == dict.fromkeys(GAUGES, 0)
        ok(on_all(agents, lambda r: detach(agents[r])))


@pytest.mark.parametrize("backend", ["shm", "ring"])
def test_a_rank_that_never_comes_gives_a_timeout_then_destroy_is_prompt(backend):
    with local_agents(2) as agents:
        ok(on_all(agents, lambda r: attach(agents[r], backend, 20)))

        def work(r: int) -> Any:
            sub = dist.new_group([0, 1], timeout=0.5)
            if r == 0:
                t = time.monotonic()
                with pytest.raises(RpcTimeoutError, match="timed out"):
                    dist.all_reduce(np.ones(4), group=sub)
                assert time.monotonic() - t < 3
                with pytest.raises(CollectiveError, match="unusable"):
                    dist.barrier(group=sub)
            dist.barrier()  # rank 1 never called the sub-group's all_reduce
            if r == 1:
                # Rank 0 told us the group broke (or our own timeout says so).
                w = dist.all_reduce(np.ones(4), group=sub, async_op=True)
                with pytest.raises((CollectiveError, RpcTimeoutError)):
                    w.wait(5)
            dist.destroy_process_group(sub)

        ok(on_all(agents, work))
        ok(on_all(agents, lambda r: detach(agents[r])))


def test_auto_falls_back_to_grpc_when_shared_memory_is_unusable(monkeypatch):
    import rpcdist.collectives._shm as shm

    monkeypatch.setattr(shm, "_SHM_DIR", "/nonexistent-rpcdist-test")
    with local_agents(2) as agents:
        ok(on_all(agents, lambda r: attach(agents[r], "auto", 20)))

        def work(r: int) -> str:
            x = np.full(3, r + 1.0)
            dist.all_reduce(x)
            assert (x == 3).all()
            with pytest.raises(ConfigError, match="shared memory is not usable"):
                dist.new_group([0, 1], backend="shm")
            return dist.get_backend()

        assert ok(on_all(agents, work)) == ["ring", "ring"]
        ok(on_all(agents, lambda r: detach(agents[r])))
