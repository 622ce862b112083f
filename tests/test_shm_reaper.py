"""Large /dev/shm segments are taken down by the reaper thread, never by an
event loop: unmapping a 256 MB segment and freeing its pages held a loop
for about a tenth of a second, stalling every call and the failure
detector's rounds in that process. Transports still leave no file and no
thread behind once they stop."""

from __future__ import annotations

import asyncio
import gc
import glob
import os
import threading
import time

import numpy as np
import pytest
import rpc_funcs as rf

import rpcdist
from rpcdist._transport import _shm
from rpcdist._transport._shm import FREE, RETIRED, SHM_DIR, SegmentReader, SegmentWriter
from rpcdist.testing import as_current, local_agents

pytestmark = pytest.mark.skipif(not _shm.shm_available(), reason="no writable /dev/shm")

BIG = 64 << 20  # large enough to take a measurable while to take down, cheap to make


def _ours() -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"rpcdist-msg-{os.getpid()}-*"))


def _reapers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rpcdist-shm-reaper" and t.is_alive()]


def _record(monkeypatch: pytest.MonkeyPatch, name: str, log: list[threading.Thread]) -> None:
    """Note the thread of every call of ``_shm.<name>``."""
    fn = getattr(_shm, name)

    def recording(*args: object) -> None:
        log.append(threading.current_thread())
        fn(*args)

    monkeypatch.setattr(_shm, name, recording)


def test_a_pool_closed_on_a_loop_leaves_the_teardown_to_the_reaper(monkeypatch):
    w = SegmentWriter()
    pool, other, reader = w.pool(), w.pool(), SegmentReader()
    path, seg = pool.write([memoryview(np.ones(BIG, np.uint8))])
    held = reader.buffers(path, [BIG])  # the receiver maps it (and unlinks the file)
    assert held[0][BIG - 1] == 1
    del held
    gc.collect()
    assert seg.mm[0] == FREE
    small, _ = other.write([memoryview(b"abc")])
    torn_down: list[threading.Thread] = []
    unmapped: list[threading.Thread] = []
    unlinked: list[threading.Thread] = []  # the big segment's file, by its sender
    _record(monkeypatch, "_teardown", torn_down)
    _record(monkeypatch, "_unmap", unmapped)
    unlink = _shm._unlink

    def unlink_recording(p: str) -> None:
        if p == path:
            unlinked.append(threading.current_thread())
        unlink(p)

    monkeypatch.setattr(_shm, "_unlink", unlink_recording)

    async def on_the_loop() -> int:
        pool.close()
        state = reader._maps[path][0]  # set at once: the receiver never reuses it
        # The receiver, seeing it retired, lets go of its mapping (the last
        # hold on the pages once the sender's is gone).
        assert [bytes(v) for v in reader.buffers(small, [3])] == [b"abc"]
        assert path not in reader._maps
        await w.aclean()
        return state

    loop_thread = threading.current_thread()
    assert asyncio.run(on_the_loop()) == RETIRED
    assert torn_down and unmapped and unlinked
    assert all(t is not loop_thread for t in [*torn_down, *unmapped, *unlinked])
    assert seg.mm.closed and _ours() == []
    assert _reapers() == []  # aclean waited for it to end


def test_the_reaper_ends_once_idle_and_starts_again_when_needed():
    w = SegmentWriter()
    for _ in range(2):
        pool = w.pool()
        path, seg = pool.write([memoryview(np.ones(4 << 20, np.uint8))])
        pool.close()
        deadline = time.monotonic() + 10
        while (_reapers() or os.path.exists(path)) and time.monotonic() < deadline:
            time.sleep(0.02)  # (polling for the idle thread to end)
        assert _reapers() == [] and not os.path.exists(path) and seg.mm.closed
    w.cleanup()
    assert _ours() == []


def test_a_transport_stopping_takes_its_large_segments_down_off_its_loop(monkeypatch):
    """Through both paths (a blocking call on a thread-driven connection, an
    rpc_async call on the loop's link), then shutdown."""
    torn_down: list[threading.Thread] = []
    _record(monkeypatch, "_teardown", torn_down)
    _record(monkeypatch, "_unmap", torn_down)
    _record(monkeypatch, "_close_segments", torn_down)
    x = np.random.default_rng(8).random(3 << 20)  # 24 MB
    with local_agents(2, options=rpcdist.RpcOptions(token=None)) as (a, _), as_current(a):
        assert np.array_equal(rpcdist.rpc_sync("worker1", rf.echo, args=(x,)), x)
        assert np.array_equal(rpcdist.rpc_async("worker1", rf.echo, args=(x,)).wait(60), x)
        assert a.links.transport.segments.segments_made >= 2
    assert _ours() == []  # gone when shutdown returned
    assert torn_down and not [t.name for t in torn_down if "loop" in t.name]
    gc.collect()  # (links dropped late let go of what their receivers mapped)
    deadline = time.monotonic() + 10
    while _reapers() and time.monotonic() < deadline:
        time.sleep(0.02)  # (polling for the thread to end)
    assert _reapers() == []
    assert not [t.name for t in torn_down if "loop" in t.name]
