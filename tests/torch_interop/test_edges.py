"""rpcdist.torch's distributed autograd in one process (three agents): the
gradients equal those of the same computation done locally, ``.grad`` is
left alone, failures reach the root, and contexts are freed everywhere."""

from __future__ import annotations

import collections
import pickle
import subprocess
import sys
import threading
import time

import pytest
import tfuncs as tf
import torch
from agent_support import contexts_settled

import rpcdist.torch.autograd as dist_autograd
import rpcdist.torch.rpc as rpc
from rpcdist import (
    AutogradError,
    ConfigError,
    ConnectError,
    RpcOptions,
    SerializationError,
    WorkerLostError,
)
from rpcdist.testing import as_current, local_agents

pytestmark = pytest.mark.torch


@pytest.fixture
def agents():
    tf.PARAMS.clear()
    tf.PARAMS.update({f"worker{i}": tf.param(i) for i in range(3)})
    with local_agents(3, options=RpcOptions(token=None)) as ags:
        yield ags
        assert contexts_settled(ags)


@pytest.fixture(params=["one-node", "device-split"])
def edge(request, monkeypatch):
    """Receive edges as on the CPU (one node) or as on a CUDA device (a device
    node handing the gradient to a CPU node that sends it), here on the CPU."""
    from rpcdist.torch import _edges

    if request.param == "device-split":
        monkeypatch.setattr(_edges, "_on_device_thread", lambda t: True)
    return request.param


@pytest.fixture(params=["engine", "public"])
def engine(request, monkeypatch):
    """Passes through torch's engine entry, or (older torch, where it is
    missing) through ``torch.autograd.backward`` and ``grad``."""
    from rpcdist.torch import _backward

    if request.param == "public":
        monkeypatch.setattr(_backward, "_RUN_ENGINE", None)
    return request.param


def _oracle(x0, names):
    x = x0.detach().clone().requires_grad_()
    ws = {n: tf.PARAMS[n].detach().clone().requires_grad_() for n in names}
    y = x
    for n in names:
        y = torch.tanh(y @ ws[n])
    loss = (y * y).sum()
    loss.backward()
    return x.grad, {n: w.grad for n, w in ws.items()}


def test_remote_layers_and_a_nested_call_give_the_local_gradients(agents, edge, engine):
    x0 = tf.param(9, (2, 3))
    with as_current(agents[0]):
        x = x0.detach().clone().requires_grad_()
        with dist_autograd.context() as cid:
            h = tf.layer(x)  # local layer, worker0
            y = rpc.rpc_sync("worker1", tf.layer_then, args=(h, "worker2"))
            loss = (y * y).sum()
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
            remote = {}
            for w in ("worker1", "worker2"):
                remote.update(rpc.rpc_sync(w, tf.grads_here, args=(cid,)))
        assert x.grad is None and tf.PARAMS["worker0"].grad is None  # the context, not .grad
    want_x, want_w = _oracle(x0, ["worker0", "worker1", "worker2"])
    torch.testing.assert_close(grads[x], want_x)
    torch.testing.assert_close(grads[tf.PARAMS["worker0"]], want_w["worker0"])
    for n in ("worker1", "worker2"):
        torch.testing.assert_close(remote[n], want_w[n])
        assert tf.PARAMS[n].grad is None


def test_two_outputs_of_one_message_and_two_backward_passes_accumulate(agents, edge, engine):
    x0 = tf.param(4, (2, 3))
    with as_current(agents[0]):
        x = x0.detach().clone().requires_grad_()
        with dist_autograd.context() as cid:
            a, b = rpc.rpc_sync("worker1", tf.twice, args=(x,))
            loss = (a * b).sum()
            dist_autograd.backward(cid, [loss], retain_graph=True)
            dist_autograd.backward(cid, [loss])
            gx = dist_autograd.get_gradients(cid)[x]
            gw = rpc.rpc_sync("worker1", tf.grads_here, args=(cid,))["worker1"]
    xl = x0.detach().clone().requires_grad_()
    wl = tf.PARAMS["worker1"].detach().clone().requires_grad_()
    y = torch.tanh(xl @ wl)
    (2 * (y * (y * 2)).sum()).backward()
    torch.testing.assert_close(gx, xl.grad)
    torch.testing.assert_close(gw, wl.grad)


