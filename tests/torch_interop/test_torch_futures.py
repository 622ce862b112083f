"""PyTorch RPC programs wait with ``torch.futures.wait_all``/``collect_all``
(torch's own functions, not an import that changes): they accept rpcdist
Futures once ``rpcdist.torch.rpc`` is imported, and behave as before on
torch's own futures."""

from __future__ import annotations

import pytest
import tfuncs as tf
import torch

import rpcdist.torch.rpc as rpc
from rpcdist import Future, RpcOptions
from rpcdist.testing import as_current, local_agents

pytestmark = pytest.mark.torch


@pytest.fixture
def agent():
    with local_agents(2, options=RpcOptions(token=None, transport="inproc")) as agents:
        with as_current(agents[0]):
            yield agents[0]


def test_torch_wait_all_waits_on_rpc_async_and_proxy_futures(agent):
    futs = [rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), i)) for i in range(3)]
    assert all(isinstance(f, Future) for f in futs)
    got = torch.futures.wait_all(futs)
    assert [t.tolist() for t in got] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    rref = rpc.remote("worker1", torch.zeros, args=(2,))
    assert torch.futures.wait_all([rref.rpc_async().add(1)])[0].tolist() == [1.0, 1.0]
    del rref


def test_torch_collect_all_over_rpcdist_and_torch_futures(agent):
    theirs: torch.futures.Future[int] = torch.futures.Future()
    ours = rpc.rpc_async("worker1", torch.mul, args=(torch.ones(1), 5))
    both = torch.futures.collect_all([theirs, ours])
    assert not both.done()  # (torch's future is not complete yet)
    theirs.set_result(7)
    values = [f.wait() for f in both.wait()]
    assert values[0] == 7 and values[1].item() == 5.0


def test_torch_wait_all_raises_the_remote_error(agent):
    futs = [rpc.rpc_async("worker1", tf.fail_with, args=("boom",))]
    with pytest.raises(ValueError, match="boom"):
        torch.futures.wait_all(futs)


def test_lists_of_torch_futures_still_take_torchs_own_path():
    a: torch.futures.Future[int] = torch.futures.Future()
    a.set_result(3)
    assert torch.futures.wait_all([a]) == [3]
    combined = torch.futures.collect_all([a])
    assert isinstance(combined, torch._C.Future) and not isinstance(combined, Future)
    assert combined.wait()[0].wait() == 3
    assert torch.futures.wait_all.__wrapped__ is torch.futures.wait_all._rpcdist_wraps


def test_torch_wait_all_raises_the_first_error_without_waiting_for_the_rest(agent):
    # As torch's: a future still pending does not hold back an error that arrived.
    pending: Future[int] = Future()
    failed = rpc.rpc_async("worker1", tf.fail_with, args=("first",))
    with pytest.raises(ValueError, match="first"):
        torch.futures.wait_all([pending, failed], timeout=30)
    assert not pending.done()
    pending.set_result(1)
    assert torch.futures.wait_all([pending, rpc.rpc_async("worker1", torch.add, args=(1, 1))]) == [
        1,
        2,
    ]
    assert torch.futures.wait_all([pending]) == [1]


def test_a_then_callback_may_wait_for_another_call_it_makes(agent):
    # torch's tests do this (test_callback_with_ret); rpcdist runs a reply's
    # callbacks on the agent's loop, which the wait would have stopped
    def callback(first):
        second = rpc.rpc_async("worker1", torch.add, args=(first.wait(), 1))
        return second.then(lambda f: f.wait() + 1).wait(timeout=30)

    fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1)).then(callback)
    assert fut.wait(timeout=60).tolist() == [4.0, 4.0]
    chained = rpc.rpc_async("worker1", torch.add, args=(torch.ones(1), 1))
    for _ in range(5):
        chained = chained.then(lambda f: f.wait() + 1)
    assert chained.wait(timeout=60).item() == 7.0
    failing = rpc.rpc_async("worker1", tf.fail_with, args=("boom",)).then(lambda f: f.wait())
    with pytest.raises(ValueError, match="boom"):
        failing.wait(timeout=60)


def test_a_then_callbacks_own_error_is_a_runtime_error_with_torchs_words(agent):
    # torch's test_callback_wrong_arg_num / _wrong_arg_type: a TypeError the
    # callback itself raises reaches wait() as torch's RuntimeError, the
    # original as its cause; the error of the future it waited for keeps its type
    def two_args(a, b):
        return a

    fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(1), 1))
    wrong_num = fut.then(two_args)
    with pytest.raises(RuntimeError, match="when running the callback: TypeError: ") as info:
        wrong_num.wait(timeout=60)
    assert isinstance(info.value.__cause__, TypeError)
    wrong_type = fut.then(lambda f: f + 1)
    with pytest.raises(RuntimeError, match=r"unsupported operand type\(s\) for \+"):
        wrong_type.wait(timeout=60)
    remote = rpc.rpc_async("worker1", tf.fail_with, args=("boom",)).then(lambda f: f.wait())
    with pytest.raises(ValueError, match="boom"):
        remote.wait(timeout=60)
