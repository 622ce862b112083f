"""Large payloads between workers on one host travel through /dev/shm files."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import rpc_funcs as rf

import rpcdist
from rpcdist._transport._shm import SHM_DIR, SegmentWriter, map_segment, shm_available
from rpcdist.testing import local_agents

pytestmark = pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm")


def _ours() -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"rpcdist-msg-{os.getpid()}-*"))


@pytest.mark.parametrize(
    "opts",
    [
        rpcdist.RpcOptions(token=None, transport="grpc"),  # on by default there
        rpcdist.RpcOptions(token=None, transport="tcp", shm_threshold_bytes=1 << 20),
    ],
    ids=["grpc-auto", "tcp-explicit"],
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


@pytest.mark.parametrize(
    "opts",
    [
        rpcdist.RpcOptions(token=None, transport="grpc", shm_threshold_bytes=None),
        rpcdist.RpcOptions(token=None, transport="tcp"),  # off by default there
    ],
    ids=["grpc-off", "tcp-auto"],
)
def test_shared_memory_can_be_turned_off(opts):
    x = np.ones(500_000)
    with local_agents(2, options=opts) as (a, _):
        assert a.links.transport.segments is None
        assert np.array_equal(a.rpc_async(1, rf.echo, args=(x,)).wait(30), x)
        assert _ours() == []


def test_unclaimed_segments_are_removed_by_the_writer_and_bad_names_refused():
    w = SegmentWriter()
    path = w.write([memoryview(b"abc"), memoryview(b"defg")])
    assert os.path.exists(path)
    w.cleanup()
    assert not os.path.exists(path)
    path = w.write([memoryview(b"abc"), memoryview(b"defg")])
    views = map_segment(path, [3, 4])
    assert [bytes(v) for v in views] == [b"abc", b"defg"] and not os.path.exists(path)
    with pytest.raises(ValueError):
        map_segment("/etc/passwd", [1])
    with pytest.raises(OSError):
        map_segment(path, [3, 4])  # already unlinked
