"""Layers and losses against PyTorch: same weights, same inputs, same numbers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import nn
from rpcdist.nn import functional as F

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def torch() -> Any:
    mod = pytest.importorskip("torch")
    mod.set_default_dtype(mod.float64)
    yield mod
    mod.set_default_dtype(mod.float32)


def copy_into(torch: Any, ours: nn.Module, theirs: Any) -> None:
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in ours.state_dict().items()})


def grads_equal(torch: Any, ours: nn.Module, theirs: Any, rtol: float = 1e-10) -> None:
    mine = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        assert mine[name].grad is not None, name
        np.testing.assert_allclose(
            mine[name].grad.numpy(), p.grad.numpy(), rtol=rtol, atol=1e-12, err_msg=name
        )


def test_linear_forward_and_grads(torch: Any) -> None:
    ours = nn.Linear(6, 4, dtype=np.float64, generator=rt.Generator(0))
    theirs = torch.nn.Linear(6, 4)
    copy_into(torch, ours, theirs)
    x = np.random.default_rng(1).normal(size=(5, 6))
    xo, xt = rt.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    yo, yt = ours(xo), theirs(xt)
    np.testing.assert_allclose(yo.numpy(), yt.detach().numpy(), rtol=1e-12)
    (yo.tanh() * yo).sum().backward()
    (yt.tanh() * yt).sum().backward()
    grads_equal(torch, ours, theirs)
    np.testing.assert_allclose(xo.grad.numpy(), xt.grad.numpy(), rtol=1e-10)  # type: ignore[union-attr]


@pytest.mark.parametrize("batch_first", [False, True])
def test_lstm_forward_and_grads(torch: Any, batch_first: bool) -> None:
    ours = nn.LSTM(
        5, 7, num_layers=2, batch_first=batch_first, dtype=np.float64, generator=rt.Generator(2)
    )
    theirs = torch.nn.LSTM(5, 7, num_layers=2, batch_first=batch_first)
    copy_into(torch, ours, theirs)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 6, 5))  # batch 4, 6 steps
    h0, c0 = rng.normal(size=(2, 4, 7)), rng.normal(size=(2, 4, 7))
    if not batch_first:
        x = x.transpose(1, 0, 2).copy()
    xo, xt = rt.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    h0o, h0t = rt.tensor(h0, requires_grad=True), torch.tensor(h0, requires_grad=True)
    c0o, c0t = rt.tensor(c0, requires_grad=True), torch.tensor(c0, requires_grad=True)
    oo, (ho, co) = ours(xo, (h0o, c0o))
    ot, (ht, ct) = theirs(xt, (h0t, c0t))
    for a, b in ((oo, ot), (ho, ht), (co, ct)):
        np.testing.assert_allclose(a.numpy(), b.detach().numpy(), rtol=1e-10, atol=1e-12)
    w = rng.normal(size=oo.shape)
    ((oo * rt.tensor(w)).sum() + (ho * ho).sum() + co.sum()).backward()
    ((ot * torch.tensor(w)).sum() + (ht * ht).sum() + ct.sum()).backward()
    grads_equal(torch, ours, theirs)
    for a, b in ((xo, xt), (h0o, h0t), (c0o, c0t)):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-9, atol=1e-12)  # type: ignore[union-attr]


def test_embedding_and_cross_entropy(torch: Any) -> None:
    ours = nn.Embedding(10, 4, padding_idx=2, dtype=np.float64, generator=rt.Generator(4))
    theirs = torch.nn.Embedding(10, 4, padding_idx=2)
    copy_into(torch, ours, theirs)
    idx = np.array([[1, 2, 3, 3], [9, 1, 1, 2]])
    target = np.array([0, 3, 1, -100, 2, 2, 1, 0])
    eo = ours(idx).reshape(-1, 4)
    et = theirs(torch.from_numpy(idx)).reshape(-1, 4)
    lo = F.cross_entropy(eo, target, ignore_index=-100)
    lt = torch.nn.functional.cross_entropy(et, torch.from_numpy(target), ignore_index=-100)
    np.testing.assert_allclose(lo.item(), lt.item(), rtol=1e-12)
    lo.backward()
    lt.backward()
    grads_equal(torch, ours, theirs)


def test_float32_linear_matches_torch_float32(torch: Any) -> None:
    ours = nn.Linear(8, 3, generator=rt.Generator(5))
    theirs = torch.nn.Linear(8, 3).float()
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in ours.state_dict().items()})
    x = np.random.default_rng(6).normal(size=(4, 8)).astype(np.float32)
    yo = ours(rt.tensor(x))
    yt = theirs(torch.from_numpy(x))
    assert yo.dtype == np.float32
    np.testing.assert_allclose(yo.numpy(), yt.detach().numpy(), rtol=1e-5, atol=1e-6)
