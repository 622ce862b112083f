"""RPC core behaviour, with several agents in one process over loopback gRPC."""

from __future__ import annotations

import asyncio
import operator
import threading
import time

import numpy as np
import pytest
import rpc_funcs as rf
from agent_support import frames_in_cycles

import rpcdist
from rpcdist import (
    ConfigError,
    NotInitializedError,
    RemoteError,
    RpcTimeoutError,
    SerializationError,
    WrongThreadError,
)
from rpcdist.futures import wait_all
from rpcdist.testing import as_current, local_agents


def test_world_size_one_calls_itself(agent1):
    (a,) = agent1
    with as_current(a):
        assert rpcdist.rpc_sync("worker0", operator.add, args=(2, 3)) == 5
        assert rpcdist.rpc_sync(0, rf.worker_name) == "worker0"
        assert rpcdist.get_worker_info() == rpcdist.WorkerInfo("worker0", 0)


def test_sync_async_and_kwargs(agents2):
    a, _ = agents2
    with as_current(a):
        assert rpcdist.rpc_sync("worker1", rf.add, args=(1, 2)) == 3
        assert rpcdist.rpc_sync("worker1", rf.kw, args=(1,), kwargs={"c": 9}) == (1, 2, 9)
        fut = rpcdist.rpc_async(1, rf.worker_name)
        assert fut.wait() == "worker1"
        info = rpcdist.get_worker_info("worker1")
        assert rpcdist.rpc_sync(info, rf.no_args) == "ok"


def test_calls_are_awaitable_from_asyncio(agents2):
    a, _ = agents2

    async def main():
        with as_current(a):
            xs = await asyncio.gather(
                *(rpcdist.rpc_async("worker1", rf.add, args=(i, i)) for i in range(10))
            )
        return xs

    assert asyncio.run(main()) == [2 * i for i in range(10)]


def test_thousand_concurrent_calls_all_correct_and_ordered(agents2):
    a, _ = agents2
    with as_current(a):
        futs = [rpcdist.rpc_async("worker1", rf.add, args=(i, 1)) for i in range(1000)]
        assert wait_all(futs) == [i + 1 for i in range(1000)]
    assert a.statistics()["pending_calls"] == 0


def test_a_call_waiting_for_the_loop_counts_as_pending(agents2):
    # A call made from a user thread while calls are in flight goes to the
    # loop; until the loop starts it, statistics() must still count it (an
    # RRef test once read "idle" there and looked for a value not made yet).
    a, _ = agents2
    held, release = threading.Event(), threading.Event()

    def hold_loop():
        held.set()
        release.wait(10)

    with as_current(a):
        slow = rpcdist.rpc_async("worker1", rf.sleep_then, args=(0.2, 1))
        a.loop.call_soon_threadsafe(hold_loop)
        assert held.wait(10)
        try:
            before = a.statistics()["pending_calls"]
            fut = rpcdist.rpc_async("worker1", rf.add, args=(1, 2))
            assert a.statistics()["pending_calls"] == before + 1
        finally:
            release.set()
        assert fut.wait() == 3 and slow.wait() == 1
    assert a.statistics()["pending_calls"] == 0


def test_callbacks_and_chained_then(agents2):
    a, _ = agents2
    with as_current(a):
        fut = rpcdist.rpc_async("worker1", rf.add, args=(1, 1))
        seen = []
        done = threading.Event()
        fut.add_done_callback(lambda f: (seen.append(f.value()), done.set()))
        chained = fut.then(lambda f: f.value() * 3).then(lambda f: f.value() + 1)
        assert chained.wait(10) == 7
        assert done.wait(10) and seen == [2]


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 300_000])
def test_arrays_of_many_sizes_in_containers(agents2, n):
    a, _ = agents2
    x = np.arange(n, dtype=np.float32)
    payload = {
        "x": x,
        "nested": [x[::2], (x.astype(np.int16), {3: x[:1]})],
        "empty": np.zeros((0, 4)),
    }
    with as_current(a):
        got = rpcdist.rpc_sync("worker1", rf.echo, args=(payload,))
    assert np.array_equal(got["x"], x) and got["x"].dtype == np.float32
    assert np.array_equal(got["nested"][0], x[::2])
    assert isinstance(got["nested"][1], tuple)
    assert np.array_equal(got["nested"][1][1][3], x[:1])
    assert got["empty"].shape == (0, 4)
    got["x"][...] = 1  # received arrays are writable