def test_a_failure_on_another_worker_fails_the_backward_at_the_root(agents):
    with as_current(agents[0]):
        x = tf.param(1, (2, 3))
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", tf.explode, args=(x,))
            with pytest.raises(ValueError, match="exploded on purpose") as caught:
                dist_autograd.backward(cid, [y.sum()])
    # torch's wording (a RuntimeError naming the node), the callee's type kept too
    assert isinstance(caught.value, RuntimeError)
    assert str(caught.value).startswith("Error on Node 1: backward exploded on purpose")


@pytest.mark.parametrize("when", ["before the backward", "during its part"])
@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_a_worker_lost_before_or_during_the_backward_fails_it_typed(transport, when):
    tf.PARAMS["worker1"] = tf.param(1)
    tf.STALLED.clear()
    tf.RESUME.clear()
    with local_agents(2, options=RpcOptions(token=None, transport=transport)) as (a, b):
        with as_current(a):
            x = tf.param(9, (2, 3))
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync("worker1", tf.stall, args=(x,))
                if when == "before the backward":
                    b.shutdown(graceful=False)
                    killer = None
                else:  # once worker1 runs its part of the pass
                    killer = threading.Thread(
                        target=lambda: tf.STALLED.wait(30) and b.shutdown(graceful=False)
                    )
                    killer.start()
                start = time.monotonic()
                try:
                    with pytest.raises((WorkerLostError, ConnectError), match="worker1"):
                        dist_autograd.backward(cid, [y.sum()])
                finally:
                    tf.RESUME.set()
                    if killer is not None:
                        killer.join(30)
                assert time.monotonic() - start < 20  # (the call timeout is 30 s)
            assert a.statistics()["autograd_contexts"] == 0


def test_a_gradient_of_the_wrong_shape_is_refused_naming_both_shapes(agents, engine):
    from rpcdist.autograd._extension import ext
    from rpcdist.torch._backward import apply_grad
    from rpcdist.torch._edges import state

    with as_current(agents[0]):
        x = tf.param(2, (2, 3))
        with dist_autograd.context() as cid:
            rpc.rpc_sync("worker1", tf.layer, args=(x,))
            sent = state(ext(agents[1]).context(cid)).sends  # what worker1 sent back
            (message_id,) = sent
            bad = torch.ones(3, dtype=torch.float64)  # would broadcast against (2, 3)
            with pytest.raises(AutogradError, match=r"shape \(3,\) .* shape \(2, 3\)"):
                rpc.rpc_sync("worker1", apply_grad, args=(cid, message_id, 0, bad))
            assert rpc.rpc_sync("worker1", tf.grads_here, args=(cid,)) == {}


def test_roots_are_checked(agents):
    with as_current(agents[0]), dist_autograd.context() as cid:
        with pytest.raises(ValueError, match="does not require grad"):
            dist_autograd.backward(cid, [torch.zeros(())])
        with pytest.raises(ValueError, match="scalars"):
            dist_autograd.backward(cid, [tf.param(0, (2,)) * 2])
        # torch's texts, which programs match
        with pytest.raises(TypeError, match="incompatible function arguments"):
            dist_autograd.backward(cid, None)
        with pytest.raises(TypeError, match="incompatible function arguments"):
            dist_autograd.backward(None, [tf.param(0).sum()])
        with pytest.raises(RuntimeError, match="No tensors provided for gradient computation"):
            dist_autograd.backward(cid, [])
        with pytest.raises(RuntimeError, match="requires_grad not set on"):
            dist_autograd.backward(cid, [torch.zeros(())])
        with pytest.raises(RuntimeError, match="is not a scalar, all roots need to be scalar"):
            dist_autograd.backward(cid, [tf.param(0, (2,)) * 2])
        with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
            dist_autograd.backward(cid, [torch.zeros((), requires_grad=True)])


