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


def lm_pair(torch: Any, dtype: Any, vocab: int, emb: int, hidden: int) -> tuple[Any, Any]:
    """Embedding + 2-layer LSTM + Linear decoder, ours and PyTorch's, equal weights."""
    gen = rt.Generator(7)
    ours = [
        nn.Embedding(vocab, emb, dtype=dtype, generator=gen),
        nn.LSTM(emb, hidden, num_layers=2, dtype=dtype, generator=gen),
        nn.Linear(hidden, vocab, dtype=dtype, generator=gen),
    ]
    theirs = [
        torch.nn.Embedding(vocab, emb),
        torch.nn.LSTM(emb, hidden, num_layers=2),
        torch.nn.Linear(hidden, vocab),
    ]
    for a, b in zip(ours, theirs):
        b.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in a.state_dict().items()})
        b.to({np.float32: torch.float32, np.float64: torch.float64}[dtype])
    return ours, theirs


def lm_loss(mods: list[Any], tokens: Any, target: Any, F_ce: Any) -> Any:
    out, (h, c) = mods[1](mods[0](tokens))
    logits = mods[2](out.reshape(-1, out.shape[-1]))
    return F_ce(logits, target, ignore_index=-100) + (h * h).sum() * 0.1 + c.sum() * 0.1


def test_language_model_training_steps_match_torch(
    torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rpcdist.nn import _buffers
    from rpcdist.optim import SGD

    monkeypatch.setattr(_buffers, "MIN_BYTES", 0)  # every buffer pooled and reused
    _buffers.clear()
    ours, theirs = lm_pair(torch, np.float64, vocab=30, emb=6, hidden=8)
    opt = SGD([p for m in ours for p in m.parameters()], lr=0.1, momentum=0.9)
    topt = torch.optim.SGD([p for m in theirs for p in m.parameters()], lr=0.1, momentum=0.9)
    rng = np.random.default_rng(8)
    for _ in range(4):
        tokens = rng.integers(0, 30, size=(7, 3))
        target = rng.integers(0, 30, size=21)
        target[::5] = -100
        opt.zero_grad()
        topt.zero_grad()
        loss = lm_loss(ours, tokens, target, F.cross_entropy)
        tloss = lm_loss(
            theirs,
            torch.from_numpy(tokens),
            torch.from_numpy(target),
            torch.nn.functional.cross_entropy,
        )
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-12)
        loss.backward()
        tloss.backward()
        for a, b in zip(ours, theirs):
            grads_equal(torch, a, b, rtol=1e-9)
        opt.step()
        topt.step()
    assert _buffers.statistics()["hits"] > 0


def test_language_model_float32_at_benchmark_sizes(torch: Any) -> None:
    ours, theirs = lm_pair(torch, np.float32, vocab=1000, emb=64, hidden=128)
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, 1000, size=(35, 20))
    target = rng.integers(0, 1000, size=700)
    for _ in range(2):  # the second pass runs on pooled buffers
        for m in (*ours, *theirs):
            m.zero_grad()
        loss = lm_loss(ours, tokens, target, F.cross_entropy)
        tloss = lm_loss(
            theirs,
            torch.from_numpy(tokens),
            torch.from_numpy(target),
            torch.nn.functional.cross_entropy,
        )
        assert loss.dtype == np.float32
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-5)
        loss.backward()
        tloss.backward()
        for a, b in zip(ours, theirs):
            mine = dict(a.named_parameters())
            for name, p in b.named_parameters():
                want = p.grad.numpy()
                got = mine[name].grad.numpy()  # type: ignore[union-attr]
                np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-5 * np.abs(want).max())
