"""``rpc_sync`` on connections the calling thread drives (``rpcdist._rpc._sync_pool``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import rpc_funcs as rf

import rpcdist
from rpcdist import ConfigError, RpcOptions, RpcTimeoutError
from rpcdist._rpc._started import Started
from rpcdist._transport._shm import shm_available
from rpcdist.testing import as_current, local_agents, run_workers

_defaults = RpcOptions().validated()
pytestmark = pytest.mark.skipif(
    _defaults.data_transport != "tcp" or _defaults.sync_channels == 0,
    reason="caller-driven connections are TCP-only (and turned off here)",
)


def _direct(agent) -> int:
    return agent.statistics()["direct_sync_calls"]


def _wait_until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.002)


def _call_held(agent, errors: list[BaseException]) -> threading.Thread:
    """A thread blocked in ``rpc_sync(worker1, held)`` until released; what it
    raises lands in ``errors``."""

    def call() -> None:
        with as_current(agent):
            try:
                rpcdist.rpc_sync("worker1", rf.held, timeout=None)
            except BaseException as e:
                errors.append(e)

    t = threading.Thread(target=call)
    t.start()
    return t


def test_rpc_sync_goes_out_on_a_connection_of_its_own(agents2):
    a, b = agents2
    with as_current(a):
        for i in range(20):
            assert rpcdist.rpc_sync("worker1", rf.add, args=(i, 1)) == i + 1
        with pytest.raises(KeyError, match="boom"):
            rpcdist.rpc_sync("worker1", rf.raise_key_error, args=("boom",))
    assert _direct(a) == 21
    assert a.sync.connections(1) == 1  # one connection, reused
    assert b.statistics()["calls_handled"] >= 21


def test_turned_off_every_call_takes_the_loop():
    with local_agents(2, options=RpcOptions(token=None, sync_channels=0)) as (a, _):
        with as_current(a):
            assert rpcdist.rpc_sync("worker1", rf.add, args=(2, 3)) == 5
        assert _direct(a) == 0


def test_large_requests_and_replies_take_the_callers_connection():
    # (With /dev/shm segments on, the default, requests of 1 MiB or more take the loop.)
    opts = RpcOptions(token=None, shm_threshold_bytes=None)
    with local_agents(2, options=opts) as (a, _), as_current(a):
        for n in (100 << 7, 9 << 17):  # 100 KiB and 9 MiB: one sendmsg, and many
            big = np.arange(n, dtype=np.float64)
            assert np.array_equal(rpcdist.rpc_sync("worker1", rf.echo, args=(big,)), big)
        assert len(rpcdist.rpc_sync("worker1", rf.echo_size, args=(3 << 20,))) == 3 << 20
    assert _direct(a) == 3
    assert a.sync.connections(1) == 1


def test_busy_workers_take_the_loop_and_shm_sized_requests_go_direct():
    opts = RpcOptions(token=None, shm_threshold_bytes=1 << 20)
    with local_agents(2, options=opts) as (a, b), as_current(a):
        slow = rpcdist.rpc_async("worker1", rf.sleep_then, args=(0.3, "slow"))
        assert rpcdist.rpc_sync("worker1", rf.add, args=(1, 1)) == 2  # behind ``slow``
        assert _direct(a) == 0
        assert slow.wait(10) == "slow"
        big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: for /dev/shm
        got = rpcdist.rpc_sync("worker1", rf.echo, args=(big,))
        assert np.array_equal(got, big)
        assert _direct(a) == 1  # a peer on this host: the calling thread sends it
        if shm_available():  # ... through a segment each way, on the thread-driven links
            assert a.links.transport.segments.segments_written == 1
            assert b.links.transport.segments.segments_written == 1
        assert np.array_equal(rpcdist.rpc_sync("worker1", rf.echo, args=(big[:1000],)), big[:1000])
        assert _direct(a) == 2


def test_concurrent_threads_share_a_bounded_set_of_connections(agents2):
    a, _ = agents2
    results: dict[int, list[int]] = {}

    def run(t: int) -> None:
        with as_current(a):
            results[t] = [
                rpcdist.rpc_sync("worker1", rf.sleep_then, args=(0.002, t * 100 + i))
                for i in range(25)
            ]

    threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {t: [t * 100 + i for i in range(25)] for t in range(8)}
    assert 1 <= a.sync.connections(1) <= 4


def test_a_timed_out_call_frees_its_connection_and_the_next_call_works(agents2):
    a, b = agents2
    rf.release.clear()
    try:
        with as_current(a):
            assert rpcdist.rpc_sync("worker1", rf.no_args) == "ok"
            start = time.monotonic()
            with pytest.raises(RpcTimeoutError, match="rpc_funcs:held"):
                rpcdist.rpc_sync("worker1", rf.held, args=("late",), timeout=0.3)
            waited = time.monotonic() - start
            assert 0.29 <= waited < 0.8
            assert a.sync.connections(1) == 0  # handed to the loop
            assert rpcdist.rpc_sync("worker1", rf.add, args=(1, 2)) == 3  # a fresh one
            assert a.sync.connections(1) == 1
    finally:
        rf.release.set()
    # The late handler finishes; its reply is dropped or read and discarded.
    _wait_until(lambda: b.statistics()["inflight_handlers"] == 0)


def test_a_dead_idle_connection_is_replaced(agents2):
    a, b = agents2
    with as_current(a):
        assert rpcdist.rpc_sync("worker1", rf.no_args) == "ok"

        served = list(b.sync_serving._served)  # the callee's end, served by a thread
        assert len(served) == 1
        served[0].interrupt()  # as if the callee had closed it
        (idle,) = a.sync._free[1]
        _wait_until(lambda: not idle.link.idle_ok())  # the EOF has reached it
        assert rpcdist.rpc_sync("worker1", rf.add, args=(4, 5)) == 9
    assert a.sync.connections(1) == 1


def test_nongraceful_shutdown_wakes_a_thread_blocked_in_rpc_sync():
    rf.release.clear()
    errors: list[BaseException] = []
    try:
        with local_agents(2) as (a, _):
            t = _call_held(a, errors)
            _wait_until(lambda: a.statistics()["pending_calls"] == 1)
            assert _direct(a) == 1
            a.shutdown(graceful=False)
            t.join(10)
            assert not t.is_alive()
    finally:
        rf.release.set()
    assert len(errors) == 1 and isinstance(errors[0], rpcdist.ClosedError), errors


def test_graceful_shutdown_waits_for_a_blocking_call_in_flight():
    rf.release.clear()
    got: list[object] = []
    with local_agents(2, graceful=True) as (a, b):

        def call() -> None:
            with as_current(a):
                got.append(rpcdist.rpc_sync("worker1", rf.held, args=("done",), timeout=None))

        t = threading.Thread(target=call)
        t.start()
        _wait_until(lambda: b.statistics()["inflight_handlers"] == 1)

        def release_once_shutting_down() -> None:
            _wait_until(lambda: a.activity.quiescing)
            rf.release.set()

        releaser = threading.Thread(target=release_once_shutting_down)
        releaser.start()
        # local_agents shuts both down gracefully: it must wait for the call.
    t.join(10)
    releaser.join(10)
    assert got == ["done"]


@pytest.mark.parametrize(
    ("name", "bad"),
    [("sync_channels", b) for b in (-1, "many", 1.5, True)]
    + [("busy_poll_us", b) for b in (-1, "soon", True, float("nan"), 2e6)],
)
def test_a_bad_option_is_a_clear_error(name, bad):
    with pytest.raises(ConfigError, match=name):
        RpcOptions(**{name: bad}).validated()


@pytest.mark.parametrize(
    ("name", "var", "default", "value", "parsed"),
    [
        ("sync_channels", "RPCDIST_SYNC_CHANNELS", 4, "2", 2),
        ("busy_poll_us", "RPCDIST_BUSY_POLL_US", 1000.0, "50", 50.0),
    ],
)
def test_environment_sets_the_default(monkeypatch, name, var, default, value, parsed):
    monkeypatch.delenv(var, raising=False)
    assert getattr(RpcOptions().validated(), name) == default
    monkeypatch.setenv(var, value)
    assert getattr(RpcOptions().validated(), name) == parsed
    monkeypatch.setenv(var, "lots")
    with pytest.raises(ConfigError, match=var):
        RpcOptions().validated()


def test_the_callee_runs_a_plain_handler_on_the_connection_s_own_thread(agents2):
    a, b = agents2
    with as_current(a):
        assert rpcdist.rpc_sync("worker1", rf.thread_name).startswith("rpcdist-sync-worker1")
        assert rpcdist.rpc_sync("worker1", rf.async_add, args=(2, 3)) == 5  # on b's loop
        assert (
            rpcdist.rpc_async("worker1", rf.thread_name)
            .wait(10)
            .startswith(
                "rpcdist-worker-worker1"  # the loop's path: a pool thread
            )
        )
    assert len(b.sync_serving._served) == 1


def test_handlers_on_served_connections_count_against_num_worker_threads():
    """Three threads call a one-thread callee at once: the handlers run one at a
    time, whether on a served connection's thread or in the pool."""
    with local_agents(2, num_worker_threads=1) as (a, b):
        rf.probe_peak(reset=True)

        def run() -> None:
            with as_current(a):
                for _ in range(5):
                    assert rpcdist.rpc_sync("worker1", rf.concurrency_probe, args=(0.01,))

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert rf.probe_peak() == 1
        assert b.statistics()["calls_handled"] == 15


