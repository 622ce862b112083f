"""The backward engine through ``Tensor.backward``: accumulation, graphs, hooks, modes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import AutogradError


def test_accumulates_across_backward_calls(device: str) -> None:
    w = rt.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    (w * w).sum().backward()
    (3 * w).sum().backward()
    assert w.grad is not None
    np.testing.assert_allclose(w.grad.numpy(), 2 * np.array([1.0, 2.0, 3.0]) + 3)


def test_first_gradient_is_copied_not_aliased(device: str) -> None:
    a = rt.tensor([1.0, 2.0], device=device, requires_grad=True)
    b = rt.tensor([5.0, 6.0], device=device, requires_grad=True)
    (a + b).sum().backward()  # both receive the same incoming array
    assert a.grad is not None and b.grad is not None
    a.grad.data += 10
    np.testing.assert_allclose(b.grad.numpy(), [1.0, 1.0])


def test_explicit_gradient_for_non_scalar(device: str) -> None:
    x = rt.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, requires_grad=True)
    y = x * 2
    y.backward(rt.tensor([[1.0, 0.0], [0.5, 2.0]], device=device))
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), [[2.0, 0.0], [1.0, 4.0]])


def test_non_scalar_without_gradient_raises_naming_shape() -> None:
    x = rt.ones(2, 3, requires_grad=True)
    with pytest.raises(AutogradError, match=r"\(2, 3\)"):
        (x * 2).backward()


def test_gradient_of_wrong_shape_raises() -> None:
    x = rt.ones(2, 3, requires_grad=True)
    with pytest.raises(AutogradError, match=r"\(3,\).*\(2, 3\)"):
        (x * 2).backward(rt.ones(3))


def test_backward_on_tensor_without_grad_raises() -> None:
    with pytest.raises(AutogradError, match="does not require grad"):
        rt.ones(3).sum().backward()


def test_freed_graph_raises_clear_error() -> None:
    x = rt.tensor([1.0, 2.0], requires_grad=True)
    loss = (x * x).sum()
    loss.backward()
    with pytest.raises(AutogradError, match=r"second time.*retain_graph"):
        loss.backward()


def test_retain_graph_allows_second_backward() -> None:
    x = rt.tensor([1.0, 2.0], requires_grad=True)
    loss = (x * x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), [4.0, 8.0])


def test_float32_stays_float32(device: str) -> None:
    x = rt.randn(4, 3, device=device, requires_grad=True)
    w = rt.randn(3, 2, device=device, requires_grad=True)
    y = ((x @ w).relu() * 0.5 + 1).exp().mean()
    assert y.dtype == np.float32
    y.backward()
    assert x.grad is not None and w.grad is not None
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float32


def test_mixed_precision_gradient_cast_to_leaf_dtype() -> None:
    x = rt.ones(3, requires_grad=True)  # float32
    y = rt.tensor(np.ones(3), requires_grad=True)  # float64
    (x * y).sum().backward()
    assert x.grad is not None and x.grad.dtype == np.float32
    assert y.grad is not None and y.grad.dtype == np.float64


def test_no_grad_records_nothing_and_is_thread_local() -> None:
    x = rt.ones(2, requires_grad=True)
    seen: dict[str, bool] = {}
    inside = threading.Event()
    release = threading.Event()

    def other() -> None:
        inside.wait()
        seen["other_requires_grad"] = (x * 2).requires_grad
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with rt.no_grad():
        y = x * 2
        assert not rt.is_grad_enabled()
        inside.set()
        release.wait()
    t.join()
    assert not y.requires_grad and y.grad_fn is None
    assert seen["other_requires_grad"] is True
    assert rt.is_grad_enabled()


def test_no_grad_as_decorator_and_enable_grad() -> None:
    x = rt.ones(2, requires_grad=True)

    @rt.no_grad()
    def f() -> rt.Tensor:
        with rt.enable_grad():
            inner = x * 2
        assert inner.requires_grad
        return x * 3

    assert not f().requires_grad


def test_leaf_hook_transforms_gradient_and_fires_once() -> None:
    x = rt.tensor([1.0, 2.0], requires_grad=True)
    calls: list[np.ndarray] = []

    def hook(g: rt.Tensor) -> rt.Tensor:
        calls.append(g.numpy().copy())
        return g * 10

    x.register_hook(hook)
    (x * 2 + x * 3).sum().backward()  # two paths: summed before the hook
    assert len(calls) == 1
    np.testing.assert_allclose(calls[0], [5.0, 5.0])
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), [50.0, 50.0])


def test_non_leaf_hook_and_handle_remove() -> None:
    x = rt.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2
    handle = y.register_hook(lambda g: g * 0)
    (y * y).sum().backward(retain_graph=True)
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), [0.0, 0.0])
    handle.remove()
    x.grad = None
    (y * y).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [8.0, 16.0])


def test_post_accumulate_hook_sees_final_grad() -> None:
    w = rt.tensor([1.0, 1.0], requires_grad=True)
    seen: list[np.ndarray] = []
    w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy().copy()))  # type: ignore[union-attr]
    (w * 2 + w).sum().backward()
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], [3.0, 3.0])
    with pytest.raises(AutogradError, match="leaf"):
        (w * 2).register_post_accumulate_grad_hook(lambda t: None)


def test_retain_grad_on_non_leaf() -> None:
    x = rt.tensor([1.0, -1.0], requires_grad=True)
    h = x * 3
    h.retain_grad()
    (h * h).sum().backward()
    assert h.grad is not None
    np.testing.assert_allclose(h.grad.numpy(), [6.0, -6.0])


def test_multi_output_node_with_unused_output() -> None:
    x = rt.tensor(np.arange(6.0), requires_grad=True)
    a, _, c = x.split(2)
    (a * 2 + c).sum().backward()
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), [2, 2, 0, 0, 1, 1])


def test_backward_from_leaf_itself() -> None:
    x = rt.tensor([1.0, 2.0], requires_grad=True)
    x.backward(rt.tensor([3.0, 4.0]))
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 4.0])


def test_backward_of_several_roots() -> None:
    x = rt.tensor([1.0, 2.0], requires_grad=True)
    rt.backward([(x * 2).sum(), (x * x).sum()])
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), [4.0, 6.0])


def test_deep_chain_does_not_recurse() -> None:
    x = rt.tensor([1.0], requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0
    y.sum().backward()
    assert x.grad is not None and x.grad.item() == 1.0


def test_detach_and_requires_grad_rules() -> None:
    x = rt.tensor([1.0, 2.0], requires_grad=True)
    d = (x * 2).detach()
    assert d.is_leaf and not d.requires_grad
    with pytest.raises(AutogradError, match="floating"):
        rt.tensor([1, 2], requires_grad=True)
    with pytest.raises(AutogradError, match="leaf"):
        (x * 2).requires_grad = False
    with pytest.raises(AutogradError, match="in-place"):
        x.zero_()
    with rt.no_grad():
        x.zero_()
    assert x.numpy().tolist() == [0.0, 0.0]


def test_tensors_hash_by_identity() -> None:
    a = rt.ones(2, requires_grad=True)
    b = rt.ones(2, requires_grad=True)
    d = {a: 1, b: 2}
    assert d[a] == 1 and d[b] == 2 and len({a, b, a}) == 2


def test_backward_frees_saved_arrays() -> None:
    x = rt.tensor([1.0, 2.0], requires_grad=True)
    y = x * x.exp()
    node = y.grad_fn
    y.sum().backward()
    assert node is not None and node.a is None and node.b is None  # type: ignore[attr-defined]


def test_concurrent_backward_into_grad_is_not_lost() -> None:
    w = rt.tensor(np.zeros(100_000), requires_grad=True)
    barrier = threading.Barrier(4)

    def work() -> None:
        for _ in range(10):
            loss = (w * 1.0).sum()
            barrier.wait()
            loss.backward()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert w.grad is not None
    np.testing.assert_array_equal(w.grad.numpy(), np.full(100_000, 40.0))
