"""rpcdist.nn.init: the gains and bounds of torch.nn.init, the draws within
them, reproducible from a generator, and clear errors for what has no fan."""

from __future__ import annotations

import math

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import ConfigError
from rpcdist.nn import init


@pytest.mark.parametrize(
    ("name", "param", "gain"),
    [
        ("linear", None, 1.0),
        ("sigmoid", None, 1.0),
        ("conv2d", None, 1.0),
        ("tanh", None, 5.0 / 3),
        ("relu", None, math.sqrt(2.0)),
        ("leaky_relu", None, math.sqrt(2.0 / (1 + 0.01**2))),
        ("leaky_relu", 0.2, math.sqrt(2.0 / 1.04)),
    ],
)
def test_gains_are_torchs(name: str, param: float | None, gain: float) -> None:
    assert init.calculate_gain(name, param) == pytest.approx(gain, rel=1e-15)


def test_gains_match_torch_where_it_is_installed() -> None:
    torch = pytest.importorskip("torch")
    for name, param in (("tanh", None), ("relu", None), ("leaky_relu", None), ("leaky_relu", 3.0)):
        assert init.calculate_gain(name, param) == pytest.approx(
            torch.nn.init.calculate_gain(name, param), rel=1e-15
        )


def test_kaiming_and_xavier_draw_within_their_bounds_and_reach_them() -> None:
    w = rt.zeros(64, 32, 3, dtype=rt.float64)  # fan_in 96, fan_out 192
    cases = [
        (lambda: init.kaiming_uniform_(w, a=math.sqrt(5)), math.sqrt(2 / 6) * math.sqrt(3 / 96)),
        (
            lambda: init.kaiming_uniform_(w, mode="fan_out", nonlinearity="relu"),
            math.sqrt(2) * math.sqrt(3 / 192),
        ),
        (lambda: init.xavier_uniform_(w, gain=2.0), 2.0 * math.sqrt(6 / (96 + 192))),
    ]
    for fill, bound in cases:
        assert fill() is w
        x = w.numpy()
        assert np.abs(x).max() <= bound
        assert np.abs(x).max() > 0.99 * bound  # 6,144 uniform draws span it
        assert abs(x.mean()) < 0.05 * bound


def test_draws_repeat_from_a_seeded_generator_and_fill_helpers() -> None:
    a, b = rt.zeros(5, 4), rt.zeros(5, 4)
    init.normal_(a, mean=3.0, std=0.5, generator=rt.Generator().manual_seed(7))
    init.normal_(b, mean=3.0, std=0.5, generator=rt.Generator().manual_seed(7))
    assert a.dtype == np.float32 and np.array_equal(a.numpy(), b.numpy())
    big = init.normal_(rt.zeros(20_000, dtype=rt.float64), 3.0, 0.5, generator=rt.manual_seed(1))
    assert big.numpy().mean() == pytest.approx(3.0, abs=0.02)
    assert big.numpy().std() == pytest.approx(0.5, rel=0.03)
    u = init.uniform_(rt.zeros(1000), -2.0, -1.0, generator=rt.Generator().manual_seed(3))
    assert u.numpy().min() >= -2.0 and u.numpy().max() < -1.0
    t = rt.ones(2, 2)
    assert init.zeros_(t) is t and not t.numpy().any()
    assert init.ones_(t).numpy().tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert init.constant_(t, 0.25).numpy().tolist() == [[0.25, 0.25], [0.25, 0.25]]


def test_what_has_no_fan_or_no_gain_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"at least 2 dimensions, got shape \(4,\)"):
        init.kaiming_uniform_(rt.zeros(4))
    with pytest.raises(ConfigError, match="at least 2 dimensions"):
        init.xavier_uniform_(rt.zeros(4))
    with pytest.raises(ConfigError, match="mode must be 'fan_in' or 'fan_out', got 'fan'"):
        init.kaiming_uniform_(rt.zeros(2, 2), mode="fan")
    with pytest.raises(ConfigError, match="unknown nonlinearity 'gelu'"):
        init.calculate_gain("gelu")