def test_a_callee_shut_down_mid_call_fails_the_blocking_call():
    rf.release.clear()
    try:
        with local_agents(2) as (a, b):
            errors: list[BaseException] = []
            t = _call_held(a, errors)
            _wait_until(lambda: b.statistics()["inflight_handlers"] == 1)
            threading.Thread(target=b.shutdown, kwargs={"graceful": False}).start()
            t.join(20)
            assert not t.is_alive()
            assert len(errors) == 1 and isinstance(errors[0], rpcdist.WorkerLostError), errors
    finally:
        rf.release.set()


def test_a_control_message_in_flight_keeps_no_call_off_its_own_connection(agents2):
    """Idempotent control messages (RRef protocol, autograd releases) are not
    ordered with user calls: while one waits for its acknowledgement, rpc_sync
    still takes a connection of its own (an autograd iteration's release used
    to push the next iteration's calls through the loop)."""
    import asyncio

    a, b = agents2
    gate = threading.Event()

    async def held_ack(agent, src, payload):
        while not gate.is_set():
            await asyncio.sleep(0.005)
        return payload

    b.registry.add_handler("test.held_ack", held_ack)
    acked = a.submit(a.send_control(1, "test.held_ack", "ok"))
    try:
        _wait_until(lambda: a.statistics()["pending_calls"] == 1)
        assert not a.calls.busy()
        with as_current(a):
            assert rpcdist.rpc_sync("worker1", rf.add, args=(2, 3)) == 5
        assert _direct(a) == 1
    finally:
        gate.set()
    assert acked.wait(10) == "ok"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_quick_replies_and_calls_are_read_by_threads_that_polled_for_them():
    """Between two processes, the caller waiting for a quick reply and the
    callee's thread waiting for the next call poll before they sleep, and
    what they wait for comes while they poll; a caller whose replies take
    longer than the window stops polling after the first."""
    import mp_workers

    after_quick, callee, before_slow, after_slow = run_workers(
        mp_workers.busy_polling, 2, args=(200,), timeout=90
    )[0]
    polls, hits, direct = after_quick
    assert direct == 200
    assert 0 < hits <= polls <= 200
    assert 0 < callee[1] <= callee[0]
    assert after_slow[2] - before_slow[2] == 5  # the slow calls took the same path
    assert after_slow[0] - before_slow[0] <= 1  # polled (at most) for the first
    assert after_slow[1] == before_slow[1]  # and nothing came while it did


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_short_wait_polls_after_a_long_one_of_another_kind():
    """A step's quick and slow calls alternate on one connection: each wait
    polls if the last wait of its kind (a reply to that call, the next call
    after serving that one) was short, so the quick replies and the calls
    that follow a slow one are read by threads that polled for them."""
    import mp_workers

    (polls, hits), (callee_polls, callee_hits) = run_workers(
        mp_workers.busy_polling_alternating, 2, timeout=90
    )[0]
    # (1 and 1 when a wait polls only after a short wait of any kind)
    assert hits >= 4 and callee_hits >= 4
    assert hits <= polls <= 12 + 1  # the quick replies, and the first slow one
    assert callee_hits <= callee_polls


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_busy_poll_off_no_thread_polls():
    import mp_workers

    after_quick, callee, _, after_slow = run_workers(
        mp_workers.busy_polling, 2, args=(0,), timeout=90
    )[0]
    assert after_quick == (0, 0, 200)
    assert callee[:2] == (0, 0)
    assert after_slow[:2] == (0, 0)


