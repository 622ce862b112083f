"""End to end: an MLP learns scikit-learn's bundled digits (no download)."""

from __future__ import annotations

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import nn
from rpcdist.nn import functional as F
from rpcdist.optim import Adam


def test_mlp_learns_digits() -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]

    gen = rt.Generator(0)
    model = nn.Sequential(
        nn.Linear(64, 64, generator=gen),
        nn.ReLU(),
        nn.Dropout(0.1, generator=gen),
        nn.Linear(64, 10, generator=gen),
    )
    opt = Adam(model.parameters(), lr=1e-2)
    for _ in range(15):
        perm = gen.permutation(split)
        for i in range(0, split, 64):
            idx = perm[i : i + 64]
            loss = F.cross_entropy(model(rt.tensor(x_train[idx])), y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with rt.no_grad():
        pred = model(rt.tensor(x_test)).argmax(axis=1).numpy()
    accuracy = float((pred == y_test).mean())
    assert accuracy >= 0.93, accuracy  # reaches about 0.98
