"""DistributedOptimizer and RemoteModule: parameters stepped where they live
equal the same optimizer run locally; state round-trips; misuse is clear."""

from __future__ import annotations

import threading

import ad_funcs as af
import numpy as np
import pytest

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist import ConfigError, RpcOptions, nn, optim
from rpcdist import tensor as rt
from rpcdist.tensor import Tensor
from rpcdist.testing import as_current, local_agents

TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture
def agents():
    af.PARAMS.clear()
    with local_agents(3, options=RpcOptions(token=None)) as ags:
        yield ags


class Net(nn.Module):
    """A small MLP whose first layer lives on a parameter server."""

    def __init__(self, remote_first=None, seed=0):
        super().__init__()
        rt.manual_seed(seed)
        self.first = remote_first or nn.Linear(4, 8, dtype="float64")
        rt.manual_seed(seed + 1)
        self.second = nn.Linear(8, 3, dtype="float64")

    def forward(self, x):
        return self.second(rt.tanh(self.first(x)))


class First(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        rt.manual_seed(seed)
        self.lin = nn.Linear(4, 8, dtype="float64")

    def forward(self, x):
        return self.lin(x)


def _data(step):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((5, 4)), rng.integers(0, 3, 5)


@pytest.mark.parametrize(
    ("opt_cls", "opts"),
    [(optim.SGD, {"lr": 0.1, "momentum": 0.9}), (optim.Adam, {"lr": 0.05})],
    ids=["sgd-momentum", "adam"],
)
def test_steps_equal_the_local_optimizer(agents, opt_cls, opts):
    # oracle: the whole model in this process
    local = Net()
    local.first.load_state_dict(First().lin.state_dict())
    ref_opt = opt_cls(list(local.parameters()), **opts)
    for step in range(4):
        x, y = _data(step)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(local(Tensor(x)), y).backward()
        ref_opt.step()

    with as_current(agents[0]):
        first = nn.RemoteModule("worker1", First)
        model = Net(remote_first=first)  # its first layer on worker1, the rest here
        local_params = list(model.second.parameters())
        params = first.remote_parameters() + [rpcdist.RRef(p) for p in local_params]
        dopt = optim.DistributedOptimizer(opt_cls, params, **opts)
        for step in range(4):
            x, y = _data(step)
            with dist_autograd.context() as cid:
                loss = nn.functional.cross_entropy(model(Tensor(x)), y)
                dist_autograd.backward(cid, [loss])
                dopt.step(cid)
        remote_state = rpcdist.rpc_sync("worker1", _state_of, args=(first.get_module_rref(),))
        np.testing.assert_allclose(remote_state["weight"], local.first.weight.data, **TOL)
        np.testing.assert_allclose(remote_state["bias"], local.first.bias.data, **TOL)
        np.testing.assert_allclose(model.second.weight.data, local.second.weight.data, **TOL)
        del first, params, dopt


def _state_of(module_rref):
    return {k.removeprefix("lin."): v for k, v in module_rref.local_value().state_dict().items()}


def test_state_dict_round_trip_and_learning_rate_changes(agents):
    with as_current(agents[0]):
        first = nn.RemoteModule("worker1", First)
        params = first.remote_parameters()
        dopt = optim.DistributedOptimizer(optim.SGD, params, lr=0.1, momentum=0.5)
        x, _ = _data(0)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [first(Tensor(x)).sum()])
            dopt.step(cid)
        sd = dopt.state_dict()
        assert sd["owners"] == ["worker1"] and sd["param_groups"][0]["lr"] == 0.1
        saved = {
            i: {k: np.array(v) for k, v in st.items()} for i, st in sd["states"][0]["state"].items()
        }
        assert saved and all("momentum_buffer" in st for st in saved.values())
        # a fresh optimizer, loaded, continues exactly like the first one
        other = optim.DistributedOptimizer(optim.SGD, params, lr=0.7, momentum=0.5)
        other.load_state_dict(sd)
        assert other.param_groups[0]["lr"] == 0.1
        dopt.param_groups[0]["lr"] = 0.0  # a scheduler's change reaches the owner
        before = rpcdist.rpc_sync("worker1", _state_of, args=(first.get_module_rref(),))
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [first(Tensor(x)).sum()])
            dopt.step(cid)
        after = rpcdist.rpc_sync("worker1", _state_of, args=(first.get_module_rref(),))
        # lr 0: only the momentum buffer changed, the weights did not move
        np.testing.assert_array_equal(before["weight"], after["weight"])
        with pytest.raises(ConfigError, match="saved for owners"):
            optim.DistributedOptimizer(
                optim.SGD, [rpcdist.RRef(Tensor(np.ones(2), requires_grad=True))], lr=0.1
            ).load_state_dict(sd)
        del first, params, dopt, other


