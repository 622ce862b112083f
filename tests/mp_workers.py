"""Worker entry points for multi-process tests (importable by spawned children)."""

from __future__ import annotations

import threading
import time

import rpc_funcs as rf

import rpcdist


def ring_and_shutdown(rank, world_size, init_method):
    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init_method, rpc_timeout=30)
    try:
        nxt = f"w{(rank + 1) % world_size}"
        got = rpcdist.rpc_sync(nxt, rf.add, args=(rank, 100))
        pid_other = rpcdist.rpc_sync(nxt, rf.pid)
        chained = rpcdist.rpc_sync(
            nxt, rf.nested_add, args=(f"w{(rank + 2) % world_size}", rank, 1)
        )
        return got, pid_other, chained
    finally:
        rpcdist.shutdown()


def survive_dead_peer(rank, world_size, init_method):
    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init_method, rpc_timeout=30)
    if rank == 1:
        # Serve until rank 0 makes us crash.
        while True:
            time.sleep(0.1)
    start = time.monotonic()
    try:
        rpcdist.rpc_sync("w1", rf.crash, timeout=20)
        outcome = "no error"
    except (rpcdist.WorkerLostError, rpcdist.ConnectError) as e:
        outcome = type(e).__name__
    elapsed = time.monotonic() - start
    try:
        rpcdist.rpc_sync("w1", rf.no_args, timeout=5)
        after = "no error"
    except (rpcdist.WorkerLostError, rpcdist.ConnectError, rpcdist.RpcTimeoutError) as e:
        after = type(e).__name__
    rpcdist.shutdown(graceful=False)
    return outcome, elapsed, after


def init_and_shutdown_at_once(rank, world_size, init_method):
    # rank 0 serves the store: its shutdown right after init must not fail a
    # rank still finishing its own init (torch's test_local_shutdown)
    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init_method, rpc_timeout=30)
    rpcdist.shutdown(graceful=False)
    return "initialised"


def duplicate_name(rank, world_size, init_method):
    try:
        rpcdist.init_rpc("same", rank, world_size, init_method=init_method, rpc_timeout=10)
    except rpcdist.ConfigError as e:
        return str(e)
    rpcdist.shutdown(graceful=False)
    return "initialised"


def busy_poll_counters():
    s = rpcdist.statistics()
    return s["busy_polls"], s["busy_poll_hits"], s["direct_sync_calls"]


def busy_polling(rank, world_size, init_method, busy_poll_us):
    """Rank 0 makes 200 quick blocking calls to rank 1, then 5 that each take
    20 ms; it returns its busy-polling counters after the quick calls, the
    callee's, and its own before and after the slow calls (the host's load
    is left out: other tests may share its cores, and a crowded host is
    not polled)."""
    from rpcdist._rpc import _busy_poll

    _busy_poll.crowded = lambda: False
    rpcdist.init_rpc(
        f"w{rank}",
        rank,
        world_size,
        init_method=init_method,
        rpc_timeout=30,
        options=rpcdist.RpcOptions(busy_poll_us=busy_poll_us),
    )
    try:
        if rank != 0:
            return None
        quick = [rpcdist.rpc_sync("w1", rf.add, args=(i, 1)) for i in range(200)]
        assert quick == [i + 1 for i in range(200)]
        after_quick = busy_poll_counters()
        callee = rpcdist.rpc_sync("w1", busy_poll_counters)
        before_slow = busy_poll_counters()
        slow = [rpcdist.rpc_sync("w1", rf.sleep_then, args=(0.02, i)) for i in range(5)]
        assert slow == list(range(5))
        return after_quick, callee, before_slow, busy_poll_counters()
    finally:
        rpcdist.shutdown()


def thread_switches() -> dict[int, tuple[str, int, int]]:
    """``native id -> (name, voluntary, involuntary)`` context switches of
    each Python thread of this process (``/proc``)."""
    out: dict[int, tuple[str, int, int]] = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # (it ended meanwhile)
            continue
        vol, invol = (
            int(fields[k]) for k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
        )
        out[t.native_id or 0] = (t.name, vol, invol)
    return out


def _switched(before, after) -> dict[int, tuple[str, int, int]]:
    return {
        tid: (name, vol - before[tid][1], invol - before[tid][2])
        for tid, (name, vol, invol) in after.items()
        if tid in before
    }