def test_an_unknown_context_is_refused(agents):
    from rpcdist import AutogradError

    with as_current(agents[0]), pytest.raises(AutogradError, match="does not exist"):
        dist_autograd.get_gradients(12345)


def test_modules_travel_by_class_and_state(agents):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 4, 2)
    x = torch.randn(5, 2, 3)
    with as_current(agents[0]):
        back = rpc.rpc_sync("worker1", _identity, args=(lstm,))
        assert type(back) is torch.nn.LSTM and back is not lstm
        assert [id(w) for w in back._flat_weights] == [id(p) for p in back.parameters()]
        torch.testing.assert_close(back(x)[0], lstm(x)[0])
        with pytest.raises(SerializationError, match="lambda"):
            rpc.rpc_sync("worker1", _identity, args=(tf.WithLambdaHook(),))


def _identity(x):
    return x


def test_async_execution_may_return_a_torch_future(agents):
    with as_current(agents[0]):
        got = rpc.rpc_sync("worker1", tf.later, args=(torch.ones(2),))
        fut = rpc.rpc_async("worker2", tf.later, args=(torch.ones(2),))
        assert rpc.get_worker_info().name == "worker0"
    torch.testing.assert_close(got, torch.full((2,), 3.0))
    torch.testing.assert_close(fut.wait(), torch.full((2,), 3.0))


def test_rpc_timeout_reads_as_torch_does(agents):
    with as_current(agents[0]):
        assert rpc.get_rpc_timeout() == 30.0 and rpc.is_available()


def test_torch_timeouts_map_to_rpcdist():
    from rpcdist import UNSET
    from rpcdist.torch._rpc import _timeout

    assert _timeout(-1.0) is UNSET and _timeout(0) is None and _timeout(2) == 2.0