def test_agents_sharing_a_process_never_poll(agents2):
    """An in-process peer needs the GIL to answer, which a polling thread holds."""
    a, b = agents2
    assert a.options.busy_poll_us > 0
    with as_current(a):
        for i in range(50):
            assert rpcdist.rpc_sync("worker1", rf.add, args=(i, 1)) == i + 1
    assert _direct(a) == 50
    for agent in (a, b):
        s = agent.statistics()
        assert (s["busy_polls"], s["busy_poll_hits"]) == (0, 0)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_worker_running_a_handler_does_not_poll():
    """A polling thread would keep the running handler from the GIL."""
    import mp_workers

    during, after = run_workers(mp_workers.busy_polling_beside_a_handler, 2, timeout=90)[0]
    assert during == (0, 0, 50)  # all 50 on the caller's own connection, none polled
    assert after[2] == 100
    # With the handler gone the same calls poll again (whether a poll also
    # hits depends on the host: a crowded one makes it yield).
    assert after[0] > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_polling_thread_sleeps_when_another_thread_of_its_worker_gets_a_call():
    """A nested call back into the caller's process must not wait for the
    polling thread's window (it would hold the GIL for it): the caller stops
    polling as soon as the nested call's bytes arrive."""
    import mp_workers

    got, polls, yields = run_workers(mp_workers.busy_polling_under_nested_calls, 2, timeout=90)[0]
    assert got == [i + 1 for i in range(20)]
    assert polls >= 1
    assert yields >= 1  # (0 when the polling loop ignores the other threads)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_polling_thread_gives_its_core_back_when_the_host_is_crowded():
    import mp_workers

    polls, hits, yields = run_workers(mp_workers.busy_polling_on_a_crowded_host, 2, timeout=90)[0]
    assert polls > 0
    assert (hits, yields) == (0, polls)  # (hits == polls when the loop ignores the host)


