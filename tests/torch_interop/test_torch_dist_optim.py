"""``rpcdist.torch.optim.DistributedOptimizer`` in one process (two agents):
each owner's parameters take the steps the same ``torch.optim`` optimizer
takes locally with the same gradients (the functional SGD that plain SGD
maps to as well as a class stepped through ``.grad``), and, as under
PyTorch, a step leaves ``.grad`` alone and does not move a parameter that
has no gradient in the context."""

from __future__ import annotations

import pytest
import tfuncs as tf
import torch
from agent_support import contexts_settled

import rpcdist.torch.autograd as dist_autograd
import rpcdist.torch.rpc as rpc
from rpcdist import RpcOptions
from rpcdist.testing import as_current, local_agents
from rpcdist.torch.optim import DistributedOptimizer

pytestmark = pytest.mark.torch

STEPS = 3

OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "dampening": 0.5, "maximize": True}),
    (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.01}),
]


@pytest.fixture
def agents():
    tf.PARAMS.clear()
    tf.PARAMS.update({f"worker{i}": tf.param(i) for i in range(2)})
    tf.PARAMS["idle"] = tf.param(7)  # on worker1; no forward uses it
    with local_agents(2, options=RpcOptions(token=None)) as ags:
        yield ags
        assert contexts_settled(ags)


def _owned(name: str) -> torch.Tensor:
    """``remote`` target: the parameter ``name`` itself, so the owner's RRef holds it."""
    return tf.PARAMS[name]


def _loss(x: torch.Tensor) -> torch.Tensor:
    return (rpc.rpc_sync("worker1", tf.layer, args=(tf.layer(x),)) ** 2).sum()


def _local_oracle(cls, kw, x0, start):
    ws = {n: t.detach().clone().requires_grad_() for n, t in start.items()}
    opt = cls(list(ws.values()), **kw)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x = x0.detach().clone()
        (torch.tanh(torch.tanh(x @ ws["worker0"]) @ ws["worker1"]) ** 2).sum().backward()
        opt.step()
    return ws


@pytest.mark.parametrize(("cls", "kw"), OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_steps_match_the_same_optimizer_run_locally(agents, cls, kw):
    start = {n: t.detach().clone() for n, t in tf.PARAMS.items()}
    x0 = tf.param(9, (2, 3))
    sentinel = torch.full((3, 3), 7.0, dtype=torch.float64)
    for name in ("worker1", "idle"):
        tf.PARAMS[name].grad = sentinel.clone()  # e.g. left by training of the owner's own
    with as_current(agents[0]):
        rrefs = [rpc.RRef(tf.PARAMS["worker0"])]  # this worker's own, stepped here
        rrefs += [rpc.remote("worker1", _owned, args=(n,)) for n in ("worker1", "idle")]
        opt = DistributedOptimizer(cls, rrefs, **kw)
        for _ in range(STEPS):
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [_loss(x0.detach().clone())])
                opt.step(cid)
        del rrefs, opt
    want = _local_oracle(cls, kw, x0, start)
    for name in ("worker0", "worker1"):
        torch.testing.assert_close(tf.PARAMS[name].detach(), want[name].detach())
    # No gradient for it in any context: not moved, even by weight decay or
    # by the stale .grad it holds (torch's optimizers skip it as well).
    torch.testing.assert_close(tf.PARAMS["idle"].detach(), start["idle"])
    assert tf.PARAMS["worker0"].grad is None
    for name in ("worker1", "idle"):
        torch.testing.assert_close(tf.PARAMS[name].grad, sentinel)  # left alone


def test_a_bad_hyperparameter_fails_at_construction_naming_it(agents):
    with as_current(agents[0]):
        rrefs = [rpc.remote("worker1", _owned, args=("worker1",))]
        with pytest.raises(ValueError, match="lr"):
            DistributedOptimizer(torch.optim.SGD, rrefs, lr=-1.0)
        with pytest.raises(ValueError, match="Nesterov"):
            DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1, nesterov=True)
        del rrefs