def test_large_array_beyond_grpc_default_limit(agents2):
    a, _ = agents2
    x = np.random.default_rng(1).random(3_000_000)  # 24 MB > 4 MB gRPC default
    with as_current(a):
        s, shape, dtype = rpcdist.rpc_sync("worker1", rf.array_stats, args=(x,))
    assert shape == x.shape and dtype == "float64" and s == pytest.approx(float(x.sum()))


def test_nested_calls_and_async_handlers(agents3):
    a, _, _ = agents3
    with as_current(a):
        assert rpcdist.rpc_sync("worker1", rf.nested_add, args=("worker2", 4, 5)) == 9
        assert rpcdist.rpc_sync("worker1", rf.async_add, args=(4, 5)) == 9
        assert rpcdist.rpc_sync("worker1", rf.async_nested, args=("worker2", 1, 2)) == 3
        assert rpcdist.rpc_sync("worker1", rf.async_exec_nested, args=("worker2", 1, 2)) == 30


def test_async_execution_static_and_class_methods(agents2):
    a, _ = agents2
    with as_current(a):
        futs = [rpcdist.rpc_async("worker1", rf.Batcher.submit, args=(i,)) for i in range(4)]
        assert wait_all(futs) == [6, 6, 6, 6]
        assert rpcdist.rpc_sync("worker1", rf.Batcher.cls_add, args=(2, 3)) == ("Batcher", 5)


def test_failed_calls_leave_no_reference_cycles(agents2):
    # A failure's traceback keeps the frames it passed through; none of them
    # may hold what keeps the failure (a Future), or the frames, arguments
    # and buffers wait for the garbage collector. ``@async_execution`` used
    # to leave one at the callee (the handler's frame held the Future).
    a, _ = agents2

    def fail() -> None:
        with pytest.raises(KeyError):
            rpcdist.rpc_sync("worker1", rf.raise_key_error, args=("k",))
        with pytest.raises(KeyError):
            rpcdist.rpc_async("worker1", rf.raise_key_error, args=("k",)).wait()
        with pytest.raises(TypeError):
            rpcdist.rpc_sync("worker1", rf.async_add, args=(1, "x"))
        with pytest.raises(TypeError):
            rpcdist.rpc_sync("worker1", rf.async_exec_nested, args=("worker0", 1, "x"))

    with as_current(a):
        assert frames_in_cycles(fail) == set()


def test_a_b_a_with_one_worker_thread_does_not_deadlock():
    with local_agents(2, num_worker_threads=1) as (a, _), as_current(a):
        assert (
            rpcdist.rpc_sync("worker1", rf.async_exec_back, args=("worker0", "x"), timeout=10)
            == "x"
        )
        assert rpcdist.rpc_sync("worker1", rf.async_nested, args=("worker0", 1, 1), timeout=10) == 2


def test_remote_exceptions_keep_type_and_traceback(agents2):
    a, _ = agents2
    with as_current(a):
        with pytest.raises(KeyError) as ei:
            rpcdist.rpc_sync("worker1", rf.raise_key_error, args=("boom",))
        assert "raise_key_error" in ei.value.remote_traceback
        with pytest.raises(rf.CustomError, match="custom failure"):
            rpcdist.rpc_sync("worker1", rf.raise_custom)
        with pytest.raises(RemoteError) as ei2:
            rpcdist.rpc_sync("worker1", rf.raise_unbuildable)
        assert "_Unbuildable" in ei2.value.remote_type and ei2.value.remote_traceback


