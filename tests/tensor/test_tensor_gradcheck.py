"""Finite-difference checks (float64) of every differentiable tensor operation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rpcdist.tensor as rt
from rpcdist.tensor import Tensor, gradcheck


def leaf(
    shape: tuple[int, ...],
    device: str,
    *,
    seed: int = 0,
    lo: float = -2.0,
    hi: float = 2.0,
    away_from: float | None = None,
) -> Tensor:
    """A float64 leaf with values in [lo, hi), kept 0.1 away from ``away_from``."""
    rng = np.random.default_rng(seed)
    arr = rng.uniform(lo, hi, size=shape)
    if away_from is not None:
        close = np.abs(arr - away_from) < 0.1
        arr[close] += 0.3
    return rt.tensor(arr, device=device, requires_grad=True)


Case = tuple[str, Callable[..., Any], list[dict[str, Any]]]

UNARY: list[tuple[str, Callable[[Tensor], Any], dict[str, Any]]] = [
    ("neg", lambda a: -a, {}),
    ("exp", rt.exp, {}),
    ("log", rt.log, {"lo": 0.2, "hi": 3.0}),
    ("sqrt", rt.sqrt, {"lo": 0.2, "hi": 3.0}),
    ("abs", rt.abs, {"away_from": 0.0}),
    ("clamp", lambda a: rt.clamp(a, -0.5, 0.7), {"away_from": -0.5}),
    ("clamp_min", lambda a: a.clamp(min=0.25), {"away_from": 0.25}),
    ("tanh", rt.tanh, {}),
    ("sigmoid", rt.sigmoid, {}),
    ("relu", rt.relu, {"away_from": 0.0}),
    ("gelu", rt.gelu, {}),
    ("gelu_tanh", lambda a: rt.gelu(a, "tanh"), {}),
    ("pow_scalar", lambda a: a**3, {}),
    ("pow_square", lambda a: a**2, {}),
    ("pow_frac", lambda a: a**0.5, {"lo": 0.2, "hi": 3.0}),
    ("rpow", lambda a: 2.0**a, {}),
    ("scalar_ops", lambda a: (3.0 - a) * 2.0 / 4.0 + 1.5 - 1 / (a * a + 1), {}),
    ("softmax", lambda a: rt.softmax(a, axis=1), {}),
    ("softmax0", lambda a: a.softmax(0), {}),
    ("log_softmax", lambda a: rt.log_softmax(a, axis=-1), {}),
    ("sum_all", lambda a: a.sum(), {}),
    ("sum_axis", lambda a: a.sum(1), {}),
    ("sum_axes_keep", lambda a: a.sum((0, 2), keepdims=True), {}),
    ("sum_axes", lambda a: a.sum((0, 2)), {}),
    ("sum_all_axes", lambda a: a.sum((2, 0, 1)), {}),
    ("mean_axes", lambda a: a.mean((0, -1)), {}),
    ("max_axes_keep", lambda a: a.max((0, 2), keepdims=True), {}),
    ("mean", lambda a: a.mean(), {}),
    ("mean_axis", lambda a: a.mean(axis=-1, keepdims=True), {}),
    ("max_all", lambda a: a.max(), {}),
    ("max_axis", lambda a: a.max(1), {}),
    ("min_axis_keep", lambda a: a.min(2, keepdims=True), {}),
    ("amax_axes", lambda a: rt.amax(a, (0, 1)), {}),
    ("amin", lambda a: rt.amin(a, 0), {}),
    ("reshape", lambda a: a.reshape(6, -1) * rt.arange(4, dtype=np.float64, device=a.device), {}),
    ("view", lambda a: a.view(-1), {}),
    ("flatten", lambda a: a.flatten(1), {}),
    ("transpose", lambda a: a.transpose(0, 2), {}),
    ("permute", lambda a: a.permute(2, 0, 1), {}),
    ("T", lambda a: a.T, {}),
    ("expand", lambda a: a[:, :1, :].expand(2, 5, -1), {}),
    ("squeeze_unsqueeze", lambda a: a[:, :1].squeeze(1).unsqueeze(0).unsqueeze(-1), {}),
    ("index_slices", lambda a: a[1:, ::2, None, -1], {}),
    ("index_int_array_repeats", lambda a: a[[0, 1, 0, 0], 2], {}),
    ("index_2d_arrays", lambda a: a[np.array([[0, 1], [1, 1]]), :, np.array([[3, 3], [0, 3]])], {}),
    ("index_bool", lambda a: a[a.data > 0], {}),
    ("index_tensor", lambda a: a[rt.tensor([1, 1, 0])], {}),
    ("index_ellipsis", lambda a: a[..., 1], {}),
    ("split", lambda a: a.split(2, dim=2), {}),
    ("split_sections_partial", lambda a: a.split([1, 3], dim=2)[1], {}),
    ("chunk", lambda a: a.chunk(2, dim=1)[0], {}),
    ("clone", lambda a: a.clone() * a, {}),
    ("dropout_eval", lambda a: rt.dropout(a, 0.3, training=False), {}),
]


@pytest.mark.parametrize(("name", "fn", "opts"), UNARY, ids=[u[0] for u in UNARY])
def test_unary_ops(
    device: str, name: str, fn: Callable[[Tensor], Any], opts: dict[str, Any]
) -> None:
    x = leaf((2, 3, 4), device, **opts)
    assert gradcheck(fn, [x])


BROADCAST_SHAPES = [
    ((2, 3, 4), (2, 3, 4)),
    ((2, 3, 4), (4,)),
    ((2, 1, 4), (3, 1)),
    ((1,), (2, 3)),
    ((), (2, 3)),
    ((3, 1), (1, 3)),
]
BINARY: list[tuple[str, Callable[[Tensor, Tensor], Any]]] = [
    ("add", lambda a, b: a + b),
    ("sub", lambda a, b: a - b),
    ("mul", lambda a, b: a * b),
    ("div", lambda a, b: a / b),
    ("pow", lambda a, b: a**b),
    ("where", lambda a, b: rt.where(a.data > 1.0, a, b)),
]


@pytest.mark.parametrize(("sa", "sb"), BROADCAST_SHAPES, ids=str)
@pytest.mark.parametrize(("name", "fn"), BINARY, ids=[b[0] for b in BINARY])
def test_binary_ops_broadcasting(
    device: str,
    name: str,
    fn: Callable[[Tensor, Tensor], Any],
    sa: tuple[int, ...],
    sb: tuple[int, ...],
) -> None:
    lo = 0.5 if name in ("pow", "div") else -2.0
    a = leaf(sa, device, seed=1, lo=lo)
    b = leaf(sb, device, seed=2, lo=lo)
    assert gradcheck(fn, [a, b])
    # the gradient of each input has exactly its own shape
    out = fn(a, b)
    out.sum().backward()
    assert a.grad is not None and a.grad.shape == sa
    assert b.grad is not None and b.grad.shape == sb


MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((4,), (4,)),
    ((2, 3, 4), (4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 2)),
    ((2, 3, 4), (4,)),
    ((4,), (2, 4, 5)),
]


@pytest.mark.parametrize(("sa", "sb"), MATMUL_SHAPES, ids=str)
def test_matmul_batched_and_vectors(device: str, sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    a, b = leaf(sa, device, seed=3), leaf(sb, device, seed=4)
    assert gradcheck(lambda x, y: x @ y, [a, b])


def test_cat_stack(device: str) -> None:
    a, b, c = (
        leaf((2, 3), device, seed=1),
        leaf((2, 1), device, seed=2),
        leaf((2, 3), device, seed=3),
    )
    assert gradcheck(lambda x, y: rt.cat([x, y, x], axis=1), [a, b])
    assert gradcheck(lambda x, y: rt.stack([x, y, x], axis=1), [a, c])
    assert gradcheck(lambda x, y: rt.stack([x, y], axis=-1), [a, c])


def test_constant_operands_get_no_gradient(device: str) -> None:
    a = leaf((2, 3), device)
    const = rt.tensor(np.ones((2, 3)), device=device)
    assert gradcheck(lambda x: x * const + 1.0, [a])
    (a * const).sum().backward()
    assert const.grad is None


def test_shared_subexpression_and_reuse(device: str) -> None:
    a = leaf((3,), device)
    b = leaf((3,), device, seed=5)

    def f(x: Tensor, y: Tensor) -> Tensor:
        h = x * y
        return (h * h + h.exp() + x).sum()

    assert gradcheck(f, [a, b])


def test_dropout_gradient_uses_the_same_mask(device: str) -> None:
    x = leaf((4, 5), device)
    gen = rt.Generator(7)
    y = rt.dropout(x, 0.5, generator=gen)
    y.backward(rt.ones(4, 5, dtype=np.float64, device=device))
    assert x.grad is not None
    kept = y.numpy() != 0
    np.testing.assert_allclose(x.grad.numpy(), np.where(kept, 2.0, 0.0))
    np.testing.assert_allclose(y.numpy()[kept], 2 * x.numpy()[kept])


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    mask=st.lists(st.booleans(), min_size=3, max_size=3),
    drop=st.integers(0, 2),
)
def test_broadcast_gradient_property(shape: list[int], mask: list[bool], drop: int) -> None:
    """For any broadcast of b into a, d(sum(a*b))/db = a summed over the broadcast axes."""
    full = tuple(shape)
    small = tuple(1 if m else s for s, m in zip(full, mask))[drop:]
    a = leaf(full, "cpu", seed=11)
    b = leaf(small, "cpu", seed=12)
    (a * b).sum().backward()
    assert b.grad is not None
    expected = np.broadcast_to(a.numpy(), full)
    lead = len(full) - len(small)
    expected = expected.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, s in enumerate(small) if s == 1)
    expected = expected.sum(axis=axes, keepdims=True).reshape(small)
    np.testing.assert_allclose(b.grad.numpy(), expected, rtol=1e-12)
