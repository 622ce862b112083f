"""Large payloads between workers on one host travel through reused /dev/shm segments."""

from __future__ import annotations

import gc
import glob
import os
import stat
import time

import mp_workers as mw
import numpy as np
import pytest
import rpc_funcs as rf

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist._transport._shm import (
    BUSY,
    FREE,
    RETIRED,
    SHM_DIR,
    SegmentReader,
    SegmentWriter,
    shm_available,
)
from rpcdist.tensor import Tensor
from rpcdist.testing import as_current, local_agents, run_workers

pytestmark = pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm")


def _ours() -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"rpcdist-msg-{os.getpid()}-*"))


@pytest.mark.parametrize(
    "opts",
    [
        rpcdist.RpcOptions(token=None, transport="grpc"),  # on by default
        rpcdist.RpcOptions(token=None, transport="tcp"),
        rpcdist.RpcOptions(token=None, transport="tcp", shm_threshold_bytes=1 << 20),
    ],
    ids=["grpc-auto", "tcp-auto", "tcp-explicit"],
)
def test_large_arrays_use_shared_memory_and_leave_nothing_behind(opts):
    x = np.random.default_rng(0).random(1_000_000)  # 8 MB
    with local_agents(2, options=opts) as (a, b):
        got = a.rpc_async(1, rf.echo, args=({"x": x, "small": np.arange(3)},)).wait(30)
        assert np.array_equal(got["x"], x) and np.array_equal(got["small"], np.arange(3))
        got["x"][0] = -1.0  # writable, and private to us
        assert x[0] != -1.0
        # one file for the call, one for the reply
        assert (
            a.links.transport.segments.segments_written == 1
            and b.links.transport.segments.segments_written == 1
        )
        small = a.rpc_async(1, rf.echo, args=(np.arange(10),)).wait(30)
        assert a.links.transport.segments.segments_written == 1 and np.array_equal(
            small, np.arange(10)
        )
        assert _ours() == []


def _written(agent):
    return agent.links.transport.segments.segments_written


def test_segments_are_reused_across_calls_and_held_arrays_stay_intact():
    x = np.random.default_rng(1).random(1_000_000)  # 8 MB
    with local_agents(2, options=rpcdist.RpcOptions(token=None)) as (a, b):
        kept = []
        for i in range(20):
            got = a.rpc_async(1, rf.echo, args=(x + i,)).wait(30)
            if i % 5 == 0:
                kept.append((i, got))  # its segment stays busy while we hold it
            del got
        assert _written(a) == 20 and _written(b) == 20
        # a few segments per link, not one per message
        made = a.links.transport.segments.segments_made
        assert 1 <= made <= 2 and b.links.transport.segments.segments_made <= 1 + len(kept)
        for i, arr in kept:
            assert np.array_equal(arr, x + i)
        assert _ours() == []


def test_rref_values_and_autograd_gradients_take_the_segments():
    x0 = np.random.default_rng(2).standard_normal(300_000)  # 2.4 MB
    with local_agents(2, options=rpcdist.RpcOptions(token=None)) as (a, b):
        with as_current(a):
            rref = rpcdist.remote("worker1", rf.echo, args=(x0,))
            before = _written(b)
            assert np.array_equal(rref.to_here(), x0)
            assert _written(b) == before + 1  # the value came back through a segment
            x = Tensor(x0.copy(), requires_grad=True)
            with dist_autograd.context() as cid:
                y = rpcdist.rpc_sync("worker1", rf.echo, args=(x,))
                sent = _written(a), _written(b)
                dist_autograd.backward(cid, [(y * y).sum()])
                gx = dist_autograd.get_gradients(cid)[x]
            # the gradient went to worker1 and its gradient came back, both large
            assert _written(a) > sent[0] and _written(b) > sent[1]
            np.testing.assert_allclose(gx, 2 * x0)
        assert _ours() == []


@pytest.mark.timeout(120)
def test_point_to_point_on_the_ring_takes_the_segments():
    r0, r1 = run_workers(mw.p2p_through_shm, 2, timeout=100)
    assert r0 == {"written": 1, "ok": True} and r1["ok"]


@pytest.mark.timeout(120)
def test_nothing_is_left_in_dev_shm_after_a_peer_is_killed():
    res = run_workers(mw.shm_after_killed_peer, 2, timeout=100, allow_exit={1})
    r0 = res[0]
    assert r0["stray"] and r0["held"] == 8 << 20 and r0["written"] >= 4
    assert r0["left"] == []
    # Its loop answered after the loss; no loop took a large segment down.
    assert r0["answers"] == 3
    assert r0["torn_down"] and not [t for t in r0["torn_down"] if "loop" in t], r0["torn_down"]


