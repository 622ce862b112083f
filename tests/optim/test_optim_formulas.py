"""Optimizer steps equal the documented formulas; explicit-gradient stepping; state."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import ConfigError, nn
from rpcdist.optim import SGD, Adam, AdamW, Optimizer

STEPS = 4


def grads_seq(shape: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape) for _ in range(STEPS)]


def ref_sgd(
    p: np.ndarray,
    gs: list[np.ndarray],
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    wd: float = 0.0,
    nesterov: bool = False,
) -> np.ndarray:
    p = p.copy()
    buf = None
    for g in gs:
        g = g + wd * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def ref_adam(
    p: np.ndarray,
    gs: list[np.ndarray],
    lr: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    wd: float = 0.0,
    amsgrad: bool = False,
    decoupled: bool = False,
) -> np.ndarray:
    p = p.copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    vmax = np.zeros_like(p)
    for t, g in enumerate(gs, start=1):
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = np.maximum(vmax, v)
        vhat = (vmax if amsgrad else v) / (1 - b2**t)
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(vhat) + eps)
    return p


CASES: list[tuple[str, Any, dict[str, Any], Any]] = [
    ("sgd", SGD, {"lr": 0.1}, lambda p, g: ref_sgd(p, g, 0.1)),
    ("sgd_momentum", SGD, {"lr": 0.1, "momentum": 0.9}, lambda p, g: ref_sgd(p, g, 0.1, 0.9)),
    (
        "sgd_dampening_wd",
        SGD,
        {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.01},
        lambda p, g: ref_sgd(p, g, 0.05, 0.8, 0.3, 0.01),
    ),
    (
        "sgd_nesterov",
        SGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
        lambda p, g: ref_sgd(p, g, 0.1, 0.9, wd=0.1, nesterov=True),
    ),
    ("adam", Adam, {"lr": 0.01}, lambda p, g: ref_adam(p, g, 0.01)),
    (
        "adam_wd",
        Adam,
        {"lr": 0.01, "weight_decay": 0.1, "betas": (0.8, 0.99)},
        lambda p, g: ref_adam(p, g, 0.01, 0.8, 0.99, wd=0.1),
    ),
    (
        "amsgrad",
        Adam,
        {"lr": 0.01, "amsgrad": True},
        lambda p, g: ref_adam(p, g, 0.01, amsgrad=True),
    ),
    ("adamw", AdamW, {"lr": 0.01}, lambda p, g: ref_adam(p, g, 0.01, wd=0.01, decoupled=True)),
    (
        "adamw_amsgrad",
        AdamW,
        {"lr": 0.02, "weight_decay": 0.1, "amsgrad": True, "eps": 1e-6},
        lambda p, g: ref_adam(p, g, 0.02, eps=1e-6, wd=0.1, amsgrad=True, decoupled=True),
    ),
]


@pytest.mark.parametrize(("name", "cls", "kw", "ref"), CASES, ids=[c[0] for c in CASES])
def test_steps_follow_formula(
    device: str, name: str, cls: Any, kw: dict[str, Any], ref: Any
) -> None:
    init = np.random.default_rng(1).normal(size=(3, 2))
    gs = grads_seq((3, 2))
    via_grad = nn.Parameter(rt.tensor(init, device=device))
    opt = cls([via_grad], **kw)
    for g in gs:
        via_grad.grad = rt.tensor(g, device=device)
        opt.step()
    np.testing.assert_allclose(via_grad.numpy(), ref(init, gs), rtol=1e-12, atol=1e-14)
    explicit = nn.Parameter(rt.tensor(init, device=device))
    opt2 = cls([explicit], **kw)
    for g in gs:
        opt2.step(grads=[g])  # host gradients are moved to the parameter's device
    assert explicit.grad is None
    np.testing.assert_array_equal(explicit.numpy(), via_grad.numpy())


def test_float32_params_stay_float32() -> None:
    p = nn.Parameter(rt.ones(4))
    opt = Adam([p], lr=0.1, amsgrad=True)
    opt.step(grads=[np.ones(4)])  # float64 gradient is cast to the parameter's dtype
    assert p.dtype == np.float32
    assert all(v.dtype == np.float32 for v in opt.state[p].values() if hasattr(v, "dtype"))


def test_explicit_grads_mapping_none_and_groups() -> None:
    a, b, c = (nn.Parameter(rt.tensor(np.ones(2))) for _ in range(3))
    opt = SGD([{"params": [a, b]}, {"params": [c], "lr": 1.0}], lr=0.1)
    assert opt.parameters() == [a, b, c]
    opt.step(grads={a: np.ones(2), c: rt.tensor(np.ones(2))})
    np.testing.assert_allclose(a.numpy(), [0.9, 0.9])
    np.testing.assert_allclose(b.numpy(), [1.0, 1.0])  # no gradient: untouched
    np.testing.assert_allclose(c.numpy(), [0.0, 0.0])  # its group's lr
    opt.step(grads=[None, np.ones(2), None])
    np.testing.assert_allclose(b.numpy(), [0.9, 0.9])


def test_explicit_grads_errors() -> None:
    p = nn.Parameter(rt.ones(2, 2))
    opt = SGD([p], lr=0.1)
    with pytest.raises(ConfigError, match="2 gradients for 1 parameters"):
        opt.step(grads=[np.ones((2, 2)), np.ones(2)])
    with pytest.raises(ConfigError, match=r"gradient 0 has shape \(4,\).*\(2, 2\)"):
        opt.step(grads=[np.ones(4)])


def test_bad_options_and_params() -> None:
    p = nn.Parameter(rt.ones(1))
    with pytest.raises(ConfigError, match="learning rate"):
        SGD([p], lr=-1)
    with pytest.raises(ConfigError, match="nesterov"):
        SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(ConfigError, match="betas"):
        Adam([p], betas=(1.0, 0.5))
    with pytest.raises(ConfigError, match="empty"):
        Adam([])
    with pytest.raises(ConfigError, match="two groups"):
        SGD([{"params": [p]}, {"params": [p]}], lr=0.1)


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_state_dict_resume_is_exact(cls: type[Optimizer]) -> None:
    kw: dict[str, Any] = (
        {"lr": 0.05, "momentum": 0.9} if cls is SGD else {"lr": 0.05, "amsgrad": True}
    )
    init = np.random.default_rng(2).normal(size=5)
    gs = grads_seq((5,), seed=3) * 2
    full = nn.Parameter(rt.tensor(init))
    opt = cls([full], **kw)
    for g in gs:
        opt.step(grads=[g])
    first = nn.Parameter(rt.tensor(init))
    opt_a = cls([first], **kw)
    for g in gs[:STEPS]:
        opt_a.step(grads=[g])
    saved = opt_a.state_dict()
    resumed = nn.Parameter(rt.tensor(first.numpy()))
    opt_b = cls([resumed], lr=123.0)
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == 0.05
    for g in gs[STEPS:]:
        opt_b.step(grads=[g])
    np.testing.assert_array_equal(resumed.numpy(), full.numpy())


def test_zero_grad_and_closure() -> None:
    p = nn.Parameter(rt.tensor([2.0]))
    opt = SGD([p], lr=0.25)

    def closure() -> rt.Tensor:
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 4.0 and math.isclose(p.item(), 1.0)
    opt.zero_grad()
    assert p.grad is None


def test_public_api_documented() -> None:
    from rpcdist import optim

    for name in optim.__all__:
        obj = getattr(optim, name)
        assert obj.__doc__ and obj.__module__ == "rpcdist.optim", name


@pytest.mark.parametrize(("name", "cls", "kw", "ref"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_in_place_updates_give_the_bits_of_the_plain_expressions(
    device: str, name: str, cls: Any, kw: dict[str, Any], ref: Any, dtype: Any, monkeypatch
) -> None:
    """The updates run in one scratch buffer per step (no temporaries); they
    must equal, bit for bit, the same formulas written as NumPy expressions,
    which is what they fall back to when a gradient's dtype or shape differs."""
    from rpcdist.optim import _optimizer

    shapes = [(5, 4), (4,), (), (2, 3, 2)]
    rng = np.random.default_rng(7)
    inits = [rng.normal(size=s).astype(dtype) for s in shapes]
    grads = [[rng.normal(size=s).astype(dtype) for s in shapes] for _ in range(STEPS)]

    def run() -> list[np.ndarray]:
        params = [nn.Parameter(rt.tensor(x.copy(), device=device)) for x in inits]
        opt = cls(params, **kw)
        for gs in grads:
            opt.step(grads=gs)
        return [p.numpy() for p in params]

    fast = run()
    monkeypatch.setattr(_optimizer.Scratch, "like", lambda self, data, grad: None)
    plain = run()
    for a, b in zip(fast, plain):
        assert a.dtype == dtype
        np.testing.assert_array_equal(a, b)