def test_wrong_argument_count_is_clear(agents2):
    a, _ = agents2
    with as_current(a), pytest.raises(TypeError, match="rpc_funcs:add.*wrong arguments"):
        rpcdist.rpc_sync("worker1", rf.add, args=(1,))


def test_unsendable_function_and_arguments_fail_at_the_call_site(agents2):
    a, _ = agents2
    with as_current(a):
        with pytest.raises(SerializationError, match="lambda"):
            rpcdist.rpc_async("worker1", lambda: 1)

        def inner():
            return 1

        with pytest.raises(SerializationError, match="inner"):
            rpcdist.rpc_async("worker1", inner)
        with pytest.raises(SerializationError, match=r"args\[1\]\['opt'\]"):
            rpcdist.rpc_async("worker1", rf.echo, args=(1, {"opt": threading.Lock()}))
    assert a.statistics()["pending_calls"] == 0


def test_function_missing_on_callee_is_clear(agents2, monkeypatch):
    a, _ = agents2
    with pytest.raises(SerializationError, match="nope"):
        a.call(1, "rpc_funcs:nope", ((), {}), deadline=None).wait(10)


def test_unknown_workers_and_bad_ranks(agents2):
    a, _ = agents2
    with as_current(a):
        with pytest.raises(ConfigError, match="unknown worker name 'nobody'"):
            rpcdist.rpc_sync("nobody", rf.no_args)
        with pytest.raises(ConfigError, match="out of range"):
            rpcdist.rpc_sync(5, rf.no_args)
        with pytest.raises(ConfigError):
            rpcdist.rpc_sync(rpcdist.WorkerInfo("worker1", 0), rf.no_args)


def test_timeout_rules(agents2):
    a, _ = agents2
    rf.release.clear()  # the calls that time out hold their pool thread until the end
    with as_current(a):
        try:
            with pytest.raises(RpcTimeoutError, match="rpc_funcs:held"):
                rpcdist.rpc_sync("worker1", rf.held, timeout=0.1)
            assert rpcdist.rpc_sync("worker1", rf.sleep_then, args=(0.2, 1), timeout=None) == 1
            assert rpcdist.rpc_sync("worker1", rf.sleep_then, args=(0.2, 2), timeout=0) == 2
            old = rpcdist.get_rpc_timeout()
            slow = rpcdist.rpc_async("worker1", rf.sleep_then, args=(0.5, "slow"))
            rpcdist.set_rpc_timeout(0.1)
            try:
                with pytest.raises(RpcTimeoutError):
                    rpcdist.rpc_sync("worker1", rf.held)
                assert slow.wait() == "slow"  # made before the change: keeps its timeout
            finally:
                rpcdist.set_rpc_timeout(old)
            with pytest.raises(ConfigError):
                rpcdist.rpc_sync("worker1", rf.no_args, timeout=-1)
        finally:
            rf.release.set()


@pytest.mark.parametrize("timeout", [0.3, 1.6])
def test_a_call_sent_from_the_calling_thread_still_times_out_on_time(agents2, timeout):
    """An idle link's call goes out from the calling thread; the loop arms its
    timer at once when the deadline is near (0.3 s), else at its next sweep
    (1.6 s). Either way the call fails at its deadline, not later."""
    import time

    a, _ = agents2
    assert a.rpc_async(1, rf.no_args).wait(10) == "ok"  # the link is up and idle
    rf.release.clear()
    try:
        start = time.monotonic()
        fut = a.rpc_async(1, rf.held, timeout=timeout)
        with pytest.raises(RpcTimeoutError, match="rpc_funcs:held"):
            fut.wait(30)
        waited = time.monotonic() - start
        assert timeout - 0.01 <= waited < timeout + 0.5  # (uvloop timers: 1 ms grain)
    finally:
        rf.release.set()