def served_calls_wake_no_other_thread(rank, world_size, init_method, calls):
    """Rank 0 makes ``calls`` quick blocking calls to rank 1 from its main
    thread; returns how long they took, the calls that took the caller's own
    connection, the calling thread's native id and each side's context
    switches per thread meanwhile."""
    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init_method, rpc_timeout=60)
    try:
        if rank != 0:
            return None
        for i in range(100):  # (the connection and its serving thread are up)
            rpcdist.rpc_sync("w1", rf.add, args=(i, 1))
        mine, theirs = thread_switches(), rpcdist.rpc_sync("w1", thread_switches)
        direct = rpcdist.statistics()["direct_sync_calls"]
        t = time.monotonic()
        for i in range(calls):
            rpcdist.rpc_sync("w1", rf.add, args=(i, 1))
        took = time.monotonic() - t
        direct = rpcdist.statistics()["direct_sync_calls"] - direct
        mine2, theirs2 = thread_switches(), rpcdist.rpc_sync("w1", thread_switches)
        caller = threading.get_native_id()
        return took, direct, caller, _switched(mine, mine2), _switched(theirs, theirs2)
    finally:
        rpcdist.shutdown()


def busy_polling_under_nested_calls(rank, world_size, init_method):
    """Rank 0 makes 20 blocking calls to rank 1 whose handler calls back
    into rank 0, with a polling window far longer than a round trip; rank 0
    returns the results and its polls and yields."""
    rpcdist.init_rpc(
        f"w{rank}",
        rank,
        world_size,
        init_method=init_method,
        rpc_timeout=30,
        options=rpcdist.RpcOptions(busy_poll_us=500_000),
    )
    try:
        if rank != 0:
            return None
        got = [rpcdist.rpc_sync("w1", rf.nested_add, args=("w0", i, 1)) for i in range(20)]
        s = rpcdist.statistics()
        return got, s["busy_polls"], s["busy_poll_yields"]
    finally:
        rpcdist.shutdown()


def busy_polling_on_a_crowded_host(rank, world_size, init_method):
    """As if more threads were runnable than the host has cores: rank 0's
    calls to rank 1 (each 20 ms long, well within the polling window, and
    long enough that a caller descheduled on a loaded host does not find
    the reply already there) start polling and stop at once; rank 0 returns
    its counters after 20 of them."""
    from rpcdist._rpc import _busy_poll

    _busy_poll.crowded = lambda: True  # (what the polling loop reads)
    rpcdist.init_rpc(
        f"w{rank}",
        rank,
        world_size,
        init_method=init_method,
        rpc_timeout=30,
        options=rpcdist.RpcOptions(busy_poll_us=100_000),
    )
    try:
        if rank != 0:
            return None
        got = [rpcdist.rpc_sync("w1", rf.sleep_then, args=(0.02, i)) for i in range(20)]
        assert got == list(range(20))
        s = rpcdist.statistics()
        return s["busy_polls"], s["busy_poll_hits"], s["busy_poll_yields"]
    finally:
        rpcdist.shutdown()


def busy_polling_alternating(rank, world_size, init_method):
    """Rank 0 alternates 12 quick calls to rank 1 with slow ones (60 ms in
    the handler), and works 60 ms itself after each quick reply, so on the
    one connection both ends' waits alternate short and long (the polling
    window is 20 ms). Returns both ends' polls and hits (the host's load is
    left out: other tests may share its cores)."""
    from rpcdist._rpc import _busy_poll

    _busy_poll.crowded = lambda: False
    rpcdist.init_rpc(
        f"w{rank}",
        rank,
        world_size,
        init_method=init_method,
        rpc_timeout=30,
        options=rpcdist.RpcOptions(busy_poll_us=20_000),
    )
    try:
        if rank != 0:
            return None
        for i in range(12):
            assert rpcdist.rpc_sync("w1", rf.add, args=(i, 1)) == i + 1
            time.sleep(0.06)  # this worker's own part of a step
            assert rpcdist.rpc_sync("w1", rf.sleep_then, args=(0.06, i)) == i
        mine = rpcdist.statistics()
        theirs = rpcdist.rpc_sync("w1", statistics)  # (rpcdist's own is not exposed to peers)
        return [(s["busy_polls"], s["busy_poll_hits"]) for s in (mine, theirs)]
    finally:
        rpcdist.shutdown()


def statistics() -> dict[str, int]:
    """This worker's ``rpcdist.statistics()``, for a peer to ask for."""
    return rpcdist.statistics()


def _until_handlers(running: bool) -> None:
    """Wait (at most 30 s) until this worker runs a handler, or runs none."""
    end = time.monotonic() + 30
    while bool(rpcdist.statistics()["inflight_handlers"]) != running:
        assert time.monotonic() < end
        time.sleep(0.001)


