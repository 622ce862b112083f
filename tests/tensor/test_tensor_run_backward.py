"""The engine's low-level entry point, as distributed autograd will drive it."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import AutogradError
from rpcdist.tensor import (
    AccumulateGrad,
    GraphTask,
    Node,
    RecvFunction,
    SendFunction,
    Tensor,
    compute_dependencies,
    run_backward,
    tensor_roots,
)


def node_of(t: Tensor) -> Node:
    edge = t.gradient_edge()
    assert edge is not None
    return edge[0]


def test_grad_map_instead_of_grad() -> None:
    w = rt.tensor([1.0, 2.0], requires_grad=True)
    fired: list[str] = []
    w.register_hook(lambda g: fired.append("pre"))
    w.register_post_accumulate_grad_hook(lambda t: fired.append("post"))
    loss = (w * w + w).sum()
    grads: dict[Tensor, Any] = {}
    run_backward(tensor_roots([loss]), grad_map=grads)
    assert w.grad is None
    np.testing.assert_allclose(grads[w], [3.0, 5.0])
    assert fired == ["pre"]  # post-accumulate hooks are for .grad only


def test_grad_map_sums_over_runs() -> None:
    w = rt.tensor([1.0, 2.0], requires_grad=True)
    grads: dict[Tensor, Any] = {}
    for _ in range(3):
        run_backward(tensor_roots([(w * 2).sum()]), grad_map=grads)
    np.testing.assert_allclose(grads[w], [6.0, 6.0])


def test_extra_start_nodes_hold_back_shared_leaves() -> None:
    """FAST mode: a leaf reached from a send function waits for its gradient."""
    w = rt.tensor([1.0, 2.0], requires_grad=True)
    sent = w * 3  # this tensor "left the worker"
    send = SendFunction([sent])
    loss = (w * w).sum()
    grads: dict[Tensor, Any] = {}
    task = run_backward(tensor_roots([loss]), extra_start_nodes=[send], grad_map=grads)
    assert w not in grads  # the accumulator still waits for the send path
    assert any(isinstance(n, AccumulateGrad) for n in task.pending())
    task.execute([(send, [np.array([10.0, 20.0])])])
    np.testing.assert_allclose(grads[w], 2 * np.array([1.0, 2.0]) + 3 * np.array([10.0, 20.0]))
    assert task.pending() == []


def test_dependencies_count_every_start_node() -> None:
    w = rt.tensor([1.0], requires_grad=True)
    a = w * 2
    send = SendFunction([a, w])
    loss = (a + w).sum()
    deps = compute_dependencies([node_of(loss), send])
    acc = node_of(w)
    assert deps[acc] == 3  # from Mul(a), Add(loss) and the send function
    assert deps[node_of(a)] == 2
    assert deps[send] == 0


def test_recv_nodes_go_to_the_callback() -> None:
    recv = RecvFunction(2)
    a, b = recv.make_outputs([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
    assert a.requires_grad and a.grad_fn is recv and b.output_nr == 1
    w = rt.tensor([0.5, 0.5], requires_grad=True)
    loss = (a * b + w * a).sum()
    seen: list[tuple[Node, list[Any]]] = []
    grads: dict[Tensor, Any] = {}
    run_backward(tensor_roots([loss]), grad_map=grads, callback=lambda n, g: seen.append((n, g)))
    assert len(seen) == 1 and seen[0][0] is recv
    ga, gb = seen[0][1]
    np.testing.assert_allclose(ga, [3.5, 4.5])
    np.testing.assert_allclose(gb, [1.0, 2.0])
    np.testing.assert_allclose(grads[w], [1.0, 2.0])


def test_callback_kinds_match_subclasses() -> None:
    class MyRecv(RecvFunction):
        pass

    (x,) = MyRecv(1).make_outputs([np.ones(2)])
    seen: list[Node] = []
    run_backward(tensor_roots([(x * 2).sum()]), callback=lambda n, g: seen.append(n))
    assert len(seen) == 1 and isinstance(seen[0], MyRecv)


def test_recv_without_callback_raises() -> None:
    (x,) = RecvFunction(1).make_outputs([np.ones(2)])
    with pytest.raises(AutogradError, match="RecvFunction"):
        (x * 2).sum().backward()


def test_send_function_passes_gradients_through() -> None:
    x = rt.tensor([1.0, 2.0], requires_grad=True)
    y = rt.tensor([3.0], requires_grad=True)
    send = SendFunction([x * 2, rt.ones(1), y])
    assert send.num_outputs == 3 and send.next_edges[1] is None
    grads: dict[Tensor, Any] = {}
    run_backward([(send, [np.array([1.0, 1.0]), None, np.array([5.0])])], grad_map=grads)
    np.testing.assert_allclose(grads[x], [2.0, 2.0])
    np.testing.assert_allclose(grads[y], [5.0])


def test_misuse_is_reported() -> None:
    w = rt.tensor([1.0], requires_grad=True)
    send = SendFunction([w * 2])
    task = GraphTask([send], grad_map={})
    with pytest.raises(AutogradError, match="not a start node"):
        task.execute([(node_of((w * 5).sum()), np.ones(()))])
    with pytest.raises(AutogradError, match="1 outputs but 2"):
        task.execute([(send, [np.ones(1), np.ones(1)])])
    task.execute([(send, [np.ones(1)])])
    with pytest.raises(AutogradError, match="after it had already run"):
        task.execute([(send, [np.ones(1)])])


def test_two_threads_into_two_maps_do_not_mix() -> None:
    """Concurrent backward passes over shared parameters stay separate."""
    w = rt.tensor(np.linspace(-1, 1, 12).reshape(3, 4), requires_grad=True)
    b = rt.tensor(np.zeros(4), requires_grad=True)
    hook_calls: list[tuple[str, np.ndarray]] = []
    lock = threading.Lock()

    def hook(g: Tensor) -> None:
        with lock:
            hook_calls.append((threading.current_thread().name, g.numpy().copy()))

    w.register_hook(hook)
    inputs = {
        "t0": np.arange(6.0).reshape(2, 3),
        "t1": -np.ones((5, 3)),
    }
    rounds = 20
    barrier = threading.Barrier(2)
    maps: dict[str, dict[Tensor, Any]] = {name: {} for name in inputs}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            for _ in range(rounds):
                loss = (rt.tensor(inputs[name]) @ w + b).tanh().sum()
                barrier.wait()
                run_backward(tensor_roots([loss]), grad_map=maps[name])
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(n,), name=n) for n in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for name, x in inputs.items():
        pre = x @ w.numpy() + b.numpy()
        dpre = 1 - np.tanh(pre) ** 2
        np.testing.assert_allclose(maps[name][w], rounds * x.T @ dpre, rtol=1e-12)
        np.testing.assert_allclose(maps[name][b], rounds * dpre.sum(0), rtol=1e-12)
        calls = [g for n, g in hook_calls if n == name]
        assert len(calls) == rounds  # once per gradient, per run
        np.testing.assert_allclose(calls[0], x.T @ dpre, rtol=1e-12)
    assert w.grad is None and b.grad is None


def test_two_threads_on_one_retained_graph() -> None:
    w = rt.tensor([1.0, 2.0, 3.0], requires_grad=True)
    loss = (w * w).sum()
    roots = tensor_roots([loss])
    maps: list[dict[Tensor, Any]] = [{}, {}]
    barrier = threading.Barrier(2)

    def work(i: int) -> None:
        for _ in range(50):
            barrier.wait()
            run_backward(roots, grad_map=maps[i], retain_graph=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m in maps:
        np.testing.assert_allclose(m[w], 50 * 2 * np.array([1.0, 2.0, 3.0]))


def test_concurrent_feeds_into_one_task() -> None:
    """Gradients for two send functions of one context may arrive on two threads."""
    w = rt.tensor(np.ones(1000), requires_grad=True)
    sends = [SendFunction([w * float(k + 1)]) for k in range(2)]
    grads: dict[Tensor, Any] = {}
    task = GraphTask(sends, grad_map=grads)
    barrier = threading.Barrier(2)

    def feed(k: int) -> None:
        barrier.wait()
        task.execute([(sends[k], [np.full(1000, 10.0)])])

    threads = [threading.Thread(target=feed, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_allclose(grads[w], np.full(1000, 30.0))


def _recv_input(shape: tuple[int, ...]) -> tuple[RecvFunction, Tensor, Any]:
    data = np.random.default_rng(1).standard_normal(shape)
    recv = RecvFunction(1)
    (x,) = recv.make_outputs([data])
    return recv, x, data


@pytest.mark.parametrize("op", ["linear", "matmul"])
def test_a_gradient_leaving_the_worker_goes_before_the_parameters_gradients(op: str) -> None:
    """A matrix product of a received tensor and parameters: the receive
    function's callback (which sends the gradient upstream) runs before the
    parameters' gradients are computed, and every gradient equals a plain pass's."""
    from rpcdist.nn import functional as F

    rng = np.random.default_rng(0)
    w0, b0 = rng.standard_normal((4, 3)), rng.standard_normal(4)
    if op == "matmul":
        w0 = np.ascontiguousarray(w0.T)  # a leaf operand of the product itself

    def model(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        y = F.linear(x, w, b) if op == "linear" else x @ w + b
        return (y * y).sum()

    recv, x, data = _recv_input((5, 3))
    w, b = rt.tensor(w0, requires_grad=True), rt.tensor(b0, requires_grad=True)
    grads: dict[Tensor, Any] = {}
    seen: list[tuple[set[Tensor], Any]] = []

    def callback(node: Node, g: list[Any]) -> None:
        assert node is recv
        seen.append((set(grads), g[0]))

    loss = model(x, w, b)
    task = GraphTask([node_of(loss)], grad_map=grads, callback=callback, eager_leaves=True)
    task.execute(tensor_roots([loss]))
    ((held, gx),) = seen
    assert w not in held
    xl = rt.tensor(data, requires_grad=True)
    wl, bl = rt.tensor(w0, requires_grad=True), rt.tensor(b0, requires_grad=True)
    model(xl, wl, bl).backward()
    assert xl.grad is not None and wl.grad is not None and bl.grad is not None
    np.testing.assert_allclose(gx, xl.grad.data, rtol=1e-12)
    np.testing.assert_allclose(grads[w], wl.grad.data, rtol=1e-12)
    np.testing.assert_allclose(grads[b], bl.grad.data, rtol=1e-12)
    # The deferred half released the node: a second pass finds the graph freed.
    again = GraphTask([node_of(loss)], grad_map={}, callback=callback, eager_leaves=True)
    with pytest.raises(AutogradError, match="second time"):
        again.execute(tensor_roots([loss]))


def test_a_retained_split_graph_gives_the_same_gradients_twice() -> None:
    recv, x, _ = _recv_input((6, 3))
    w = rt.tensor(np.arange(6.0).reshape(3, 2), requires_grad=True)
    loss = (x @ w).sum()
    maps: list[dict[Tensor, Any]] = [{}, {}]
    sent: list[Any] = []
    for grads in maps:
        task = GraphTask(
            [node_of(loss)],
            grad_map=grads,
            eager_leaves=True,
            retain_graph=True,
            callback=lambda n, g: sent.append(g[0]),
        )
        task.execute(tensor_roots([loss]))
    np.testing.assert_array_equal(maps[0][w], maps[1][w])
    np.testing.assert_array_equal(sent[0], sent[1])
    np.testing.assert_allclose(maps[0][w], np.tile(x.data.sum(axis=0)[:, None], (1, 2)))


def test_a_failure_in_the_deferred_half_fails_the_pass_naming_the_node() -> None:
    class WeightFails(rt.Function):
        __slots__ = ()
        splittable = True

        def forward(self, x: Any, w: Any) -> Any:
            return x * w

        def backward(self, g: Any) -> tuple[Any, ...]:
            gx, gw = self.needs_input_grad
            if gw:
                raise ValueError("no gradient for you")
            return (g, None)

    recv, x, _ = _recv_input((3,))
    w = rt.tensor(np.ones(3), requires_grad=True)
    loss = WeightFails.call(x, w).sum()
    sent: list[Node] = []
    task = GraphTask(
        [node_of(loss)], grad_map={}, callback=lambda n, g: sent.append(n), eager_leaves=True
    )
    with pytest.raises(AutogradError, match="WeightFailsBackward failed in backward: no gradient"):
        task.execute(tensor_roots([loss]))
    assert sent == [recv]  # the upstream half went first


@pytest.mark.parametrize("ddp", [False, True])
def test_parameters_above_a_receive_function_wait_unless_ddp_wants_them_early(ddp: bool) -> None:
    """A trainer's own layers above what it received: the gradient for the
    sender leaves before these layers' parameter gradients are computed; with
    a ``leaf_done`` consumer (DDP's reducer) they come first as before."""
    from rpcdist.nn import functional as F

    recv, h, _ = _recv_input((5, 3))
    w = rt.tensor(np.random.default_rng(2).standard_normal((2, 3)), requires_grad=True)
    loss = F.linear(rt.relu(rt.tanh(h)), w).sum()
    grads: dict[Tensor, Any] = {}
    held: list[bool] = []
    done: list[Tensor] = []
    task = GraphTask(
        [node_of(loss)],
        grad_map=grads,
        eager_leaves=True,
        callback=lambda n, g: held.append(w in grads),
        leaf_done=done.append if ddp else None,
    )
    task.execute(tensor_roots([loss]))
    assert held == [ddp]
    assert w in grads and done == ([w] if ddp else [])