@pytest.mark.parametrize("timeout", [0.3, 1.6])
def test_a_call_the_loop_sends_still_times_out(agents2, timeout):
    """With a call in flight the next goes through the loop, which arms its
    timer at once when the deadline is near (0.3 s), else at its next sweep
    (1.6 s): either way the call fails with its own timeout."""
    a, _ = agents2
    assert a.rpc_async(1, rf.no_args).wait(10) == "ok"
    rf.release.clear()
    try:
        first = a.rpc_async(1, rf.held, args=("first",), timeout=60)
        fut = a.rpc_async(1, rf.held, timeout=timeout)
        with pytest.raises(RpcTimeoutError, match="rpc_funcs:held"):
            fut.wait(30)  # (not its own timeout: "Future not complete")
    finally:
        rf.release.set()
    assert first.wait(30) == "first"


def test_deadline_travels_with_nested_calls(agents3):
    a, _, _ = agents3
    rf.nested_probe_done.clear()
    rf.nested_probe_result.clear()
    rf.nested_probe_release.clear()
    rf.release.clear()  # worker2 holds the nested call until the end
    try:
        try:
            with as_current(a), pytest.raises(RpcTimeoutError):
                rpcdist.rpc_sync("worker1", rf.nested_timeout_probe, args=("worker2",), timeout=0.3)
        finally:
            rf.nested_probe_release.set()
        # On worker1 the nested call (no timeout of its own) inherited the 0.3 s
        # budget instead of the 30 s default.
        assert rf.nested_probe_done.wait(10)
        (how, elapsed) = rf.nested_probe_result[0]
        assert how == "timeout" and elapsed < 2.0
    finally:
        rf.release.set()


def test_blocking_call_on_loop_thread_raises_wrong_thread(agents2):
    a, _ = agents2

    async def on_loop():
        with as_current(a):
            with pytest.raises(WrongThreadError):
                rpcdist.rpc_sync("worker1", rf.no_args)
            return await rpcdist.rpc_async("worker1", rf.no_args)

    assert a.run(on_loop()) == "ok"


def test_calls_after_shutdown_raise_not_initialized_and_reinit_works(tmp_path):
    init = f"file://{tmp_path}/rdv"
    rpcdist.init_rpc("solo", 0, 1, init_method=init)
    try:
        assert rpcdist.rpc_sync("solo", rf.add, args=(1, 1)) == 2
        with pytest.raises(ConfigError, match="already initialised"):
            rpcdist.init_rpc("solo", 0, 1, init_method=init)
    finally:
        rpcdist.shutdown()
    with pytest.raises(NotInitializedError):
        rpcdist.rpc_sync("solo", rf.add, args=(1, 1))
    with pytest.raises(NotInitializedError):
        rpcdist.shutdown()
    rpcdist.init_rpc("solo2", 0, 1, init_method=init)
    try:
        assert rpcdist.rpc_sync(0, rf.worker_name) == "solo2"
    finally:
        rpcdist.shutdown()


def test_invalid_names_and_options():
    with pytest.raises(ConfigError, match="invalid worker name"):
        rpcdist.init_rpc("bad name!", 0, 1, init_method="tcp://127.0.0.1:0")
    with pytest.raises(ConfigError):
        rpcdist.init_rpc("ok", 0, 1, init_method="tcp://127.0.0.1:0", num_worker_threads=0)


def test_duplicate_names_fail_init_clearly():
    with pytest.raises(ConfigError, match="'dup'.*unique"):
        with local_agents(2, names=["dup", "dup"]):
            pass


def test_graceful_shutdown_waits_for_uneven_work_and_fire_and_forget_chains():
    with local_agents(3, graceful=True) as agents:
        a = agents[0]
        with as_current(a):
            for i in range(3):
                rpcdist.rpc_async(f"worker{i}", rf.sleep_then, args=(0.05 * i,))
            rpcdist.rpc_async(
                "worker1", rf.fire_and_forget_chain, args=(6, ["worker1", "worker2"], "worker0")
            )
        before = len(rf.records())
    # local_agents shut every agent down gracefully: the chain must have ended.
    assert len(rf.records()) == before + 1
    for ag in agents:
        assert ag.closed and ag.statistics()["pending_calls"] == 0