class _Link:
    """What a poller uses of a link: bytes wait after ``ready`` looks."""

    _fd = -1

    def __init__(self, ready: int) -> None:
        self.looks = 0
        self.ready = ready

    def readable(self) -> bool:
        self.looks += 1
        return self.looks > self.ready

    def read_blocking(self, until) -> bool:
        return True


@pytest.mark.parametrize(
    ("host", "looks"),
    [
        ("quiet", [4, 4, 4]),
        # Seen crowded once (a thread that ran for a moment): that wait polls.
        ("crowded at the first look", [4, 4, 4]),
        ("crowded", [4, 0, 0]),
    ],
)
def test_a_wait_that_begins_on_a_crowded_host_sleeps_at_once(monkeypatch, host, looks):
    """A thread that polls where every core is wanted is preempted by the
    peer it just woke and then queues for the reply behind the host's other
    work: on a host still crowded when a wait begins, the wait does not look
    at its socket even once before it sleeps."""
    from rpcdist._rpc import _busy_poll

    seen = {"quiet": [], "crowded at the first look": [True]}.get(host)
    monkeypatch.setattr(_busy_poll, "crowded", lambda: seen.pop(0) if seen else seen is None)
    loop = asyncio.new_event_loop()
    try:
        poller = _busy_poll.BusyPoll(1.0, _Inflight(), loop, _busy_poll.ProcessGil())
        got = []
        for _ in looks:
            link = _Link(ready=3)
            assert poller.wait(link, None, time.monotonic() + 1.0)
            got.append(link.looks)
        poller.stop_watching()
    finally:
        loop.close()
    assert got == looks
    assert poller.polls == len(looks)
    assert poller.hits == sum(1 for n in looks if n)


