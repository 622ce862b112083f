"""Shutdown gives back what the workers opened: file descriptors (sockets,
epoll and event descriptors, pipes) and /dev/shm segments, so that a process
which starts and stops workers many times (a test suite, a notebook, an
elastic restart in place) does not run out of them. Threads are checked
after every test by the suite's own fixture."""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest
import rpc_funcs as rf

import rpcdist
from rpcdist import RpcOptions
from rpcdist.testing import as_current, local_agents

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


def _fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # (the listing's own descriptor, closed meanwhile)
            pass
    return out


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _cycle(transport: str) -> None:
    """Two workers, every kind of connection and payload path, then shut down."""
    opts = RpcOptions(token=None, transport=transport, shm_threshold_bytes=1 << 16)
    big = np.arange(50_000, dtype=np.float64)  # 400 KB: through /dev/shm
    with local_agents(2, options=opts) as agents, as_current(agents[0]):
        assert rpcdist.rpc_sync("worker1", rf.add, args=(1, 2)) == 3  # a blocking call
        assert rpcdist.rpc_async("worker1", rf.add, args=(2, 2)).wait() == 4  # the loop's link
        np.testing.assert_array_equal(rpcdist.rpc_sync("worker1", rf.echo, args=(big,)), big)
        rref = rpcdist.remote("worker1", rf.add, args=(3, 4))
        assert rref.to_here() == 7
        del rref


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_starting_and_stopping_workers_again_and_again_leaves_nothing_open(transport):
    # The first start opens what a process keeps for good (gRPC's core and
    # its polling thread, the host-load file the busy poller reads).
    _cycle(transport)
    gc.collect()
    fds_before, segments_before = _fds(), _segments()
    for _ in range(3):
        _cycle(transport)
    deadline = time.monotonic() + 10  # (closing may finish just after shutdown returns)
    while True:
        gc.collect()
        new_fds = {fd: what for fd, what in _fds().items() if fds_before.get(fd) != what}
        new_segments = _segments() - segments_before
        if (not new_fds and not new_segments) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not new_fds, f"left open after shutdown: {sorted(new_fds.values())}"
    assert not new_segments, f"/dev/shm segments left behind: {sorted(new_segments)}"
