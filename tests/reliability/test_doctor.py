"""The hang doctor (timeout snapshots, ``debug_info``) and what a lost peer
does to the layers above calls: collectives, and the same error on gRPC."""

from __future__ import annotations

import harness
import numpy as np
import pytest
import rel_funcs as rf
import rel_workers as rw
from agent_support import ok, on_all

import rpcdist
from rpcdist import collectives as dist
from rpcdist.collectives._api import attach, detach
from rpcdist.testing import as_current, local_agents

FAST = rpcdist.RpcOptions(token=None, heartbeat_interval=0.1, peer_timeout=0.6)


@pytest.fixture
def released():
    rf.RELEASE.clear()
    rf.BLOCKING.clear()
    yield
    rf.RELEASE.set()


@pytest.mark.parametrize("path", ["rpc_async", "rpc_sync"])
def test_a_timeout_carries_a_snapshot_of_what_was_outstanding(path):
    with local_agents(2, options=rpcdist.RpcOptions(token=None)) as (a, _):
        slow = a.rpc_async(1, rf.nap, args=(1.0,))  # outstanding when the next times out
        with pytest.raises(rpcdist.RpcTimeoutError) as info:
            if path == "rpc_async":
                a.rpc_async(1, rf.nap, args=(1.0,), timeout=0.2).wait()
            else:
                a.rpc_sync(1, rf.nap, args=(1.0,), timeout=0.2)
        snap = info.value.snapshot
        assert snap["worker"] == "worker0"
        pending = snap["pending_calls"]["worker1"]
        assert pending["count"] >= 1 and pending["oldest"][0]["call"] == "rel_funcs:nap"
        assert "pending calls:" in str(info.value) and "'worker1'" in str(info.value)
        assert slow.wait(10) == 1.0


def test_debug_info_reports_calls_collectives_rrefs_and_lost_workers():
    with local_agents(2, options=rpcdist.RpcOptions(token=None, transport="inproc")) as agents:
        a = agents[0]
        info = a.debug_info()
        assert info["pending_calls"] == {} and info["handlers_running"] == 0
        assert "rref" in info and "autograd" in info
        ok(on_all(agents, lambda r: attach(agents[r], "ring", 20)))
        ok(on_all(agents, lambda r: dist.all_reduce(np.ones(4))))
        with as_current(a):
            coll = rpcdist.debug_info()["collectives"]["collectives"]["group 0"]
            rref = rpcdist.remote(1, rf.ones, args=(3,))
            rref.to_here(10)
            assert rpcdist.debug_info()["rref"]["rref_users"] >= 1
            del rref
        assert coll["issued"] == 1 and coll["completed"] == 1 and coll["running"] is None
        ok(on_all(agents, lambda r: detach(agents[r])))


def test_a_collective_with_a_lost_member_fails_naming_it(released):
    with local_agents(3, options=FAST) as agents:
        ok(on_all(agents, lambda r: attach(agents[r], "ring", 60)))
        ok(on_all(agents, lambda r: dist.all_reduce(np.ones(8))))
        agents[0].rpc_async(2, rf.block_loop, args=(60,))  # rank 2 hangs
        assert rf.BLOCKING.wait(10)
        out = on_all(agents[:2], lambda r: dist.all_reduce(np.ones(8)))
        for err in out:
            assert isinstance(err, rpcdist.CollectiveError), out
            assert "lost rank 2" in str(err) and "worker2" in str(err)
        rf.RELEASE.set()
        on_all(agents, lambda r: detach(agents[r]))


@pytest.mark.multiprocess
def test_a_peer_killed_mid_call_on_grpc_is_a_lost_worker():
    res = harness.run_job(rw.grpc_kill_job, 2, timeout=60, expect={0})
    assert not res.errors, res.errors
    got = res.values[0]
    assert got["error"] == "WorkerLostError", got
    assert "'w1'" in got["message"]
    assert got["lost"] == ["w1"]