class _Inflight:
    inflight = 0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_served_call_wakes_only_the_caller_and_the_serving_thread():
    """A quick blocking call costs one wake-up on each side, and no more:
    the callee's loop, its handler pool and the caller's loop sleep through
    it (a thread woken per call would wake ``calls`` times), and neither
    the caller nor the serving thread waits twice in a call (for a lock, the
    GIL, another thread). Other threads still wake on their timers
    (heartbeats), hence the allowance per second; loaded hosts add
    involuntary switches, which are not counted."""
    import mp_workers

    calls = 1500
    took, direct, caller, mine, theirs = run_workers(
        mp_workers.served_calls_wake_no_other_thread, 2, args=(calls,), timeout=100
    )[0]
    assert direct == calls
    (server,) = [tid for tid, (name, _, _) in theirs.items() if name.startswith("rpcdist-sync-")]
    others = {
        f"{side}:{name}": vol + invol
        for side, switches, busy in (("caller", mine, caller), ("callee", theirs, server))
        for tid, (name, vol, invol) in switches.items()
        if tid != busy
    }
    allowance = 25 + 40 * took
    assert sum(others.values()) <= allowance, others
    assert mine[caller][1] <= 1.5 * calls + allowance
    assert theirs[server][1] <= 1.5 * calls + allowance


@pytest.mark.parametrize(
    ("loadavg", "cores", "crowded", "spare"),
    [
        (b"0.50 0.40 0.30 3/120 4567\n", 2, True, False),
        (b"0.50 0.40 0.30 2/120 4567\n", 2, False, False),
        (b"0.50 0.40 0.30 1/120 4567\n", 2, False, True),
        (b"1.00 1.00 1.00 1/99 1\n", 1, False, False),
        (b"garbled\n", 2, False, False),
    ],
)
def test_the_host_is_crowded_when_runnable_threads_outnumber_its_cores(
    monkeypatch, tmp_path, loadavg, cores, crowded, spare
):
    from rpcdist import _cores

    path = tmp_path / "loadavg"
    path.write_bytes(loadavg)
    fd = os.open(path, os.O_RDONLY)
    try:
        monkeypatch.setattr(_cores, "_FD", fd)
        monkeypatch.setattr(_cores, "_CORES", cores)
        assert _cores.crowded() is crowded
        assert _cores.spare_core() is spare
    finally:
        os.close(fd)


def test_an_unreadable_load_never_counts_as_crowded(monkeypatch):
    from rpcdist import _cores

    monkeypatch.setattr(_cores, "_FD", -1)
    assert _cores.crowded() is False
    assert _cores.spare_core() is False