def test_nongraceful_shutdown_fails_pending_with_closed_error():
    rf.release.clear()
    try:
        with local_agents(2) as (a, b):
            fut = a.rpc_async("worker1", rf.held, timeout=None)
            a.shutdown(graceful=False)
            with pytest.raises(rpcdist.ClosedError):
                fut.wait(5)
    finally:
        rf.release.set()  # the handler, still running on worker1's pool thread


def test_call_to_departed_peer_fails_fast_with_typed_error():
    with local_agents(2) as (a, b):
        assert a.rpc_async(1, rf.no_args).wait(10) == "ok"
        b.shutdown(graceful=False)
        with pytest.raises((rpcdist.WorkerLostError, rpcdist.ConnectError)):
            a.rpc_async(1, rf.no_args, timeout=5).wait(10)


def test_statistics_return_to_zero(agents2):
    a, b = agents2
    futs = [a.rpc_async(1, rf.sleep_then, args=(0.2,)) for _ in range(20)]

    async def stats_on_loop():  # runs after the submissions queued before it
        return a.statistics()

    assert a.run(stats_on_loop())["pending_calls"] == 20
    wait_all(futs)
    assert a.statistics()["pending_calls"] == 0
    assert b.statistics()["calls_handled"] >= 20


def test_graceful_shutdown_timeout_raises_and_still_closes():
    rf.release.clear()
    try:
        with local_agents(2) as (a, b):
            fut = a.rpc_async(1, rf.held, timeout=None)
            errors: list[BaseException] = []

            def stop(agent):
                try:
                    agent.shutdown(graceful=True, timeout=0.5)
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=stop, args=(x,)) for x in (a, b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            assert errors and all(isinstance(e, RpcTimeoutError) for e in errors)
            assert a.closed and b.closed
            # The call fails, not hangs: ClosedError when worker0 closed first,
            # WorkerLostError when it saw worker1's connection end before that.
            with pytest.raises((rpcdist.ClosedError, rpcdist.WorkerLostError)):
                fut.wait(5)
    finally:
        rf.release.set()  # the handler, still running on worker1's pool thread


def test_graceful_shutdown_waits_for_working_peers_beyond_shutdown_timeout():
    """A parameter server calls shutdown at once and keeps serving its trainer,
    which works for several times the (drain) bound before it shuts down too."""
    opts = rpcdist.RpcOptions(token=None, shutdown_timeout=0.3)
    with local_agents(2, options=opts) as (server, trainer):
        result: list[object] = []
        stopping = threading.Thread(target=lambda: result.append(server.shutdown(graceful=True)))
        stopping.start()
        done = 0
        while done < 12:  # about 1.2 s of calls, served while the server waits
            assert trainer.rpc_async(0, rf.sleep_then, args=(0.1, done)).wait(10) == done
            done += 1
        assert stopping.is_alive() and not server.closed
        assert trainer.shutdown(graceful=True) == []
        stopping.join(20)
        assert result == [[]] and server.closed


def test_graceful_shutdown_with_timeout_bounds_the_wait_for_peers():
    with local_agents(2) as (a, b):
        t0 = time.monotonic()
        with pytest.raises(RpcTimeoutError):
            a.shutdown(graceful=True, timeout=0.5)
        assert time.monotonic() - t0 < 10 and a.closed


def test_calls_from_one_thread_arrive_in_order_across_send_paths(agents2):
    """On an idle link a small call is written by the calling thread, a large
    one by the loop; a small call right behind a large one must not overtake it."""
    a, b = agents2
    big = np.zeros(100_000, dtype=np.uint8)  # over the direct-send limit
    rf.clear_arrivals()
    assert a.rpc_async(1, rf.arrive, args=(-1,)).wait(30) == -1  # the link is up
    rf.clear_arrivals()
    for i in range(0, 100, 2):
        first = a.rpc_async(1, rf.arrive, args=(i, big))
        second = a.rpc_async(1, rf.arrive, args=(i + 1,))
        assert (first.wait(30), second.wait(30)) == (i, i + 1)
    assert rf.arrivals() == list(range(100))