@pytest.mark.parametrize(
    "opts",
    [
        rpcdist.RpcOptions(token=None, transport="grpc", shm_threshold_bytes=None),
        rpcdist.RpcOptions(token=None, transport="tcp", shm_threshold_bytes=None),
    ],
    ids=["grpc-off", "tcp-off"],
)
def test_shared_memory_can_be_turned_off(opts):
    x = np.ones(500_000)
    with local_agents(2, options=opts) as (a, _):
        assert a.links.transport.segments is None
        assert np.array_equal(a.rpc_async(1, rf.echo, args=(x,)).wait(30), x)
        assert _ours() == []


def test_a_segment_is_reused_once_the_receivers_arrays_are_gone():
    w = SegmentWriter()
    pool, reader = w.pool(), SegmentReader()
    path, seg = pool.write([memoryview(b"abc"), memoryview(b"defg")])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.stat(path).st_uid == os.getuid()
    views = reader.buffers(path, [3, 4])
    assert [bytes(v) for v in views] == [b"abc", b"defg"]
    assert not os.path.exists(path)  # unlinked once mapped
    held = np.frombuffer(views[1], np.uint8)  # an array decoded from the payload
    del views
    gc.collect()
    assert seg.mm[0] == BUSY  # the array still uses it: not reused
    path2, seg2 = pool.write([memoryview(b"xyz")])
    assert seg2 is not seg and bytes(held) == b"defg"
    del held
    gc.collect()
    assert seg.mm[0] == FREE
    path3, seg3 = pool.write([memoryview(b"hello")])
    assert seg3 is seg and path3 == path  # the same segment, mapped once by the reader
    assert [bytes(v) for v in reader.buffers(path3, [5])] == [b"hello"]
    assert len(pool) == 2
    pool.close()
    assert seg.mm.closed and not os.path.exists(path2)
    with pytest.raises(OSError):
        pool.write([memoryview(b"late")])


def test_retired_segments_are_dropped_and_leftovers_unlinked():
    w = SegmentWriter()
    pool, reader = w.pool(), SegmentReader()
    path, seg = pool.write([memoryview(b"abc")])
    reader.buffers(path, [3])
    gc.collect()
    mapped = reader._maps[path]
    pool.close()  # the receiver sees the state and forgets its mapping
    assert mapped[0] == RETIRED
    other = w.pool()
    p2, _ = other.write([memoryview(b"never picked up")])
    held = reader.buffers(p2, [5])
    assert path not in reader._maps
    p3, _ = other.write([memoryview(b"never mapped")])  # a new segment: p2's is held
    assert os.path.exists(p3)
    w.cleanup()
    assert not os.path.exists(p3) and _ours() == []
    assert bytes(held[0]) == b"never"


def test_bad_segment_names_are_refused():
    reader = SegmentReader()
    for bad in ("/etc/passwd", os.path.join(SHM_DIR, "rpcdist-msg-gone")):
        with pytest.raises(ValueError):
            reader.buffers(bad, [1])
    with pytest.raises(OSError):
        reader.buffers(os.path.join(SHM_DIR, "rpcdist-msg-1-gone"), [1])
    w = SegmentWriter()
    path, _ = w.pool().write([memoryview(b"abc")])
    with pytest.raises(OSError):
        reader.buffers(path, [3, 1 << 30])  # longer than the segment
    w.cleanup()


def test_large_buffers_keep_their_page_offset_and_small_ones_a_cache_line():
    from rpcdist._transport._shm import layout

    big = np.arange(3 << 18, dtype=np.uint32)  # 3 MiB
    parts = [b"abc", big[5:].data, b"de", memoryview(b"f" * 100)]
    offsets, total = layout([memoryview(p) for p in parts])
    src = np.frombuffer(parts[1], np.uint8).__array_interface__["data"][0]
    assert offsets[1] % 4096 == src % 4096  # (an address 20 bytes into a page)
    assert [o % 64 for o in (offsets[0], offsets[2], offsets[3])] == [0, 0, 0]
    assert offsets == sorted(offsets) and total == offsets[3] + 100
    w = SegmentWriter()
    path, seg = w.pool().write([memoryview(p) for p in parts])
    views = SegmentReader().buffers(path, [memoryview(p).nbytes for p in parts])
    assert [bytes(v) for v in views] == [bytes(p) for p in parts]
    assert np.array_equal(np.frombuffer(views[1], np.uint32), big[5:])
    del views
    w.cleanup()


