"""Distributed autograd when workers die: typed errors, never a hang; leases."""

from __future__ import annotations

import gc
import time

import ad_funcs as af
import numpy as np
import pytest
from agent_support import contexts_settled

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist import AutogradError, RpcOptions
from rpcdist.autograd._context import IdMaker, creator_of
from rpcdist.tensor import Tensor
from rpcdist.testing import as_current, local_agents

LOST = (rpcdist.WorkerLostError, rpcdist.ConnectError)


@pytest.fixture
def agents():
    af.PARAMS.clear()
    af.HOLD.clear()
    af.ENTERED.clear()
    with local_agents(3, options=RpcOptions(token=None), rpc_timeout=20) as ags:
        yield ags
    af.HOLD.set()


def test_a_worker_dead_before_the_pass_is_a_typed_error(agents):
    a, b, _ = agents
    with as_current(a):
        x = Tensor(np.ones(3), requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpcdist.rpc_sync("worker1", af.scale, args=(x,))
            b.shutdown(graceful=False)
            started = time.monotonic()
            with pytest.raises(LOST):
                dist_autograd.backward(cid, [y.sum()])
            assert time.monotonic() - started < 15  # the deadline was 20 s: no timeout


def test_a_dead_worker_asked_whether_a_send_is_reached_is_a_typed_error(agents):
    """The root's two sends share a node, so it asks worker1 (now dead)
    whether the second is reached before it counts: that question fails typed."""
    a, b, _ = agents
    with as_current(a):
        x = Tensor(np.ones(3), requires_grad=True)
        with dist_autograd.context() as cid:
            h = x * 2.0
            y = rpcdist.rpc_sync("worker1", af.scale, args=(h,))
            rpcdist.rpc_sync("worker1", af.scale, args=(h * 3.0,))
            b.shutdown(graceful=False)
            started = time.monotonic()
            with pytest.raises(LOST):
                dist_autograd.backward(cid, [y.sum()])
            assert time.monotonic() - started < 15  # the deadline was 20 s: no timeout


def test_a_worker_dying_during_the_pass_is_a_typed_error(agents):
    a, _, c = agents
    with as_current(a):
        x = Tensor(np.ones(3), requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpcdist.rpc_sync("worker2", af.hold, args=(x,))
            import threading

            def kill_when_busy():
                af.ENTERED.wait(20)
                c.shutdown(graceful=False)

            killer = threading.Thread(target=kill_when_busy)
            killer.start()
            with pytest.raises(LOST):
                dist_autograd.backward(cid, [y.sum()])
            killer.join(20)
    af.HOLD.set()


def test_contexts_of_a_lost_creator_are_freed_after_the_lease(agents):
    a, b, c = agents
    for ag in (b, c):
        ag.registry.extensions["autograd"].lease = 0.3
    with as_current(a):
        x = Tensor(np.ones(3), requires_grad=True)
        ctx = dist_autograd.context()
        cid = ctx.__enter__()
        rpcdist.rpc_sync("worker1", af.chain, args=(x, ["worker2"]))
    assert b.statistics()["autograd_contexts"] == 1 and c.statistics()["autograd_contexts"] == 1
    a.shutdown(graceful=False)  # the creator dies without leaving its context
    end = time.monotonic() + 10
    while time.monotonic() < end and (
        b.statistics()["autograd_contexts"] or c.statistics()["autograd_contexts"]
    ):
        time.sleep(0.02)
    assert b.statistics()["autograd_contexts"] == 0
    assert c.statistics()["autograd_contexts"] == 0
    ctx.__exit__(None, None, None)  # (this thread's current context, left open above)
    del cid


def test_many_iterations_leave_no_context_behind(agents):
    a = agents[0]
    with as_current(a):
        x = Tensor(np.ones(3), requires_grad=True)
        for _ in range(300):
            with dist_autograd.context() as cid:
                y = rpcdist.rpc_sync("worker1", af.scale, args=(x,))
                dist_autograd.backward(cid, [(y * y).sum()])
    end = time.monotonic() + 10
    while time.monotonic() < end:
        gc.collect()
        if all(ag.statistics()["autograd_contexts"] == 0 for ag in agents):
            break
        time.sleep(0.01)
    assert [ag.statistics()["autograd_contexts"] for ag in agents] == [0, 0, 0]
    assert agents[1].statistics()["autograd_released"] >= 300


def test_a_live_creator_keeps_its_contexts_when_a_link_ends(agents):
    a, b, _ = agents
    ext_b = b.registry.extensions["autograd"]
    ext_b.lease = 0.2
    with as_current(a):
        x = Tensor(np.ones(3), requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpcdist.rpc_sync("worker1", af.scale, args=(x,))
            b.loop.call_soon_threadsafe(b.peer_lost, 0)  # as if a link of a's had ended
            time.sleep(0.8)  # several leases: the ping finds a alive
            assert b.statistics()["autograd_contexts"] == 1
            dist_autograd.backward(cid, [y.sum()])  # and the pass still works
            assert np.array_equal(
                rpcdist.rpc_sync("worker1", af.grads_here, args=(cid,))["w"], np.ones(3)
            )


def test_contexts_a_restarted_creator_does_not_hold_are_freed(agents):
    """worker1 holds a context of rank 0 that rank 0 does not hold (as when
    rank 0 was lost and a new process took its rank in a dynamic group): the
    ping after the lease answers that rank 0 holds it no longer, and it is
    freed; rank 0's live context, asked in the same ping, is kept."""
    a, b, _ = agents
    ext_b = b.registry.extensions["autograd"]
    ext_b.lease = 0.2
    stale = ext_b.context(ext_b.ids.new() & ((1 << 48) - 1))  # (rank 0's bits)
    assert creator_of(stale.id) == 0
    with as_current(a):
        x = Tensor(np.ones(3), requires_grad=True)
        with dist_autograd.context() as cid:
            rpcdist.rpc_sync("worker1", af.scale, args=(x,))
            assert b.statistics()["autograd_contexts"] == 2
            b.loop.call_soon_threadsafe(b.peer_lost, 0)
            end = time.monotonic() + 10
            while time.monotonic() < end and b.statistics()["autograd_contexts"] != 1:
                time.sleep(0.02)
            assert ext_b.holding([stale.id, cid]) == [cid]
            assert stale.released


def test_a_restarted_worker_makes_other_context_ids():
    """Two processes of one rank (a worker and its restarted successor) start
    their counters at random points: their ids do not meet."""
    first, second = IdMaker(3), IdMaker(3)
    ids = [first.new() for _ in range(1000)]
    assert {creator_of(i) for i in ids} == {3} and ids == sorted(ids)
    assert not set(ids) & {second.new() for _ in range(1000)}


def test_a_local_error_while_a_gradient_message_is_out_abandons_that_call(agents):
    """The root's own part fails while worker2 still works on the gradients
    it was sent: backward raises the local error without waiting for
    worker2, the call in flight is counted out at once, and worker2's late
    answer is dropped (every context is still released)."""
    a = agents[0]
    with as_current(a):
        x = Tensor(np.ones(3), requires_grad=True)
        w = Tensor(np.ones(3), requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpcdist.rpc_sync("worker2", af.hold, args=(x,))
            z = af.FailWhenHeld.call(w) * 3.0
            started = time.monotonic()
            with pytest.raises(AutogradError, match="local part failed"):
                dist_autograd.backward(cid, [(z + y).sum()])  # (y's edge runs first)
            assert af.ENTERED.is_set()  # the message had left and was being worked on
            assert time.monotonic() - started < 15  # not the 20 s deadline
            assert a.statistics()["pending_calls"] == 0
            af.HOLD.set()
    assert contexts_settled(agents)
