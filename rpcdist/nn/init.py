"""Parameter initialisers, in place, seeded (PyTorch's ``nn.init`` rules)."""

from __future__ import annotations

import math

from .._errors import ConfigError
from ..tensor import Generator, Tensor, default_generator

__all__ = [
    "calculate_gain",
    "constant_",
    "kaiming_uniform_",
    "normal_",
    "ones_",
    "uniform_",
    "xavier_uniform_",
    "zeros_",
]


def _generator_or_default(generator: Generator | None) -> Generator:
    return generator if generator is not None else default_generator()


def _fan_in_and_out(t: Tensor) -> tuple[int, int]:
    if t.ndim < 2:
        raise ConfigError(f"fan in/out need at least 2 dimensions, got shape {t.shape}")
    receptive = math.prod(t.shape[2:])
    return t.shape[1] * receptive, t.shape[0] * receptive


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for a nonlinearity (as ``torch.nn.init``).

    Raises:
        ConfigError: unknown nonlinearity.
    """
    if nonlinearity in ("linear", "sigmoid", "conv1d", "conv2d", "conv3d"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else param
        return math.sqrt(2.0 / (1 + slope**2))
    raise ConfigError(f"unknown nonlinearity {nonlinearity!r}")


def uniform_(
    t: Tensor, a: float = 0.0, b: float = 1.0, *, generator: Generator | None = None
) -> Tensor:
    """Fill ``t`` with draws from ``U(a, b)``; returns ``t``."""
    t.data[...] = _generator_or_default(generator).uniform(
        t.shape, low=a, high=b, dtype=t.dtype, device=t.device
    )
    return t


def normal_(
    t: Tensor, mean: float = 0.0, std: float = 1.0, *, generator: Generator | None = None
) -> Tensor:
    """Fill ``t`` with draws from ``N(mean, std**2)``; returns ``t``."""
    t.data[...] = _generator_or_default(generator).normal(
        t.shape, mean=mean, std=std, dtype=t.dtype, device=t.device
    )
    return t


def constant_(t: Tensor, value: float) -> Tensor:
    """Fill ``t`` with ``value``; returns ``t``."""
    t.data[...] = value
    return t


def zeros_(t: Tensor) -> Tensor:
    """Fill ``t`` with zeros; returns ``t``."""
    return constant_(t, 0.0)


def ones_(t: Tensor) -> Tensor:
    """Fill ``t`` with ones; returns ``t``."""
    return constant_(t, 1.0)


def kaiming_uniform_(
    t: Tensor,
    a: float = 0.0,
    mode: str = "fan_in",
    nonlinearity: str = "leaky_relu",
    *,
    generator: Generator | None = None,
) -> Tensor:
    """He initialisation: ``U(-b, b)`` with ``b = gain * sqrt(3 / fan)``.

    Raises:
        ConfigError: unknown ``mode`` or nonlinearity, or ``t`` below 2-D.
    """
    fan_in, fan_out = _fan_in_and_out(t)
    if mode not in ("fan_in", "fan_out"):
        raise ConfigError(f"mode must be 'fan_in' or 'fan_out', got {mode!r}")
    fan = fan_in if mode == "fan_in" else fan_out
    bound = calculate_gain(nonlinearity, a) * math.sqrt(3.0 / fan)
    return uniform_(t, -bound, bound, generator=generator)


def xavier_uniform_(t: Tensor, gain: float = 1.0, *, generator: Generator | None = None) -> Tensor:
    """Glorot initialisation: ``U(-b, b)`` with ``b = gain * sqrt(6 / (fan_in + fan_out))``."""
    fan_in, fan_out = _fan_in_and_out(t)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(t, -bound, bound, generator=generator)
