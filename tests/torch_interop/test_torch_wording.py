"""Misuse is refused as torch refuses it, in torch's words first (programs
and PyTorch's own tests match them), rpcdist's detail after: wrong argument
types (``TypeError``), nested autograd contexts, invalid worker names, calls
before ``init_rpc``."""

from __future__ import annotations

import datetime

import pytest
import torch

import rpcdist.torch.autograd as dist_autograd
import rpcdist.torch.rpc as rpc
from rpcdist import RpcOptions
from rpcdist.testing import as_current, local_agents

pytestmark = pytest.mark.torch


class _OtherBackendOptions(rpc.RpcBackendOptions):
    """Another backend's options class (what torch cannot infer a backend from)."""


@pytest.fixture
def agent():
    with local_agents(2, options=RpcOptions(token=None, transport="inproc")) as agents:
        with as_current(agents[0]):
            yield agents[0]


def test_init_rpc_argument_types_are_refused_with_torchs_texts():
    with pytest.raises(TypeError, match="^Argument backend must be a member of BackendType"):
        rpc.init_rpc("w", rank=0, world_size=1, backend="TENSORPIPE")
    with pytest.raises(TypeError, match="^Argument rpc_backend_options must be an instance of"):
        rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options={"init_method": "env://"})
    other = _OtherBackendOptions()
    with pytest.raises(TypeError, match="^Could not infer backend for options"):
        rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options=other)
    with pytest.raises(
        TypeError, match="^`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`"
    ):
        rpc.init_rpc(
            "w", backend=rpc.BackendType.TENSORPIPE, rank=0, world_size=1, rpc_backend_options=other
        )
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=datetime.timedelta())


@pytest.mark.parametrize(
    ("init_method", "why"),
    [
        ("file:///tmp/rpcdist-never-made", "file:// rendezvous: rank parameter missing"),
        ("env://", "env:// rendezvous: environment variable RANK expected, but not set"),
        ("tcp://127.0.0.1:1", "tcp:// rendezvous: rank parameter missing"),
    ],
)
def test_a_missing_rank_is_refused_with_torchs_texts(init_method, why, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    with pytest.raises(ValueError, match=f"^Error initializing torch.distributed using {why}$"):
        rpc.init_rpc("w", rpc_backend_options=options)


@rpc.functions.async_execution
def _returns_no_future():
    return torch.zeros(2)


def test_an_async_function_returning_no_future_is_refused_with_torchs_text(agent):
    with pytest.raises(RuntimeError, match=r"must return a torch\.futures\.Future object,"):
        rpc.rpc_sync("worker1", _returns_no_future)


def test_calls_before_init_rpc_say_rpc_has_not_been_initialized():
    with pytest.raises(RuntimeError, match="^RPC has not been initialized"):
        rpc.rpc_sync("worker1", torch.add, args=(1, 1))


def test_invalid_worker_names_are_refused_when_a_worker_info_is_made():
    with pytest.raises(RuntimeError, match="^Worker name must match"):
        rpc.WorkerInfo("abc*", 0)
    with pytest.raises(RuntimeError, match="^Worker name must match"):
        rpc.WorkerInfo(" ", 0)
    with pytest.raises(RuntimeError, match="^Worker name must be non-empty"):
        rpc.WorkerInfo("", 0)
    with pytest.raises(RuntimeError, match="^Worker name must be shorter than 128"):
        rpc.WorkerInfo("a" * 500, 0)
    assert rpc.WorkerInfo("trainer-1:a_b", 3).name == "trainer-1:a_b"


def test_autograd_contexts_do_not_nest(agent):
    with dist_autograd.context() as outer:
        with pytest.raises(
            RuntimeError, match="^Already have an autograd context id for this thread"
        ):
            with dist_autograd.context():
                pass
        t = torch.ones(2, requires_grad=True)
        y = rpc.rpc_sync("worker1", torch.mul, args=(t, 2))
        dist_autograd.backward(outer, [y.sum()])  # the outer context still works
        assert dist_autograd.get_gradients(outer)[t].tolist() == [2.0, 2.0]
    with dist_autograd.context():  # and one opens again once it is closed
        pass


def test_then_with_a_non_callable_is_a_type_error(agent):
    fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(1), 1))
    with pytest.raises(TypeError, match="incompatible function arguments"):
        fut.then(None)
    assert fut.wait().item() == 2.0


def test_rref_backward_without_a_context_runs_locally_on_the_owner(agent):
    t1 = torch.rand(3, 3, requires_grad=True)
    rpc.RRef(t1.sum() + t1.sum()).backward()  # as torch's: into .grad
    assert torch.equal(t1.grad, torch.ones(3, 3) * 2)
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        rpc.RRef(torch.rand(2)).backward()
    with pytest.raises(RuntimeError, match="^RRef should contain a tensor for .backward()"):
        rpc.RRef("foo").backward()
    with pytest.raises(RuntimeError, match="^Could not find autograd context with id: 100"):
        rpc.RRef(torch.rand(2, requires_grad=True).sum()).backward(100)
    t = torch.rand(2, requires_grad=True)
    with dist_autograd.context() as cid:
        there = rpc.remote("worker1", torch.sum, args=(t,))
        with pytest.raises(RuntimeError, match="^User RRefs require 'dist_autograd_ctx_id'"):
            there.backward()
        there.backward(cid)
        assert torch.equal(dist_autograd.get_gradients(cid)[t], torch.ones(2))
        foo = rpc.remote("worker1", str, args=("foo",))
        with pytest.raises(RuntimeError, match="^RRef should contain a tensor for .backward()"):
            foo.backward(cid)