def test_clip_grad_norm_over_all_owners(agents):
    with as_current(agents[0]):
        a = nn.RemoteModule("worker1", First, kwargs={"seed": 1})
        b = nn.RemoteModule("worker2", First, kwargs={"seed": 2})
        params = a.remote_parameters() + b.remote_parameters()
        dopt = optim.DistributedOptimizer(optim.SGD, params, lr=1.0)
        x, _ = _data(1)
        with dist_autograd.context() as cid:
            loss = (a(Tensor(x)) * 3.0).sum() + (b(Tensor(x)) * 2.0).sum()
            dist_autograd.backward(cid, [loss])
            ga = rpcdist.rpc_sync("worker1", af.grads_of_module, args=(a.get_module_rref(), cid))
            gb = rpcdist.rpc_sync("worker2", af.grads_of_module, args=(b.get_module_rref(), cid))
            expected = np.sqrt(sum(float((g * g).sum()) for g in [*ga, *gb]))
            wa = rpcdist.rpc_sync("worker1", _state_of, args=(a.get_module_rref(),))["weight"]
            total = dopt.clip_grad_norm_(cid, 1.0)
            assert total == pytest.approx(expected, rel=1e-12)
            dopt.step(cid)
        wa2 = rpcdist.rpc_sync("worker1", _state_of, args=(a.get_module_rref(),))["weight"]
        # SGD with lr 1 on clipped gradients: the weight moved by grad * (1 / total norm)
        np.testing.assert_allclose(wa - wa2, ga[0] / (total + 1e-6), rtol=1e-9)
        del a, b, params, dopt


def test_hogwild_trainers_step_one_server_concurrently(agents):
    errors = []

    def trainer(k, first, dopt):
        try:
            with as_current(agents[0]):
                for step in range(5):
                    x, _ = _data(10 * k + step)
                    with dist_autograd.context() as cid:
                        dist_autograd.backward(cid, [(first(Tensor(x)) ** 2).sum()])
                        dopt.step(cid)
        except BaseException as e:
            errors.append(e)

    with as_current(agents[0]):
        first = nn.RemoteModule("worker1", First)
        dopt = optim.DistributedOptimizer(optim.SGD, first.remote_parameters(), lr=0.001)
        threads = [threading.Thread(target=trainer, args=(k, first, dopt)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert all(a.statistics()["autograd_contexts"] == 0 for a in agents[:1])
        w = rpcdist.rpc_sync("worker1", _state_of, args=(first.get_module_rref(),))["weight"]
        assert np.isfinite(w).all()
        del first, dopt


def test_bad_options_fail_at_construction_with_the_owners_error(agents):
    with as_current(agents[0]):
        first = nn.RemoteModule("worker1", First)
        with pytest.raises(ConfigError, match="learning rate") as err:
            optim.DistributedOptimizer(optim.SGD, first.remote_parameters(), lr=-1.0)
        assert "worker1" in err.value.remote_traceback or err.value.remote_traceback
        with pytest.raises(ConfigError, match="empty"):
            optim.DistributedOptimizer(optim.SGD, [], lr=0.1)
        with pytest.raises(ConfigError, match="not an RRef"):
            optim.DistributedOptimizer(optim.SGD, [Tensor(np.ones(2))], lr=0.1)
        with pytest.raises(ConfigError, match="not an rpcdist.nn.Module"):
            nn.RemoteModule("worker1", af.Box)
        del first


def test_a_step_that_fails_on_its_owners_raises_and_the_next_one_works(agents):
    with as_current(agents[0]):
        first = nn.RemoteModule("worker1", First)
        model = Net(remote_first=first)  # owners: worker1 and this worker
        params = first.remote_parameters() + [rpcdist.RRef(p) for p in model.second.parameters()]
        dopt = optim.DistributedOptimizer(optim.SGD, params, lr=0.1)
        before = model.second.weight.data.copy()
        x, y = _data(0)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [nn.functional.cross_entropy(model(Tensor(x)), y)])
            dopt.param_groups[0]["lr"] = "0.1"  # a string: every owner's step fails
            with pytest.raises(TypeError):
                dopt.step(cid)
            assert np.array_equal(model.second.weight.data, before)
            dopt.param_groups[0]["lr"] = 0.1
            dopt.step(cid)  # the owners' locks were let go
        assert not np.array_equal(model.second.weight.data, before)
        del first, params, dopt
