"""Losses and functional layers: values against NumPy, gradients by finite differences."""

from __future__ import annotations

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import ConfigError
from rpcdist.nn import functional as F
from rpcdist.tensor import gradcheck


def leaf(shape: tuple[int, ...], device: str, seed: int = 0) -> rt.Tensor:
    arr = np.random.default_rng(seed).normal(size=shape)
    return rt.tensor(arr, device=device, requires_grad=True)


def reference_ce(x: np.ndarray, t: np.ndarray, ignore: int = -100) -> np.ndarray:
    m = x.max(1, keepdims=True)
    logp = x - m - np.log(np.exp(x - m).sum(1, keepdims=True))
    valid = t != ignore
    out = np.zeros(len(t))
    out[valid] = -logp[np.arange(len(t))[valid], t[valid]]
    return out


def test_cross_entropy_values_and_reductions(device: str) -> None:
    x = leaf((5, 4), device)
    t = np.array([0, 3, 1, -100, 3])
    ref = reference_ce(x.numpy(), t)
    none = F.cross_entropy(x, t, reduction="none")
    np.testing.assert_allclose(none.numpy(), ref, rtol=1e-12)
    np.testing.assert_allclose(F.cross_entropy(x, t, reduction="sum").item(), ref.sum())
    np.testing.assert_allclose(F.cross_entropy(x, rt.tensor(t)).item(), ref.sum() / 4)
    assert gradcheck(lambda a: F.cross_entropy(a, t), [x])
    assert gradcheck(lambda a: F.cross_entropy(a, t, reduction="none"), [x])
    t3 = np.array([0, 3, 1, 3, 2])
    assert gradcheck(lambda a: F.cross_entropy(a, t3, reduction="sum", ignore_index=3), [x])


def test_cross_entropy_is_stable_for_huge_logits() -> None:
    x = rt.tensor([[1000.0, 0.0], [-1000.0, 1000.0]], requires_grad=True)
    loss = F.cross_entropy(x, [0, 1])
    loss.backward()
    assert np.isfinite(loss.item()) and loss.item() == 0.0
    assert x.grad is not None and np.isfinite(x.grad.numpy()).all()


def test_cross_entropy_k_dimensional_and_unbatched(device: str) -> None:
    x = leaf((2, 3, 4), device)  # N=2, C=3, d=4
    t = np.random.default_rng(1).integers(0, 3, size=(2, 4))
    flat = x.numpy().transpose(0, 2, 1).reshape(-1, 3)
    none = F.cross_entropy(x, t, reduction="none")
    assert none.shape == (2, 4)
    np.testing.assert_allclose(none.numpy().ravel(), reference_ce(flat, t.ravel()), rtol=1e-12)
    assert gradcheck(lambda a: F.cross_entropy(a, t), [x])
    v = leaf((3,), device, seed=2)
    np.testing.assert_allclose(
        F.cross_entropy(v, np.array(2)).item(), reference_ce(v.numpy()[None], np.array([2]))[0]
    )


def test_nll_loss_matches_cross_entropy(device: str) -> None:
    x = leaf((6, 5), device)
    t = np.array([4, 0, 0, 2, -100, 1])
    for red in ("mean", "sum", "none"):
        a = F.nll_loss(F.log_softmax(x, axis=1), t, reduction=red)
        b = F.cross_entropy(x, t, reduction=red)
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12)
    assert gradcheck(lambda a: F.nll_loss(a, t), [x])
    t0 = np.array([4, 0, 0, 2, 3, 1])
    assert gradcheck(lambda a: F.nll_loss(a, t0, reduction="none", ignore_index=0), [x])


def test_mse_linear_embedding_gradients(device: str) -> None:
    x, y = leaf((4, 3), device), leaf((4, 3), device, seed=1)
    assert gradcheck(lambda a, b: F.mse_loss(a, b), [x, y])
    assert gradcheck(lambda a, b: F.mse_loss(a, b, reduction="sum"), [x, y])
    w, b = leaf((5, 3), device, seed=2), leaf((5,), device, seed=3)
    assert gradcheck(F.linear, [x, w, b])
    assert gradcheck(lambda a, ww: F.linear(a, ww), [leaf((2, 4, 3), device), w])
    table = leaf((6, 2), device, seed=4)
    idx = np.array([[0, 5, 5], [5, 1, 0]])  # repeated rows accumulate
    assert gradcheck(lambda t: F.embedding(idx, t) * F.embedding(idx, t), [table])


def test_activations_match_numpy() -> None:
    x = rt.tensor(np.linspace(-3, 3, 7))
    np.testing.assert_allclose(F.relu(x).numpy(), np.maximum(x.numpy(), 0))
    np.testing.assert_allclose(F.sigmoid(x).numpy(), 1 / (1 + np.exp(-x.numpy())))
    np.testing.assert_allclose(F.tanh(x).numpy(), np.tanh(x.numpy()))
    s = F.softmax(rt.tensor([[1000.0, 1000.0, -1000.0]]), axis=1).numpy()
    np.testing.assert_allclose(s, [[0.5, 0.5, 0.0]])
    ls = F.log_softmax(rt.tensor([[1000.0, 0.0]]), axis=1).numpy()
    np.testing.assert_allclose(ls, [[0.0, -1000.0]])


def test_loss_input_errors() -> None:
    x = rt.ones(3, 4)
    with pytest.raises(ConfigError, match=r"cross_entropy.*integers"):
        F.cross_entropy(x, np.array([0.0, 1.0, 2.0]))
    with pytest.raises(ConfigError, match=r"cross_entropy.*\(2,\).*batch 3"):
        F.cross_entropy(x, [0, 1])
    with pytest.raises(ConfigError, match=r"outside \[0, 4\)"):
        F.cross_entropy(x, [0, 1, 4])
    with pytest.raises(ConfigError, match="reduction"):
        F.cross_entropy(x, [0, 1, 2], reduction="avg")
    with pytest.raises(ConfigError, match=r"mse_loss.*\(3, 4\).*\(4, 3\)"):
        F.mse_loss(x, rt.ones(4, 3))
    with pytest.raises(ConfigError, match=r"linear.*\(3, 4\).*\(2, 5\)"):
        F.linear(x, rt.ones(2, 5))


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64])
def test_embedding_gradient_sums_repeated_rows(dtype: type) -> None:
    rng = np.random.default_rng(5)
    table = rt.tensor(rng.normal(size=(200, 70)).astype(np.float32), requires_grad=True)
    idx = rng.integers(0, 200, size=(40, 30)).astype(dtype)  # many repeats; rows past 255 * 70
    g = rng.normal(size=(40, 30, 70)).astype(np.float32)
    out = F.embedding(idx, table)
    np.testing.assert_array_equal(out.numpy(), table.numpy()[idx])
    (out * rt.tensor(g)).sum().backward()
    want = np.zeros((200, 70), np.float32)
    np.add.at(want, idx.reshape(-1), g.reshape(-1, 70))
    assert table.grad is not None
    np.testing.assert_array_equal(table.grad.numpy(), want)
