"""A distributed backward pass under torch's profiler (three agents in one
process): the root's profile holds PyTorch's ranges (the pass, its receive
and send functions) and the work that gradients coming back start there,
on the root's thread; and the hand-over behind it (``_host``) alone."""

from __future__ import annotations

import threading

import pytest
import torch
from agent_support import contexts_settled

import rpcdist.torch.autograd as dist_autograd
import rpcdist.torch.rpc as rpc
from rpcdist import Future, RpcOptions
from rpcdist.testing import as_current, local_agents
from rpcdist.torch._backward import BACKWARD_RANGE, RECV_RANGE, SEND_RANGE
from rpcdist.torch._host import Host

pytestmark = pytest.mark.torch


@pytest.fixture
def agents():
    with local_agents(3, options=RpcOptions(token=None)) as ags:
        yield ags
        assert contexts_settled(ags)


@pytest.fixture(params=["kineto", "legacy"])
def profile(request):
    """``torch.autograd.profiler.profile`` (Kineto's, as PyTorch's test uses) or the legacy one."""
    if request.param == "legacy":
        from torch.autograd.profiler_legacy import profile as legacy

        return legacy
    return torch.autograd.profiler.profile


def _within(inner, outer) -> bool:
    i, o = inner.time_range, outer.time_range
    return o.start <= i.start and i.end <= o.end


def _named(events, name):
    return [e for e in events if e.name == name]


def test_a_profiled_backward_holds_torchs_ranges_and_the_work_of_the_gradient_that_returns(
    agents, profile
):
    with as_current(agents[0]):
        t = torch.rand(3, 3, requires_grad=True)
        with dist_autograd.context() as cid:
            x = t * 2  # (its backward runs when the gradient comes back from worker1)
            loss = rpc.rpc_sync("worker1", torch.add, args=(x, torch.ones(3, 3))).sum()
            with profile() as prof:
                dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
    assert torch.equal(grads[t], torch.full((3, 3), 2.0))
    assert t.grad is None
    events = prof.function_events
    [bwd] = _named(events, BACKWARD_RANGE)
    [recv] = _named(events, RECV_RANGE)  # (the sum's gradient, sent to worker1)
    [send] = _named(events, SEND_RANGE)  # (x's gradient, back from worker1)
    assert recv.thread == send.thread == bwd.thread
    assert _within(recv, bwd) and _within(send, recv)
    assert [e for e in _named(events, "MulBackward0") if _within(e, send)]


def _there_and_back(x: torch.Tensor) -> torch.Tensor:
    """On worker1: half the work back on worker0 (a nested call), the rest here."""
    y = rpc.rpc_sync("worker0", torch.mul, args=(x * 2, 3))
    return y + 1


def test_gradients_that_come_back_twice_to_the_root_run_nested_on_its_thread(agents, profile):
    with as_current(agents[0]):
        t = torch.rand(2, 2, requires_grad=True)
        with dist_autograd.context() as cid:
            loss = (rpc.rpc_sync("worker1", _there_and_back, args=(t,)) ** 2).sum()
            with profile() as prof:
                dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
    expected = t.detach().clone().requires_grad_()
    ((expected * 2 * 3 + 1) ** 2).sum().backward()
    assert torch.allclose(grads[t], expected.grad)
    events = prof.function_events
    [bwd] = _named(events, BACKWARD_RANGE)
    recvs, sends = _named(events, RECV_RANGE), _named(events, SEND_RANGE)
    # worker0 receives the result and the product's input; worker1's
    # gradients come back for the product and for t, the second inside the first
    assert len(recvs) == 2 and len(sends) == 2
    assert {e.thread for e in recvs + sends} == {bwd.thread}
    outer, inner = sorted(sends, key=lambda e: e.time_range.start)
    assert _within(inner, outer) and _within(outer, bwd)


def test_an_unprofiled_backward_records_nothing(agents):
    with as_current(agents[0]):
        t = torch.rand(3, requires_grad=True)
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("worker1", torch.mul, args=(t, 2)).sum()
            dist_autograd.backward(cid, [loss])
            with torch.autograd.profiler.profile() as prof:
                torch.ones(1).add_(1)
            assert torch.equal(dist_autograd.get_gradients(cid)[t], torch.full((3,), 2.0))
    assert not [e for e in prof.function_events if "distributed::autograd" in e.name]


# ------------------------------------------------------------ the hand-over


def _offer_when_idle(host: Host, fn, deadline_s: float = 30.0):
    """``host.offer(fn)``, retried until the host thread waits (it may not yet)."""
    import time

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        done = host.offer(fn)
        if done is not None:
            return done
        time.sleep(0.001)
    raise AssertionError("the host thread never waited")


def test_a_host_declines_work_unless_it_waits_and_runs_it_on_its_own_thread():
    host = Host()
    assert host.offer(lambda: 1) is None  # (not waiting: the caller runs it)
    call: Future[str] = Future()
    seen: list[object] = []

    def helper() -> None:
        done = _offer_when_idle(host, lambda: threading.get_ident())
        seen.append(done.wait(timeout=30))
        failed = _offer_when_idle(host, lambda: 1 / 0)
        try:
            failed.wait(timeout=30)
        except ZeroDivisionError as e:
            seen.append(e)
        call.set_result("reply")

    th = threading.Thread(target=helper)
    th.start()
    try:
        assert host.wait(call) == "reply"
    finally:
        th.join(timeout=30)
    assert seen[0] == threading.get_ident() == host.thread
    assert isinstance(seen[1], ZeroDivisionError)
    assert host.offer(lambda: 1) is None  # (done waiting)


def test_a_host_running_one_job_declines_the_next():
    host = Host()
    call: Future[None] = Future()
    started, release = threading.Event(), threading.Event()
    declined: list[bool] = []

    def first() -> None:
        started.set()
        assert release.wait(timeout=30)

    def helper() -> None:
        done = _offer_when_idle(host, first)
        assert started.wait(timeout=30)
        declined.append(host.offer(lambda: None) is None)
        release.set()
        done.wait(timeout=30)
        call.set_result(None)

    th = threading.Thread(target=helper)
    th.start()
    try:
        host.wait(call)
    finally:
        release.set()
        th.join(timeout=30)
    assert declined == [True]
