"""Finite-difference gradient checking for the engine and its users."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._errors import AutogradError
from ._backward import backward
from ._device import array_module
from ._grad_mode import no_grad
from ._random import Generator
from ._tensor import Tensor

__all__ = ["gradcheck"]


def _outputs(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    flat: list[Tensor] = []
    for o in out:
        flat.extend(_outputs(o))
    return flat


def gradcheck(
    fn: Callable[..., Any],
    inputs: Sequence[Tensor],
    *,
    eps: float = 1e-6,
    atol: float = 1e-6,
    rtol: float = 1e-4,
    seed: int = 0,
) -> bool:
    """Compare the engine's gradients of ``fn`` with central differences.

    The outputs (a Tensor or nested tuples of Tensors) are contracted with a
    fixed random weighting into one scalar. Use float64 inputs.

    Args:
        fn: Called as ``fn(*inputs)``.
        inputs: Tensors; those with ``requires_grad`` are checked.
        eps: Finite-difference step.
        atol: Absolute tolerance.
        rtol: Relative tolerance.
        seed: Seed of the output weighting.

    Returns:
        True when every gradient matches.

    Raises:
        AutogradError: a gradient differs; the message names the input, the
            element and both values.
    """
    gen = Generator(seed)
    outs = _outputs(fn(*inputs))
    weights = [
        array_module(o.data).asarray(gen.normal(o.shape, dtype=o.dtype))
        if o.shape
        else array_module(o.data).asarray(gen.normal((), dtype=o.dtype))
        for o in outs
    ]
    grad_map: dict[Tensor, Any] = {}
    live = [(o, w) for o, w in zip(outs, weights) if o.requires_grad]
    if live:
        backward([o for o, _ in live], [w for _, w in live], grad_map=grad_map)

    def scalar() -> float:
        with no_grad():
            total = 0.0
            for o, w in zip(_outputs(fn(*inputs)), weights):
                total += float((o.data * w).sum())
            return total

    for k, x in enumerate(inputs):
        if not isinstance(x, Tensor) or not x.requires_grad:
            continue
        data = x.data
        numeric = np.zeros(data.shape, dtype=np.float64)
        for idx in np.ndindex(*data.shape):
            orig = data[idx].item()
            data[idx] = orig + eps
            plus = scalar()
            data[idx] = orig - eps
            minus = scalar()
            data[idx] = orig
            numeric[idx] = (plus - minus) / (2 * eps)
        got = grad_map.get(x)
        analytic = (
            np.zeros(data.shape)
            if got is None
            else np.asarray(got if array_module(got) is np else got.get(), dtype=np.float64)
        )
        bad = ~np.isclose(analytic, numeric, atol=atol, rtol=rtol)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise AutogradError(
                f"gradcheck: input {k} (shape {x.shape}) element {where}: analytic "
                f"{analytic[where]!r} vs numeric {numeric[where]!r} "
                f"({int(bad.sum())} of {bad.size} elements differ)"
            )
    return True