@pytest.mark.parametrize(
    ("affinity", "cpu_max", "v1", "cpus"),
    [
        (8, "max 100000\n", None, 8),  # v2, no quota
        (8, "200000 100000\n", None, 2),  # v2: 2 CPUs
        (8, "150000 100000\n", None, 2),  # 1.5 CPUs: 2 threads run
        (8, "50000 100000\n", None, 1),  # never below one
        (1, "400000 100000\n", None, 1),  # affinity is the fewer
        (4, None, ("200000\n", "100000\n"), 2),  # v1
        (4, None, ("-1\n", "100000\n"), 4),  # v1, no quota
        (4, "garbled", None, 4),
        (4, None, None, 4),  # no cgroup files
        (0, None, None, 1),
    ],
)
def test_the_cpu_allowance_is_the_fewest_of_affinity_and_cgroup_quota(affinity, cpu_max, v1, cpus):
    from rpcdist import _cores

    assert _cores.allowance(affinity, cpu_max, *(v1 or (None, None))) == cpus


def test_a_process_pinned_to_one_cpu_has_an_allowance_of_one():
    """Read as the process runs it: a child pinned to CPU 0 before rpcdist
    computes its allowance (the host's count would be os.cpu_count())."""
    code = (
        "import os; os.sched_setaffinity(0, {0})\n"
        "from rpcdist._cores import cpu_allowance\n"
        "print(cpu_allowance(), cpu_allowance())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["1", "1"]


def test_a_started_call_leaves_at_once_and_is_read_later(agents2):
    """``Agent.start_blocking``: the call is in flight on a thread-driven
    connection when it returns, and its reply is read by ``wait()`` once."""
    a, _ = agents2
    with as_current(a):
        call = a.start_blocking("worker1", a.function_name(rf.add), ((2, 3), {}), deadline=None)
        assert isinstance(call, Started)
        assert a.statistics()["pending_calls"] == 1
        assert call.wait() == 5
        assert a.statistics()["pending_calls"] == 0
        with pytest.raises(RuntimeError, match="already waited for"):
            call.wait()
    assert _direct(a) == 1


def test_a_started_call_raises_the_remote_error_at_wait(agents2):
    a, _ = agents2
    with as_current(a):
        call = a.start_blocking(
            "worker1",
            a.function_name(rf.raise_key_error),
            (("boom",), {}),
            deadline=time.monotonic() + 10,
        )
        with pytest.raises(KeyError, match="boom"):
            call.wait()
        assert a.statistics()["pending_calls"] == 0
        assert rpcdist.rpc_sync("worker1", rf.add, args=(1, 1)) == 2


def test_an_abandoned_call_frees_its_connection_and_its_late_reply_is_dropped(agents2):
    """A caller that gives up a started call (an error came first) counts
    it out at once; the loop takes its connection and reads the reply."""
    a, b = agents2
    rf.release.clear()
    try:
        with as_current(a):
            call = a.start_blocking(
                "worker1", a.function_name(rf.held), (("late",), {}), deadline=None
            )
            _wait_until(lambda: b.statistics()["inflight_handlers"] == 1)
            held = a.sync.connections(1)
            call.abandon()
            call.abandon()  # once only
            assert a.statistics()["pending_calls"] == 0
            assert a.sync.connections(1) == held - 1
            with pytest.raises(RuntimeError, match="abandoned"):
                call.wait()
            rf.release.set()
            _wait_until(lambda: b.statistics()["inflight_handlers"] == 0)
            assert rpcdist.rpc_sync("worker1", rf.add, args=(1, 2)) == 3
    finally:
        rf.release.set()
    assert _direct(a) == 2


def test_shutdown_closes_the_set_polling_threads_watch():
    with local_agents(2) as (a, _):
        watched = a.busy_poll.others
        assert watched is not None and not watched.closed
    assert watched.closed


def test_agents_count_in_their_process_until_they_close():
    """Polling is off while a process holds more than one agent: each agent
    counts once, and no longer once it has shut down (else polling would
    stay off for good)."""
    from rpcdist._rpc._busy_poll import PROCESS

    before = PROCESS.agents
    with local_agents(2) as (a, b):
        assert a.busy_poll is not b.busy_poll
        assert PROCESS.agents == before + 2
    assert PROCESS.agents == before
    with local_agents(1):
        assert PROCESS.agents == before + 1
    assert PROCESS.agents == before