def busy_polling_beside_a_handler(rank, world_size, init_method):
    """Rank 1 keeps a handler running on rank 0 while rank 0 makes 50 quick
    blocking calls to rank 1; rank 0 then ends the handler and makes 50 more.
    Rank 0 returns its counters after each batch."""
    rpcdist.init_rpc(
        f"w{rank}",
        rank,
        world_size,
        init_method=init_method,
        rpc_timeout=30,
        # (a window no reply on a loaded machine outlasts: a wait polls only
        # if the last of its kind ended within it)
        options=rpcdist.RpcOptions(busy_poll_us=50_000),
    )
    try:
        if rank == 1:
            assert rpcdist.rpc_async("w0", rf.held, args=("released",)).wait(60) == "released"
            return None
        _until_handlers(running=True)  # rank 1's call runs here
        assert [rpcdist.rpc_sync("w1", rf.add, args=(i, 1)) for i in range(50)] == [
            i + 1 for i in range(50)
        ]
        during = busy_poll_counters()
        rf.release.set()
        _until_handlers(running=False)  # its own end, after the reply
        for i in range(50):
            rpcdist.rpc_sync("w1", rf.add, args=(i, 1))
        return during, busy_poll_counters()
    finally:
        rpcdist.shutdown()


_KEPT: list = []


def keep(x):
    """Hold ``x`` (its shared-memory segment stays busy) and return its size."""
    _KEPT.append(x)
    return x.nbytes


def stray_segment():
    """Write a payload segment no one will be told of (as a sender killed mid-send leaves)."""
    from rpcdist._rpc._context import current_agent

    path, _ = current_agent().links.transport.segments.pool().write([memoryview(b"x" * 100)])
    return path


def shm_files(pid):
    import glob

    return glob.glob(f"/dev/shm/rpcdist-msg-{pid}-*")


def _teardown_threads():
    """Note the thread of every large segment taken down in this process."""
    from rpcdist._transport import _shm

    names = []

    def recording(fn):
        def call(*args):
            names.append(threading.current_thread().name)
            fn(*args)

        return call

    for name in ("_teardown", "_unmap", "_close_segments"):
        setattr(_shm, name, recording(getattr(_shm, name)))
    return names


def shm_after_killed_peer(rank, world_size, init_method):
    """Rank 0 moves large arrays both ways with rank 1, SIGKILLs it, shuts down
    and reports the /dev/shm files of both processes left after that, and
    the threads that took its large segments down."""
    import os
    import signal

    import numpy as np

    torn_down = _teardown_threads()
    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init_method, rpc_timeout=30)
    if rank == 1:
        while True:  # serve until rank 0 kills us
            time.sleep(0.1)
    x = np.arange(1 << 20, dtype=np.float64)  # 8 MB
    try:
        for _ in range(3):
            assert np.array_equal(rpcdist.rpc_sync("w1", rf.echo, args=(x,)), x)
        held = rpcdist.rpc_sync("w1", keep, args=(x,))
        stray = rpcdist.rpc_sync("w1", stray_segment)
        victim = rpcdist.rpc_sync("w1", rf.pid)
        before = {"stray": os.path.exists(stray), "held": held}
        os.kill(victim, signal.SIGKILL)
        try:
            rpcdist.rpc_sync("w1", rf.echo, args=(x,), timeout=10)
        except rpcdist.RpcdistError:
            pass
        before["answers"] = rpcdist.rpc_async("w0", rf.add, args=(1, 2)).wait(10)  # our loop
    finally:
        from rpcdist._rpc._context import current_agent

        written = current_agent().links.transport.segments.segments_written
        rpcdist.shutdown()
    return {
        **before,
        "written": written,
        "left": shm_files(os.getpid()) + shm_files(victim),
        "torn_down": torn_down,
    }


def p2p_through_shm(rank, world_size, init_method):
    """Point-to-point send/recv of a large array on the ring engine (one host)."""
    import numpy as np

    from rpcdist import collectives as dist
    from rpcdist.collectives._api import state

    dist.init_process_group("ring", init_method=init_method, rank=rank, world_size=world_size)
    try:
        segs = state().agent.links.transport.segments
        x = np.arange(1 << 20, dtype=np.float32)
        before = segs.segments_written
        if rank == 0:
            dist.send(x, 1)
            got = None
        else:
            got = np.zeros_like(x)
            dist.recv(got, 0)
        return {
            "written": segs.segments_written - before,
            "ok": got is None or bool(np.array_equal(got, x)),
        }
    finally:
        dist.destroy_process_group()
