"""Distributed autograd: gradients across workers equal the one-worker oracle.

Three in-process agents; every forward piece runs through real calls (the
default socket transport). The oracle recomputes the same function locally
with the same parameter values (float64) and the local engine.
"""

from __future__ import annotations

import gc
import threading
import time
import types

import ad_funcs as af
import numpy as np
import pytest
from agent_support import contexts_settled

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist import AutogradError, ConfigError, RpcOptions
from rpcdist import tensor as rt
from rpcdist.tensor import Tensor
from rpcdist.testing import as_current, local_agents

TOL = dict(rtol=1e-12, atol=1e-12)


def _w(shape=(3,), seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


@pytest.fixture
def agents():
    af.PARAMS.clear()
    with local_agents(3, options=RpcOptions(token=None, control_retry_interval=0.2)) as ags:
        yield ags
        assert contexts_settled(ags), [a.statistics()["autograd_contexts"] for a in ags]


def _remote_grads(worker, cid):
    return rpcdist.rpc_sync(worker, af.grads_here, args=(cid,))


def test_a_call_to_a_parameter_server_and_back(agents):
    x0 = np.random.default_rng(9).standard_normal(3)
    with as_current(agents[0]):
        x = Tensor(x0.copy(), requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpcdist.rpc_sync("worker1", af.scale, args=(x,))
            loss = (y * y).sum()
            dist_autograd.backward(cid, [loss])
            gx = dist_autograd.get_gradients(cid)[x]
            gw = _remote_grads("worker1", cid)["w"]
            assert x.grad is None  # never into .grad
    # oracle
    xo, wo = Tensor(x0.copy(), requires_grad=True), _w()
    ((xo * wo) * (xo * wo)).sum().backward()
    np.testing.assert_allclose(gx, xo.grad.data, **TOL)
    np.testing.assert_allclose(gw, wo.grad.data, **TOL)


def test_chain_a_b_c_a_with_nested_calls(agents):
    x0 = np.arange(1.0, 4.0)
    with as_current(agents[0]):
        x = Tensor(x0.copy(), requires_grad=True)
        with dist_autograd.context() as cid:
            r = rpcdist.rpc_sync("worker1", af.chain, args=(x, ["worker2", "worker0"]))
            loss = (r * x).sum()
            dist_autograd.backward(cid, [loss])
            got = {
                "x": dist_autograd.get_gradients(cid)[x],
                "w1": _remote_grads("worker1", cid)["w"],
                "w2": _remote_grads("worker2", cid)["w"],
                "w0": _remote_grads("worker0", cid)["w"],
            }
    xo = Tensor(x0.copy(), requires_grad=True)
    w1, w2, w0 = _w(seed=2), _w(seed=1), _w(seed=0)
    r = rt.tanh(((xo * w1) * w2) * w0)
    (r * xo).sum().backward()
    for name, t in {"x": xo, "w1": w1, "w2": w2, "w0": w0}.items():
        np.testing.assert_allclose(got[name], t.grad.data, **TOL, err_msg=name)


def test_a_pipeline_of_linear_stages_equals_the_oracle(agents):
    """Each stage answers upstream before its parameters' gradients (the
    engine defers them); the gradients are still exact, twice in a row."""
    from rpcdist.nn import functional as F

    x0 = np.random.default_rng(3).standard_normal((5, 4))
    got = []
    with as_current(agents[0]):
        x = Tensor(x0.copy(), requires_grad=True)
        for _ in range(2):
            with dist_autograd.context() as cid:
                y = rpcdist.rpc_sync("worker1", af.linear_stage, args=(x, ["worker2"]))
                dist_autograd.backward(cid, [(y * x).sum()])
                got.append(
                    {
                        "x": dist_autograd.get_gradients(cid)[x],
                        **{f"{n}1": g for n, g in _remote_grads("worker1", cid).items()},
                        **{f"{n}2": g for n, g in _remote_grads("worker2", cid).items()},
                    }
                )
    xo = Tensor(x0.copy(), requires_grad=True)
    p = {
        f"{n}{w}": _w(shape, seed=s + k)
        for w, k in (("1", 1), ("2", 0))
        for n, shape, s in (("W", (4, 4), 10), ("b", (4,), 20))
    }
    h = rt.tanh(F.linear(xo, p["W1"], p["b1"]))
    (rt.tanh(F.linear(h, p["W2"], p["b2"])) * xo).sum().backward()
    expected = {"x": xo.grad.data, **{n: t.grad.data for n, t in p.items()}}
    for run in got:
        assert set(run) == set(expected)
        for name, g in expected.items():
            np.testing.assert_allclose(run[name], g, **TOL, err_msg=name)


def test_an_lstm_between_two_parameter_servers_equals_the_oracle(agents):
    """The rnn workload's shape: an embedding on one server, an LSTM here, a
    decoder on another. The LSTM sends the embedding's gradient before it
    computes its weights' (the engine splits its node); every gradient is
    exact, twice in a row."""
    from rpcdist import nn
    from rpcdist.nn import functional as F

    tokens = np.random.default_rng(4).integers(0, 7, (5, 2))

    def lstm() -> nn.LSTM:
        return nn.LSTM(3, 4, num_layers=2, dtype=np.float64, generator=rt.Generator(0))

    got = []
    with as_current(agents[0]):
        mine = lstm()
        for _ in range(2):
            with dist_autograd.context() as cid:
                emb = rpcdist.rpc_sync("worker1", af.embed, args=(tokens,))
                out, _ = mine(emb)
                logits = rpcdist.rpc_sync("worker2", af.decode, args=(out,))
                dist_autograd.backward(cid, [(logits * logits).sum()])
                here = dist_autograd.get_gradients(cid)
                got.append(
                    {
                        **{n: here[p] for n, p in mine.named_parameters()},
                        **_remote_grads("worker1", cid),
                        **_remote_grads("worker2", cid),
                    }
                )
    oracle = lstm()
    p = {"E": _w((7, 3), 30), "D": _w((5, 4), 31), "d": _w((5,), 32)}
    out, _ = oracle(F.embedding(tokens, p["E"]))
    (F.linear(out, p["D"], p["d"]) ** 2).sum().backward()
    expected = {
        **{n: t.grad.data for n, t in oracle.named_parameters()},
        **{n: t.grad.data for n, t in p.items()},
    }
    for run in got:
        assert set(run) == set(expected)
        for name, g in expected.items():
            np.testing.assert_allclose(run[name], g, **TOL, err_msg=name)


def test_fan_out_same_tensor_twice_and_async_paths(agents):
    x0 = np.array([0.5, -1.0, 2.0])

    def forward(x):
        a = rpcdist.rpc_async("worker1", af.scale, args=(x,))
        b = rpcdist.rpc_async("worker2", af.tanh_scale, args=(x,))
        c = rpcdist.rpc_sync("worker1", af.mul, args=(x, x))  # one tensor twice in a message
        d = rpcdist.rpc_sync("worker2", af.scale_later, args=(x,))  # @async_execution
        return (a.wait() + b.wait() + c + d).sum()

    with as_current(agents[0]):
        x = Tensor(x0.copy(), requires_grad=True)
        with dist_autograd.context() as cid:
            loss = forward(x)
            dist_autograd.backward(cid, [loss])
            gx = dist_autograd.get_gradients(cid)[x]
            g1, g2 = _remote_grads("worker1", cid), _remote_grads("worker2", cid)
    xo = Tensor(x0.copy(), requires_grad=True)
    w1, w2, v2 = _w(), _w(), _w(seed=1)
    (xo * w1 + rt.tanh(xo) * v2 + xo * xo + xo * w2).sum().backward()
    np.testing.assert_allclose(gx, xo.grad.data, **TOL)
    np.testing.assert_allclose(g1["w"], w1.grad.data, **TOL)
    np.testing.assert_allclose(g2["w"], w2.grad.data, **TOL)
    np.testing.assert_allclose(g2["v"], v2.grad.data, **TOL)


def test_the_context_follows_into_coroutines_and_gather(agents):
    import asyncio

    x0 = np.array([1.0, 2.0, 3.0])
    with as_current(agents[0]):
        x = Tensor(x0.copy(), requires_grad=True)
        with dist_autograd.context() as cid:

            async def forward():
                ys = await asyncio.gather(
                    rpcdist.rpc_async("worker1", af.scale, args=(x,)),
                    rpcdist.rpc_async("worker2", af.scale_async, args=(x,)),  # async def callee
                )
                return (ys[0] * ys[1]).sum()

            loss = asyncio.run(forward())
            dist_autograd.backward(cid, [loss])
            gx = dist_autograd.get_gradients(cid)[x]
    xo, w1, w2 = Tensor(x0.copy(), requires_grad=True), _w(), _w()
    ((xo * w1) * (xo * w2)).sum().backward()
    np.testing.assert_allclose(gx, xo.grad.data, **TOL)


def test_plain_inputs_still_carry_the_context_for_the_reply(agents):
    with as_current(agents[0]):
        with dist_autograd.context() as cid:
            out = rpcdist.rpc_sync("worker1", af.plain_forward, args=(np.ones(3),))
            assert out.requires_grad and not out.is_leaf
            dist_autograd.backward(cid, [(out * out).sum()])
            gm = _remote_grads("worker1", cid)["m"]
    m = _w((3, 2), seed=5)
    ((Tensor(np.ones(3)) @ m) ** 2).sum().backward()
    np.testing.assert_allclose(gm, m.grad.data, **TOL)


def test_calls_outside_a_context_create_nothing(agents):
    with as_current(agents[0]):
        x = Tensor(np.ones(3), requires_grad=True)
        y = rpcdist.rpc_sync("worker1", af.scale, args=(x,))
        assert y.is_leaf and y.requires_grad  # a plain tensor, no edge back
    assert all(a.statistics()["autograd_contexts"] == 0 for a in agents)


def test_rref_held_values_proxies_remote_and_to_here(agents):
    x0 = np.array([1.0, -2.0, 0.5])
    with as_current(agents[0]):
        x = Tensor(x0.copy(), requires_grad=True)
        with dist_autograd.context() as cid:
            box = rpcdist.remote("worker1", af.Box)
            y1 = box.rpc_sync().forward(x)
            y2 = box.rpc_async().forward(x).wait()
            y3 = box.remote().forward(x).to_here()
            made = rpcdist.remote("worker2", af.scale, args=(x,))
            y4 = made.to_here()
            loss = (y1 + y2 * y3 + y4).sum()
            dist_autograd.backward(cid, [loss])
            gx = dist_autograd.get_gradients(cid)[x]
            gbox = box.rpc_sync().grad(cid)
            g2 = _remote_grads("worker2", cid)["w"]
        del box, made
    xo, bw, w2 = (
        Tensor(x0.copy(), requires_grad=True),
        Tensor(np.arange(1.0, 4.0), requires_grad=True),
        _w(),
    )
    (xo * bw + (xo * bw) * (xo * bw) + xo * w2).sum().backward()
    np.testing.assert_allclose(gx, xo.grad.data, **TOL)
    np.testing.assert_allclose(gbox, bw.grad.data, **TOL)
    np.testing.assert_allclose(g2, w2.grad.data, **TOL)


def test_several_roots_and_retain_graph_accumulates(agents):
    with as_current(agents[0]):
        x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpcdist.rpc_sync("worker1", af.scale, args=(x,))
            l1, l2 = y.sum(), (y * y).sum()
            dist_autograd.backward(cid, [l1, l2], retain_graph=True)
            once = _remote_grads("worker1", cid)["w"].copy()
            dist_autograd.backward(cid, [l1, l2])
            twice = _remote_grads("worker1", cid)["w"]
            np.testing.assert_allclose(twice, 2 * once, **TOL)
            with pytest.raises(AutogradError, match="freed"):
                dist_autograd.backward(cid, [l1])
    w = _w()
    yo = Tensor(np.array([1.0, 2.0, 3.0])) * w
    (yo.sum() + (yo * yo).sum()).backward()
    np.testing.assert_allclose(once, w.grad.data, **TOL)


def test_an_output_that_never_reaches_the_loss_does_not_hang(agents):
    """Two sends from worker1 share the node h; only the first reaches the loss.
    PyTorch's FAST mode waits for the second forever."""
    x0 = np.array([1.0, 2.0, -1.0])
    with as_current(agents[0]):
        x = Tensor(x0.copy(), requires_grad=True)
        with dist_autograd.context() as cid:
            a = rpcdist.rpc_sync("worker1", af.first_half, args=(x,))
            b = rpcdist.rpc_sync("worker1", af.second_half)  # unused
            assert b.requires_grad
            dist_autograd.backward(cid, [(a * a).sum()])
            gx = dist_autograd.get_gradients(cid)[x]
            gw = _remote_grads("worker1", cid)["w"]
    xo, w = Tensor(x0.copy(), requires_grad=True), _w()
    a = (xo * w) * 2.0
    (a * a).sum().backward()
    np.testing.assert_allclose(gx, xo.grad.data, **TOL)
    np.testing.assert_allclose(gw, w.grad.data, **TOL)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("use_second", [False, True])
def test_two_sends_from_the_root_sharing_a_node(agents, use_second):
    """The root sends ``h`` and ``h * 3`` (one node below both) to worker1.
    Without the second result in the loss, PyTorch's FAST mode waits at h
    for the second send's gradient forever. Here the root asks worker1
    whether that send's receive function is reached; worker1 asks back about
    the reply it sent from it, which the root's loss reaches or not."""
    x0 = np.array([0.5, -1.0, 2.0])
    with as_current(agents[0]):
        x = Tensor(x0.copy(), requires_grad=True)
        with dist_autograd.context() as cid:
            h = x * 2.0
            a = rpcdist.rpc_sync("worker1", af.scale, args=(h,))
            b = rpcdist.rpc_sync("worker1", af.scale, args=(h * 3.0,))
            loss = (a * a).sum() + b.sum() if use_second else (a * a).sum()
            dist_autograd.backward(cid, [loss])
            gx = dist_autograd.get_gradients(cid)[x]
            gw = _remote_grads("worker1", cid)["w"]
    xo, w = Tensor(x0.copy(), requires_grad=True), _w()
    ho = xo * 2.0
    ao, bo = ho * w, (ho * 3.0) * w
    ((ao * ao).sum() + bo.sum() if use_second else (ao * ao).sum()).backward()
    np.testing.assert_allclose(gx, xo.grad.data, **TOL)
    np.testing.assert_allclose(gw, w.grad.data, **TOL)


def test_two_contexts_on_two_threads_keep_separate_gradients(agents):
    results = {}

    def train(k):
        with as_current(agents[0]):
            x = Tensor(np.full(3, float(k)), requires_grad=True)
            with dist_autograd.context() as cid:
                y = rpcdist.rpc_sync("worker1", af.scale, args=(x,))
                dist_autograd.backward(cid, [(y * k).sum()])
                results[k] = _remote_grads("worker1", cid)["w"]

    threads = [threading.Thread(target=train, args=(k,)) for k in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for k in (1, 2, 3, 4):
        np.testing.assert_allclose(results[k], np.full(3, float(k * k)), **TOL)


def test_an_error_in_a_remote_backward_fails_at_the_root_naming_the_worker(agents):
    with as_current(agents[0]):
        x = Tensor(np.ones(3), requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpcdist.rpc_sync("worker2", af.explode, args=(x,))
            with pytest.raises(AutogradError, match="worker2") as err:
                dist_autograd.backward(cid, [y.sum()])
            assert "exploded in backward" in str(err.value)
            assert "exploded in backward" in err.value.remote_traceback


def test_misuse_is_a_clear_error(agents):
    with as_current(agents[0]):
        with pytest.raises(AutogradError, match="does not exist"):
            dist_autograd.get_gradients(12345)
        with dist_autograd.context() as cid:
            with pytest.raises(ConfigError, match="scalars"):
                dist_autograd.backward(cid, [Tensor(np.ones(3), requires_grad=True) * 2])
            with pytest.raises(ConfigError, match="does not require grad"):
                dist_autograd.backward(cid, [Tensor(np.ones(()))])
        with pytest.raises(AutogradError, match="does not exist"):
            dist_autograd.backward(cid, [Tensor(np.ones(()), requires_grad=True) * 2])


def test_rref_backward_runs_on_the_owner(agents):
    with as_current(agents[0]):
        x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
        with dist_autograd.context() as cid:
            loss = rpcdist.remote("worker1", af.loss_here, args=(x,))
            loss.backward(cid)
            gx = dist_autograd.get_gradients(cid)[x]
            gw = _remote_grads("worker1", cid)["w"]
            del loss
    xo, w = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True), _w()
    (xo * w).sum().backward()
    np.testing.assert_allclose(gx, xo.grad.data, **TOL)
    np.testing.assert_allclose(gw, w.grad.data, **TOL)


def _rpcdist_garbage(run) -> list[str]:
    """rpcdist's objects that ``run()`` left in reference cycles (freed only
    when the garbage collector runs, not when their last reference goes)."""

    def ours(o: object) -> bool:
        mod = o.__module__ if isinstance(o, types.FunctionType) else type(o).__module__
        return isinstance(mod, str) and mod.startswith("rpcdist")

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # the collector keeps what it finds in gc.garbage
    try:
        run()
        gc.collect()
        found = {getattr(o, "__qualname__", type(o).__qualname__) for o in gc.garbage if ours(o)}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return sorted(found)


def test_a_pass_leaves_no_reference_cycles_behind(agents):
    # A cycle through the pass state or a call's wire context would keep the
    # graph, and every array it saved, alive after the pass until the
    # collector next ran: memory the user cannot free.
    with as_current(agents[0]):
        x = Tensor(np.ones(3), requires_grad=True)

        def iterations() -> None:
            for _ in range(3):
                with dist_autograd.context() as cid:
                    y = rpcdist.rpc_sync("worker1", af.chain, args=(x, ["worker2"]))
                    dist_autograd.backward(cid, [y.sum()])
                with dist_autograd.context() as cid:
                    loss = rpcdist.remote("worker1", af.loss_here, args=(x,))
                    loss.backward(cid)  # (the RRef goes back to its owner)
                    del loss
            assert contexts_settled(agents)

        iterations()  # (state made once, on first use, is not garbage)
        assert _rpcdist_garbage(iterations) == []


@pytest.mark.parametrize("retain", [False, True])
def test_a_released_context_frees_what_its_pass_held_without_the_collector(agents, retain):
    # What the graph kept alive (here a weight made on worker1 for one call)
    # goes when the context is released, by reference counting alone.
    af.MADE.clear()
    with as_current(agents[0]):
        x = Tensor(np.ones((2, 4)), requires_grad=True)
        gc.collect()
        gc.disable()
        try:
            with dist_autograd.context() as cid:
                y = rpcdist.rpc_sync("worker1", af.fresh_weight, args=(x,))
                dist_autograd.backward(cid, [y.sum()], retain_graph=retain)
                del y
            deadline = time.monotonic() + 10
            while any(a.statistics()["autograd_contexts"] for a in agents):
                assert time.monotonic() < deadline, "contexts were not released"
                time.sleep(0.01)
            assert len(af.MADE) == 1 and af.MADE[0]() is None
        finally:
            gc.enable()


def test_contexts_are_released_everywhere_and_counted(agents):
    with as_current(agents[0]):
        x = Tensor(np.ones(3), requires_grad=True)
        for _ in range(20):
            with dist_autograd.context() as cid:
                y = rpcdist.rpc_sync("worker1", af.chain, args=(x, ["worker2"]))
                dist_autograd.backward(cid, [y.sum()])
        assert dist_autograd.statistics()["contexts"] == 0
    assert contexts_settled(agents)
    assert sum(a.statistics()["autograd_released"] for a in agents) >= 60
