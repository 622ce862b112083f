"""Handlers that block on nested calls cannot deadlock the handler pool.

A plain handler that calls ``rpc_sync`` (or waits on a Future) holds a pool
thread while it waits. With calls bouncing back and forth between two
workers, every thread can end up waiting for a call queued behind them.
The pool therefore lets another thread take queued work while one is
blocked (up to 4x ``num_worker_threads``), saying so in a warning; past
that it is exhausted, and a warning names the blocked handlers and the
calls they wait on, at once, and the calls' timeout errors say what to do.
"""

from __future__ import annotations

import threading
import time

import harness
import pool_funcs as pf
import pytest

import rpcdist
from rpcdist._pool import WorkerPool, blocking
from rpcdist.testing import as_current, local_agents


def _wait_for(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.005)


def _blocked_job(release: threading.Event, done: list[str], name: str) -> None:
    pool = blocking(f"the event of {name}")
    try:
        assert release.wait(30)
    finally:
        if pool is not None:
            pool.unblocked()
    done.append(name)


def test_a_blocked_thread_lets_the_pool_start_another_for_queued_work(caplog):
    pool = WorkerPool(1, "t-grow")
    release = threading.Event()
    done: list[str] = []
    try:
        pool.post(_blocked_job, release, done, "a")
        # Queued behind a thread that waits for it: runs only on a new thread.
        pool.post(release.set)
        pool.post(done.append, "b")
        _wait_for(lambda: done == ["a", "b"] or done == ["b", "a"])
        grew = [r.getMessage() for r in caplog.records if "grew to 2 threads" in r.getMessage()]
        assert grew and "the event of a" in grew[0] and "num_worker_threads=1" in grew[0]
        # The thread it grew by leaves once it is not needed.
        _wait_for(lambda: pool.debug_info()["threads"] == 1)
        assert pool.debug_info()["blocked"] == []
    finally:
        release.set()
        pool.shutdown()


def test_an_exhausted_pool_warns_at_once_naming_what_blocks(caplog):
    pool = WorkerPool(1, "t-full", max_grown=2)
    release = threading.Event()
    done: list[str] = []
    try:
        pool.post(_blocked_job, release, done, "a")
        pool.post(_blocked_job, release, done, "b")
        pool.post(done.append, "c")  # no thread left for it
        _wait_for(lambda: "exhausted" in pool.debug_info())
        text = pool.debug_info()["exhausted"]
        assert "handler pool exhausted" in text and "num_worker_threads" in text
        assert "the event of a" in text and "the event of b" in text
        assert any("handler pool exhausted" in r.getMessage() for r in caplog.records)
        assert done == []
        release.set()
        _wait_for(lambda: sorted(done) == ["a", "b", "c"])
        assert "exhausted" not in pool.debug_info()  # the queue drained
    finally:
        release.set()
        pool.shutdown()


@pytest.mark.parametrize("fn", [pf.bounce, pf.bounce_async], ids=["rpc_sync", "future_wait"])
def test_nested_blocking_calls_back_and_forth_complete_on_pools_of_two(fn, caplog):
    """Three chains of four nested calls between two workers with 2 handler
    threads each (six blocked handlers on each at once): without managed
    blocking every thread waits on a call queued behind it, and the chains
    end only at their deadline."""
    with local_agents(2, num_worker_threads=2, rpc_timeout=60) as (a, b):
        with as_current(a):
            futs = [
                rpcdist.rpc_async("worker1", fn, args=(4, "worker1", "worker0")) for _ in range(3)
            ]
            assert [f.wait(60) for f in futs] == [4] * 3
        for agent in (a, b):
            _wait_for(lambda agent=agent: agent.executor.debug_info()["threads"] <= 2)
    grew = [r.getMessage() for r in caplog.records if "grew to" in r.getMessage()]
    assert grew, "the pools never grew: the chains did not need them to?"
    assert f"'pool_funcs:{fn.__qualname__}' (thread" in grew[0]
    # (A Future's call is named once it is sent: maybe not yet in the first.)
    assert any(f"waits on 'pool_funcs:{fn.__qualname__}' on 'worker0'" in m for m in grew), grew


def test_past_its_growth_the_pool_warns_before_the_deadline_and_errors_say_why(caplog):
    """Twelve chains of eight: more blocked handlers than 4 x 2 threads. The
    warning comes while every call still waits; the chains then fail at
    their deadline with errors that say the pool was exhausted and what to do."""
    with local_agents(2, num_worker_threads=2, rpc_timeout=8) as (a, b):
        with as_current(a):
            futs = [
                rpcdist.rpc_async(
                    "worker1", pf.bounce, args=(8, "worker1", "worker0"), timeout=None
                )
                for _ in range(12)
            ]

        def warned() -> list[str]:
            messages = [r.getMessage() for r in caplog.records]
            return [m for m in messages if "handler pool exhausted" in m]

        _wait_for(lambda: warned(), timeout=7)
        assert not any(f.done() for f in futs)  # warned before any call's deadline
        text = warned()[0]
        assert "'pool_funcs:bounce' (thread" in text
        assert "waits on 'pool_funcs:bounce' on 'worker0'" in text
        errors = []
        for f in futs:
            with pytest.raises(rpcdist.RpcTimeoutError) as e:
                f.wait(60)
            errors.append(str(e.value))
        # A chain's error is that of the call that timed out first in it, and
        # says so when that call was made by a worker whose pool is exhausted
        # (the other worker's may still have had a thread to spare).
        said = [m for m in errors if "handler pool exhausted" in m and "num_worker_threads" in m]
        assert said, errors


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_processes_with_pools_of_two_bounce_nested_calls_to_the_end():
    """As a user runs it: ranks from the environment, a pool of 2 each,
    three chains of four nested blocking calls."""
    res = harness.run_job(pf.chains_job, 2, (3, 4, 30.0), timeout=90)
    assert not res.errors and not res.hung, (res.errors, res.hung)
    assert res.values[0]["results"] == [4] * 3
    warnings = res.values[0]["warnings"] + res.values[0]["peer_warnings"]
    assert any("grew to" in w for w in warnings), warnings
    assert not any("exhausted" in w for w in warnings), warnings
