"""The smaller parts of the Tensor surface: reflected operators, comparisons,
in-place fills, conversions and the checks on gradients a user assigns."""

from __future__ import annotations

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import AutogradError, ConfigError
from rpcdist.tensor import Tensor


def _leaf(values: list[float]) -> Tensor:
    return Tensor(np.array(values), requires_grad=True)


def test_reflected_operators_match_numpy_and_record_gradients() -> None:
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    x = _leaf([[0.5, -1.0], [2.0, 3.0]])
    np.testing.assert_allclose((1.5 + x).numpy(), 1.5 + x.numpy())
    np.testing.assert_allclose((a @ x).numpy(), a @ x.numpy())
    ((1.5 + x) * (a @ x)).sum().backward()
    # d/dx sum((1.5 + x) * (a @ x)) = (a @ x) + a.T @ (1.5 + x)
    xv = x.numpy()
    np.testing.assert_allclose(x.grad.numpy(), a @ xv + a.T @ (1.5 + xv), rtol=1e-12)


@pytest.mark.parametrize(
    ("op", "np_op"),
    [
        (lambda t, o: t != o, np.not_equal),
        (lambda t, o: t < o, np.less),
        (lambda t, o: t <= o, np.less_equal),
        (lambda t, o: t >= o, np.greater_equal),
    ],
    ids=["ne", "lt", "le", "ge"],
)
def test_comparisons_give_boolean_tensors_outside_the_graph(op, np_op) -> None:
    x = _leaf([1.0, 2.0, 3.0])
    other = np.array([2.0, 2.0, 2.0])
    got = op(x, other)
    assert got.dtype == np.bool_ and not got.requires_grad and got.grad_fn is None
    assert got.numpy().tolist() == np_op(x.numpy(), other).tolist()
    assert op(x, Tensor(other)).numpy().tolist() == got.numpy().tolist()


def test_in_place_fills_refuse_tensors_that_require_grad_unless_no_grad() -> None:
    t = rt.zeros(2, 3)
    assert t.fill_(2.5) is t and t.numpy().tolist() == [[2.5] * 3] * 2
    assert t.copy_(np.arange(6.0).reshape(2, 3)) is t
    assert t.numpy().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    with pytest.raises(ConfigError, match=r"copy_: source shape \(3, 2\) != \(2, 3\)"):
        t.copy_(np.zeros((3, 2)))
    assert t.numpy()[1, 2] == 5.0  # unchanged by the refused copy
    w = _leaf([1.0, 2.0])
    for op, arg in (("fill_", 0.0), ("copy_", np.zeros(2))):
        with pytest.raises(AutogradError, match=f"{op}: in-place change"):
            getattr(w, op)(arg)
    assert w.numpy().tolist() == [1.0, 2.0]
    with rt.no_grad():
        w.fill_(7.0)
    assert w.numpy().tolist() == [7.0, 7.0]


def test_conversions_to_python_values() -> None:
    assert int(Tensor(np.array(3.7))) == 3 and float(Tensor(np.array([2.5]))) == 2.5
    assert bool(Tensor(np.array([1.0]))) and not bool(Tensor(np.array(0.0)))
    with pytest.raises(ConfigError, match="truth value of a tensor with 3 elements"):
        bool(Tensor(np.ones(3)))
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d tensor"):
        len(Tensor(np.array(1.0)))
    assert np.asarray(Tensor(np.arange(3.0)), dtype=np.float32).dtype == np.float32
    assert "requires_grad=True" in repr(_leaf([1.0]))
    assert "grad_fn=<" in repr(_leaf([1.0]) * 2.0)


def test_assigned_gradients_are_checked_and_wrapped() -> None:
    w = _leaf([1.0, 2.0, 3.0])
    w.grad = np.array([0.5, 0.5, 0.5])  # an array becomes a Tensor
    assert isinstance(w.grad, Tensor) and w.grad.numpy().tolist() == [0.5, 0.5, 0.5]
    with pytest.raises(
        ConfigError, match=r"assigned grad has shape \(2,\), tensor has shape \(3,\)"
    ):
        w.grad = np.zeros(2)
    assert w.grad.numpy().tolist() == [0.5, 0.5, 0.5]
    w.grad = None
    assert w.grad is None


def test_requires_grad_changes_that_cannot_hold_are_refused() -> None:
    y = _leaf([1.0]) * 2.0
    y.requires_grad = True  # already true on a result: nothing to do
    with pytest.raises(AutogradError, match="only be changed on leaf tensors"):
        y.requires_grad = False
    with pytest.raises(AutogradError, match="floating-point tensors can require gradients"):
        Tensor(np.arange(3)).requires_grad_()
    with pytest.raises(AutogradError, match="does not require grad"):
        Tensor(np.ones(2)).register_hook(lambda g: g)


def test_retain_grad_keeps_and_sums_a_results_gradient_over_passes() -> None:
    x = _leaf([1.0, -2.0])
    y = x * 3.0
    y.retain_grad()
    x.retain_grad()  # a leaf keeps its gradient anyway: no hook, no double count
    loss = (y * y).sum()
    loss.backward(retain_graph=True)
    np.testing.assert_allclose(y.grad.numpy(), 2 * y.numpy())
    loss.backward()
    np.testing.assert_allclose(y.grad.numpy(), 4 * y.numpy())
    np.testing.assert_allclose(x.grad.numpy(), 4 * 3.0 * y.numpy())