def test_import_rpcdist_never_imports_torch():
    code = (
        "import sys, rpcdist, rpcdist.torch; import rpcdist.autograd; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("owner", ["worker1", "worker0"])
def test_rref_backward_runs_the_pass_from_a_torch_loss_where_it_lives(agents, owner):
    x0 = tf.param(11, (2, 3))
    with as_current(agents[0]):
        x = x0.detach().clone().requires_grad_()
        with dist_autograd.context() as cid:
            # worker0's layer, then the loss on ``owner`` (itself, or another worker)
            loss = rpc.remote(owner, tf.layer_loss, args=(tf.layer(x),))
            loss.backward(cid)
            grads = dist_autograd.get_gradients(cid)
            remote = rpc.rpc_sync(owner, tf.grads_here, args=(cid,))
            del loss
    xo = x0.detach().clone().requires_grad_()
    ws = {n: tf.PARAMS[n].detach().clone().requires_grad_() for n in ("worker0", owner)}
    h = torch.tanh(xo @ ws["worker0"])
    (torch.tanh(h @ ws[owner]) ** 2).sum().backward()
    torch.testing.assert_close(grads[x], xo.grad)
    torch.testing.assert_close(remote[owner], ws[owner].grad)
    if owner == "worker1":
        torch.testing.assert_close(grads[tf.PARAMS["worker0"]], ws["worker0"].grad)


def test_rpcdist_init_rpc_with_only_the_autograd_module_still_records_edges():
    # A program on rpcdist's own init_rpc that imports rpcdist.torch.autograd
    # but never rpcdist.torch.rpc: its tensors crossed as new leaves before,
    # and the backward silently stopped at the worker boundary.
    code = """
import sys, torch, rpcdist
import rpcdist.torch.autograd as dist_autograd
from rpcdist.testing import as_current, local_agents
W = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
def layer(x):
    return torch.tanh(x @ W)
with local_agents(2, options=rpcdist.RpcOptions(token=None, transport="inproc")) as ags:
    with as_current(ags[0]):
        x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpcdist.rpc_sync(1, layer, args=(x,))
            dist_autograd.backward(cid, [(y * y).sum()])
            got = dist_autograd.get_gradients(cid)[x]
xo = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
(layer(xo) ** 2).sum().backward()
torch.testing.assert_close(got, xo.grad)
assert "rpcdist.torch.rpc" not in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_a_remote_module_over_a_module_already_in_an_rref(agents):
    # torch's RemoteModule.init_from_module_rref: load a part where it will
    # run (rpc.remote), then drive it as a RemoteModule
    from rpcdist.torch.nn import RemoteModule

    with as_current(agents[0]):
        torch.manual_seed(0)
        rref = rpc.remote("worker1", torch.nn.Linear, args=(3, 2))
        local = rref.to_here()
        x = torch.randn(4, 3)
        for device in ("worker1", "worker1/cpu", "rank:1/cpu"):
            rm = RemoteModule.init_from_module_rref(device, rref)
            assert rm.get_module_rref() is rref
            torch.testing.assert_close(rm(x), local(x))
        assert len(rm.remote_parameters()) == 2
        # made on the owner and sent back, as torch's docs show
        there = rpc.rpc_sync("worker1", RemoteModule.init_from_module_rref, args=("worker1", rref))
        torch.testing.assert_close(there.forward_async(x).wait(), local(x))
        # as torch's: calls go to the module's owner whatever remote_device names
        elsewhere = RemoteModule.init_from_module_rref("worker2", rref)
        assert elsewhere.owner.name == "worker1"
        with pytest.raises(ConfigError, match="expected an RRef"):
            RemoteModule.init_from_module_rref("worker1", local)


def _remote_linear():
    """A RemoteModule of a Linear(3, 2) on worker1, a local copy of it, an input."""
    from rpcdist.torch.nn import RemoteModule

    torch.manual_seed(0)
    rm = RemoteModule("worker1", torch.nn.Linear, args=(3, 2))
    return rm, rm.get_module_rref().to_here(), torch.randn(4, 3)


def test_a_remote_module_is_an_nn_module_here_with_no_tensors_of_its_own(agents):
    from rpcdist.torch.nn import RemoteModule

    with as_current(agents[0]):
        rm, local, x = _remote_linear()
        model = torch.nn.Sequential(rm, torch.nn.ReLU(), torch.nn.Linear(2, 1))
        assert isinstance(rm, torch.nn.Module)
        torch.testing.assert_close(model(x), model[2](torch.relu(local(x))))
        # a model holding one lists (and moves, and trains) only its local part
        assert [p.shape for p in model.parameters()] == [(1, 2), (1,)]
        model.train(False)
        assert model(x).shape == (4, 1)
        refusals = (
            "to",
            "parameters",
            "state_dict",
            "zero_grad",
            "cuda",
            "modules",
            "named_modules",
            "children",
            "extra_repr",
        )
        with pytest.raises(
            ValueError, match=r"not supported for RemoteModule\. Please use ``remote_parameters``"
        ):
            rm.parameters()
        for refused in refusals:
            with pytest.raises(ValueError, match=f"{refused}`` not supported for RemoteModule"):
                list(getattr(rm, refused)() or ())  # (parameters() is lazy)
        assert len(list(model.modules())) == 4  # a model's own walk still passes it
        # training mode is the module's, on its owner (model.train(False) above reached it)
        owner_mode = rpc.rpc_sync("worker1", tf.training_mode, args=(rm.get_module_rref(),))
        assert owner_mode is False and not rm.training
        rm.train()
        assert rpc.rpc_sync("worker1", tf.training_mode, args=(rm.get_module_rref(),))
        assert rm.training
        rm.eval()
        assert not rpc.rpc_sync("worker1", tf.training_mode, args=(rm.get_module_rref(),))
        with pytest.raises(RuntimeError, match="Cannot pickle RemoteModule in python pickler"):
            pickle.dumps(rm)
        with pytest.raises(ValueError, match=r"returns an instance of <class nn.Module>"):
            RemoteModule("worker1", collections.OrderedDict)
        # sent to another worker, it is one there too
        back = rpc.rpc_sync("worker2", tf.echo_kind, args=(rm,))
        assert back == "RemoteModule is an nn.Module"


def test_a_remote_module_sent_to_a_third_worker_keeps_torchs_public_state(agents):
    with as_current(agents[0]):
        rm, local, x = _remote_linear()
        want = {
            "on": "worker1",
            "device": "cpu",
            "is_device_map_set": False,
            "is_scriptable": False,
            "owner": "worker1",
        }
        assert tf.public_state(rm) == want
        assert rpc.rpc_sync("worker2", tf.public_state, args=(rm,)) == want
        sync, fut = rpc.rpc_sync("worker2", tf.forward_there, args=(rm, x))
        torch.testing.assert_close(sync, local(x))
        torch.testing.assert_close(fut, local(x))


def test_to_here_before_the_value_is_made_fetches_it_inside_the_context(agents):
    # Regression: a remote() made outside any autograd context replies with an
    # early copy of a small value (encoded with no context, so no edges); a
    # to_here() issued inside a context before that reply took the copy, and
    # no gradient reached the owner's parameter. It must fetch in its context.
    x = tf.param(5, (2, 3)).detach()
    tf.CREATION_GATE.clear()
    with as_current(agents[0]):
        try:
            rref = rpc.remote("worker1", tf.layer_when_released, args=(x,))
            with dist_autograd.context() as cid:
                fut = rref.to_here_async()  # (to_here() waits on this)
                assert not fut.done()  # the owner is still making the value
                tf.CREATION_GATE.set()
                y = fut.wait()
                assert y.requires_grad
                dist_autograd.backward(cid, [(y * y).sum()])
                remote = rpc.rpc_sync("worker1", tf.grads_here, args=(cid,))
        finally:
            tf.CREATION_GATE.set()
    _, want_w = _oracle(x, ["worker1"])
    assert "worker1" in remote, "no gradient reached the owner"
    torch.testing.assert_close(remote["worker1"], want_w["worker1"])


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_a_programs_except_runtime_error_catches_timeouts_and_lost_workers(transport):
    # (what PyTorch RPC programs write around their calls; torch raises RuntimeError)
    caught = []
    with local_agents(2, options=RpcOptions(token=None, transport=transport)) as (a, b):
        with as_current(a):
            try:
                rpc.rpc_sync("worker1", time.sleep, args=(1,), timeout=0.1)
            except RuntimeError as e:
                caught.append(type(e).__name__)
            b.shutdown(graceful=False)
            try:
                rpc.rpc_async("worker1", max, args=(1, 2)).wait()
            except RuntimeError as e:
                caught.append(type(e).__name__)
    assert caught[0] == "RpcTimeoutError"
    assert caught[1] in ("WorkerLostError", "ConnectError")


def _udf_with_ops() -> None:
    with torch.autograd.profiler.record_function("##forward##"):
        t = torch.add(torch.ones(1), torch.ones(1))
        torch.mul(t, t).relu()


def test_torchs_legacy_profiler_records_each_call_and_the_callees_events(agents):
    from torch.autograd.profiler_legacy import profile

    with as_current(agents[0]):
        with profile(record_shapes=True) as prof:
            rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
            fut = rpc.rpc_async("worker2", _udf_with_ops)
            fut.wait()
            rref = rpc.remote("worker1", torch.ones, args=(2,))
            rref.to_here()
            rref._get_profiling_future().wait()
        del rref
    events = prof.function_events
    # (PyTorch's tests take the first event naming the call: its own range)
    assert not next(e for e in events if "rpc_sync" in e.name).is_remote
    local = {e.name for e in events if "#" in e.name and not e.is_remote}
    assert local == {
        "rpc_sync#aten::add(worker0 -> worker1)",
        "rpc_async#_udf_with_ops(worker0 -> worker2)",
        "rpc_remote#aten::ones(worker0 -> worker1)",
    }
    remote = {e.name: e for e in events if e.is_remote}
    key = "rpc_async#_udf_with_ops(worker0 -> worker2)#remote_op: "
    for op in ("##forward##", "aten::add", "aten::mul", "aten::relu"):
        assert remote[key + op].node_id == 2
    assert "rpc_sync#aten::add(worker0 -> worker1)#remote_op: aten::add" in remote
    assert "rpc_remote#aten::ones(worker0 -> worker1)#remote_op: aten::ones" in remote
    # the callee ran with the caller's settings (shapes), its ranges nested as there
    add = remote["rpc_sync#aten::add(worker0 -> worker1)#remote_op: aten::add"]
    assert add.input_shapes[0] == [2]
    forward = remote[key + "##forward##"]
    assert {key + "aten::add", key + "aten::mul"} <= {c.name for c in forward.cpu_children}


def test_remote_to_itself_is_profiled_once_the_value_is_made(agents):
    from torch.autograd.profiler_legacy import profile

    with as_current(agents[0]):
        with profile() as prof:
            rref = rpc.remote("worker0", _udf_with_ops)
            rref._get_profiling_future().wait()
        del rref
    key = "rpc_remote#_udf_with_ops(worker0 -> worker0)#remote_op: "
    remote = {e.name for e in prof.function_events if e.is_remote}
    assert {key + "##forward##", key + "aten::mul"} <= remote


@rpc.functions.async_execution
def _async_add(to, x, y):
    return rpc.rpc_async(to, torch.add, args=(x, y))


def test_an_async_execution_functions_calls_are_profiled_on_each_worker(agents):
    from torch.autograd.profiler_legacy import profile

    with as_current(agents[0]):
        with profile() as prof:
            fut = rpc.rpc_async("worker1", _async_add, args=("worker2", torch.ones(2), 1))
            assert torch.equal(fut.wait(), torch.full((2,), 2.0))
    remote = {e.name: e.node_id for e in prof.function_events if e.is_remote}
    outer = "rpc_async#_async_add(worker0 -> worker1)#remote_op: "
    nested = outer + "rpc_async#aten::add(worker1 -> worker2)"
    assert remote[nested] == 1
    assert remote[nested + "#remote_op: aten::add"] == 2


def test_a_record_function_range_ends_with_an_rpc_future_once(agents):
    from torch.autograd.profiler_legacy import profile

    with as_current(agents[0]):
        with profile() as prof:
            with torch.autograd.profiler.record_function("foo") as rf:
                fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
                ended = rf._call_end_callbacks_on_future(fut)
                with pytest.raises(RuntimeError, match="can only be called once"):
                    rf._call_end_callbacks_on_future(fut)
            assert torch.equal(ended.wait(), torch.full((2,), 2.0))
    assert [e.name for e in prof.function_events if e.name == "foo"] == ["foo"]


def test_rpc_calls_are_not_profiled_under_kineto_as_in_pytorch(agents):
    with as_current(agents[0]):
        with torch.profiler.profile() as prof:
            rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    assert not [e for e in prof.events() if "rpc_sync" in e.name]


def _sparse(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    i = torch.tensor([[0, 1, 2], [2, 0, 1]])
    v = torch.randn(3, generator=g, dtype=torch.float64)
    return torch.sparse_coo_tensor(i, v, (3, 3)).coalesce().requires_grad_()


def test_sparse_tensors_that_require_grad_cross_workers_with_their_edges(agents):
    # (an embedding's sparse weights or gradients: PyTorch records their edges too)
    with as_current(agents[0]):
        t1, t2 = _sparse(1), _sparse(2)
        with dist_autograd.context() as cid:
            ret = rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
            assert ret.is_sparse and ret.requires_grad
            loss = torch.sparse.sum(torch.mul(ret, ret))
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
        a, b = _sparse(1), _sparse(2)
        torch.sparse.sum(torch.mul(a + b, a + b)).backward()
        assert torch.equal(grads[t1].to_dense(), a.grad.to_dense())
        assert torch.equal(grads[t2].to_dense(), b.grad.to_dense())
