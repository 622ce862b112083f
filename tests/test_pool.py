"""The handler thread pool: bounded, ordered, cancels at shutdown, keeps nothing alive."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest

from rpcdist._pool import WorkerPool


def _wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.001)


def test_post_and_submit_run_on_pool_threads_with_results_and_errors():
    pool = WorkerPool(2, "t-pool")
    try:
        seen = []
        done = threading.Event()
        pool.post(lambda x: (seen.append((x, threading.current_thread().name)), done.set()), 5)
        assert done.wait(10)
        assert seen[0][0] == 5 and seen[0][1].startswith("t-pool_")
        assert pool.submit(pow, 2, 10).result(10) == 1024
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(10)
    finally:
        pool.shutdown()


def test_runs_at_most_max_workers_at_once_and_queues_the_rest_in_order():
    pool = WorkerPool(3, "t-bound")
    gate = threading.Event()
    full = threading.Event()
    lock = threading.Lock()
    running, peak, order = [0], [0], []

    def job(i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            if running[0] == 3:
                full.set()
        gate.wait(10)
        with lock:
            running[0] -= 1
            order.append(i)

    futs = [pool.submit(job, i) for i in range(10)]
    assert full.wait(10)  # three run at once; the other seven wait
    assert sum(f.running() for f in futs) == 3
    gate.set()
    for f in futs:
        f.result(10)
    pool.shutdown()
    assert peak[0] == 3
    assert len(pool._threads) == 3
    assert sorted(order) == list(range(10))


def test_shutdown_joins_threads_and_cancels_work_not_started():
    pool = WorkerPool(1, "t-stop")
    gate = threading.Event()
    started = threading.Event()

    def block():
        started.set()
        gate.wait(10)
        return "first"

    first = pool.submit(block)
    assert started.wait(10)
    queued = pool.submit(lambda: "never")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()  # dropped while the only thread was busy
    gate.set()
    assert first.result(10) == "first"  # work already started finishes
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in pool._threads)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.post(print)


def test_an_idle_thread_keeps_no_reference_to_its_last_task():
    """A result or argument must not outlive its call in an idle thread's
    locals: RRefs in it would never be released (a bug this caught)."""

    class Payload:
        pass

    refs: list[weakref.ref[Payload]] = []

    def job(a: Payload) -> Payload:
        out = Payload()
        refs.append(weakref.ref(out))
        return out

    pool = WorkerPool(1, "t-refs")
    try:
        arg = Payload()
        refs.append(weakref.ref(arg))
        assert isinstance(pool.submit(job, arg).result(10), Payload)
        pool.post(job, arg)
        pool.submit(int).result(10)  # the thread went round its loop since
        del arg
        gc.collect()
        assert len(refs) == 3 and [r() for r in refs] == [None, None, None]
    finally:
        pool.shutdown()


def test_usable_as_the_executor_of_run_in_executor():
    pool = WorkerPool(2, "t-aio")

    async def main():
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(pool, pow, i, 2) for i in range(8)))

    try:
        assert asyncio.run(main()) == [i * i for i in range(8)]
    finally:
        pool.shutdown()


def test_a_borrowed_slot_counts_against_the_bound_and_is_handed_back():
    pool = WorkerPool(2, "t-borrow")
    try:
        assert pool.try_borrow() and pool.try_borrow()
        assert not pool.try_borrow()  # both slots are out
        ran = threading.Event()
        pool.post(ran.set)
        # Work posted meanwhile waits for a slot, even with a thread free.
        assert not ran.wait(0.2)
        pool.give_back()
        assert ran.wait(10)  # the slot went to the waiting work...
        _wait_for(lambda: pool._active == 1)  # ...which then let it go
        assert pool.try_borrow()  # so it can be borrowed again
        pool.give_back()
        pool.give_back()
        assert pool._active == 0
    finally:
        pool.shutdown()


def test_no_slot_is_borrowed_ahead_of_queued_work():
    pool = WorkerPool(1, "t-queue")
    gate = threading.Event()
    started = threading.Event()
    try:
        first = pool.submit(lambda: (started.set(), gate.wait(10)))
        assert started.wait(10)
        second = pool.submit(lambda: "second")
        assert not pool.try_borrow()  # busy, and work is queued
        gate.set()
        assert first.result(10) and second.result(10) == "second"
        assert pool.try_borrow()
        pool.give_back()
    finally:
        pool.shutdown()
