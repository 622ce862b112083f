"""Same model, inputs and optimizer as PyTorch: same parameters after several steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import nn
from rpcdist import optim as ropt
from rpcdist.nn import functional as F

pytestmark = pytest.mark.torch

CONFIGS = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
    ("SGD", {"lr": 0.05, "momentum": 0.5, "dampening": 0.5}),
    ("Adam", {"lr": 1e-2}),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.95)}),
    ("Adam", {"lr": 1e-2, "amsgrad": True}),
    ("AdamW", {"lr": 1e-2}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.2, "amsgrad": True}),
]


def build_ours(dtype: Any) -> nn.Module:
    gen = rt.Generator(0)
    return nn.Sequential(
        nn.Linear(6, 16, dtype=dtype, generator=gen),
        nn.Tanh(),
        nn.Linear(16, 3, dtype=dtype, generator=gen),
    )


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(
    ("name", "kw"), CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)]
)
def test_matches_torch_after_steps(name: str, kw: dict[str, Any], dtype: Any) -> None:
    torch = pytest.importorskip("torch")
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    ours = build_ours(dtype)
    theirs = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    ).to(tdtype)
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in ours.state_dict().items()})
    opt_o = getattr(ropt, name)(ours.parameters(), **kw)
    opt_t = getattr(torch.optim, name)(theirs.parameters(), **kw)
    rng = np.random.default_rng(1)
    for _ in range(6):
        x = rng.normal(size=(8, 6)).astype(dtype)
        y = rng.integers(0, 3, size=8)
        opt_o.zero_grad()
        F.cross_entropy(ours(rt.tensor(x)), y).backward()
        opt_o.step()
        opt_t.zero_grad()
        torch.nn.functional.cross_entropy(
            theirs(torch.from_numpy(x)), torch.from_numpy(y)
        ).backward()
        opt_t.step()
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == np.float64 else {"rtol": 2e-4, "atol": 2e-5}
    mine = ours.state_dict()
    for k, v in theirs.state_dict().items():
        np.testing.assert_allclose(mine[k], v.numpy(), err_msg=k, **tol)