def test_a_segment_whose_table_disagrees_with_the_message_is_refused():
    w = SegmentWriter()
    pool = w.pool()
    for forge in ("count", "offset"):
        path, seg = pool.write([memoryview(b"abc"), memoryview(b"defg")])
        reader = SegmentReader()
        if forge == "count":
            seg.mm[8:16] = (3).to_bytes(8, "little")
        else:
            seg.mm[24:32] = (len(seg.mm) - 2).to_bytes(8, "little")  # runs past the end
        with pytest.raises(OSError):
            reader.buffers(path, [3, 4])
        seg.mm[0] = FREE
    w.cleanup()


def test_threads_sending_large_arrays_at_once_each_get_their_own_back():
    """Blocking calls from several threads (each copying into segments of
    its own connection) beside rpc_async calls (copied by the calling thread
    or the loop), all to one peer: every array comes back intact."""
    import threading

    rng = np.random.default_rng(5)
    xs = [rng.random(300_000) for _ in range(4)]  # 2.4 MB each
    got: dict[int, list[bool]] = {}
    with local_agents(2, options=rpcdist.RpcOptions(token=None)) as (a, b), as_current(a):

        def run(t: int) -> None:
            with as_current(a):
                got[t] = [
                    np.array_equal(
                        rpcdist.rpc_sync("worker1", rf.echo, args=(xs[t] + i,)), xs[t] + i
                    )
                    for i in range(8)
                ]

        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        futs = [rpcdist.rpc_async("worker1", rf.echo, args=(xs[0] * i,)) for i in range(8)]
        assert all(np.array_equal(f.wait(60), xs[0] * i) for i, f in enumerate(futs))
        for t in threads:
            t.join(60)
        assert got == {t: [True] * 8 for t in range(4)}
        assert _written(a) == 40 and _written(b) == 40
    assert _ours() == []


def test_a_large_blocking_call_that_times_out_leaves_the_next_working_and_nothing_behind():
    """The request went through a segment on a thread-driven connection; the
    call times out while the handler holds it, the connection goes to the
    loop, and the late reply (also large, through a segment) is read and
    dropped there."""
    big = np.random.default_rng(6).random(300_000)  # 2.4 MB each way
    rf.release.clear()
    try:
        with local_agents(2, options=rpcdist.RpcOptions(token=None)) as (a, b), as_current(a):
            with pytest.raises(rpcdist.RpcTimeoutError):
                rpcdist.rpc_sync("worker1", rf.held, args=(big,), timeout=0.3)
            assert _written(a) == 1  # the request took a segment
            got = rpcdist.rpc_sync("worker1", rf.echo, args=(big * 2,))
            assert np.array_equal(got, big * 2)
            rf.release.set()  # the late handler answers with ``big``: a large reply
            deadline = time.monotonic() + 30
            while _written(b) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # (polling for the late reply's segment, not a wait for it)
            assert _written(b) == 2
            del got
    finally:
        rf.release.set()
    gc.collect()
    assert _ours() == []


def test_large_payloads_are_copied_by_the_sending_threads_not_the_loops(monkeypatch):
    """rpc_async calls in flight together and their replies under load take
    the loops' path, but their arrays are copied into segments by the
    calling thread and the handler threads: a loop copying 256 MB would hold
    up every other message (heartbeats included) for tens of milliseconds."""
    import threading

    from rpcdist._transport import _shm

    writers: list[str] = []
    write = _shm.SegmentPool.write

    def recording(self, buffers):
        writers.append(threading.current_thread().name)
        return write(self, buffers)

    x = np.random.default_rng(7).random(300_000)  # 2.4 MB
    with local_agents(2, options=rpcdist.RpcOptions(token=None)) as (a, _), as_current(a):
        rpcdist.rpc_sync("worker1", rf.add, args=(1, 2))  # the links are up
        assert rpcdist.rpc_async("worker1", rf.add, args=(1, 2)).wait(30) == 3
        monkeypatch.setattr(_shm.SegmentPool, "write", recording)
        futs = [rpcdist.rpc_async("worker1", rf.echo, args=(x + i,)) for i in range(8)]
        assert all(np.array_equal(f.wait(60), x + i) for i, f in enumerate(futs))
    assert len(writers) == 16  # each call and each reply
    assert not [w for w in writers if "loop" in w], writers
