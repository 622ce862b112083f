"""Stateless layers and losses (``rpcdist.nn.functional``, torch's ``F``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import ConfigError
from ..tensor import Tensor, dropout, gelu, log_softmax, relu, sigmoid, softmax, tanh
from ..tensor._device import array_module
from ._fused import CrossEntropyFn, EmbeddingFn, LinearFn, NLLLossFn

__all__ = [
    "cross_entropy",
    "dropout",
    "embedding",
    "gelu",
    "linear",
    "log_softmax",
    "mse_loss",
    "nll_loss",
    "relu",
    "sigmoid",
    "softmax",
    "tanh",
]

_REDUCTIONS = ("mean", "sum", "none")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for ``x`` of shape ``(..., in_features)``.

    Raises:
        ConfigError: feature sizes or dtypes do not match.
    """
    if bias is None:
        return LinearFn.call(x, weight)  # type: ignore[no-any-return]
    return LinearFn.call(x, weight, bias)  # type: ignore[no-any-return]


def _index_array(idx: Any, like: Tensor) -> Any:
    arr = idx.data if isinstance(idx, Tensor) else idx
    if not hasattr(arr, "dtype"):
        arr = np.asarray(arr)
    return array_module(like.data).asarray(arr)


def embedding(idx: Any, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """Rows of ``weight`` at integer indices ``idx`` (any shape).

    Raises:
        ConfigError: non-integer indices.
    """
    return EmbeddingFn.call(_index_array(idx, weight), weight, padding_idx=padding_idx)  # type: ignore[no-any-return]


def _check_reduction(op: str, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ConfigError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _class_last(op: str, x: Tensor, target: Any) -> tuple[Tensor, Any, tuple[int, ...] | None]:
    """Bring ``(N, C, d...)`` to ``(N*d..., C)``; return the shape to restore."""
    if x.ndim == 1:
        return x.unsqueeze(0), target.reshape(1), ()
    if x.ndim == 2:
        return x, target, None
    if x.ndim < 1:
        raise ConfigError(f"{op}: input must have a class dimension, got shape {x.shape}")
    dims = (0, *range(2, x.ndim), 1)
    rest = (x.shape[0], *x.shape[2:])
    if tuple(target.shape) != rest:
        raise ConfigError(f"{op}: target shape {tuple(target.shape)} != {rest} for input {x.shape}")
    return x.permute(*dims).reshape(-1, x.shape[1]), target.reshape(-1), rest


def cross_entropy(
    input: Tensor,
    target: Any,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> Tensor:
    """Cross entropy between logits ``(N, C)`` (or ``(C,)``, ``(N, C, d...)``) and class indices.

    Args:
        input: Unnormalised scores, classes along dimension 1.
        target: Integer class indices of the input's shape without the class
            dimension.
        reduction: ``"mean"`` (over non-ignored targets), ``"sum"`` or ``"none"``.
        ignore_index: Targets equal to it contribute nothing.

    Raises:
        ConfigError: shapes, dtypes or reduction are wrong, or a target is
            outside ``[0, C)``.
    """
    _check_reduction("cross_entropy", reduction)
    t = _index_array(target, input)
    x2, t2, restore = _class_last("cross_entropy", input, t)
    out = CrossEntropyFn.call(x2, t2, reduction=reduction, ignore_index=ignore_index)
    return out if restore is None or reduction != "none" else out.reshape(restore)  # type: ignore[no-any-return]


def nll_loss(
    input: Tensor,
    target: Any,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> Tensor:
    """Negative log-likelihood of class indices given log-probabilities.

    Same shapes and options as :func:`cross_entropy`.

    Raises:
        ConfigError: shapes, dtypes or reduction are wrong.
    """
    _check_reduction("nll_loss", reduction)
    t = _index_array(target, input)
    x2, t2, restore = _class_last("nll_loss", input, t)
    out = NLLLossFn.call(x2, t2, reduction=reduction, ignore_index=ignore_index)
    return out if restore is None or reduction != "none" else out.reshape(restore)  # type: ignore[no-any-return]


def mse_loss(
    input: Tensor,
    target: Any,
    *,
    reduction: str = "mean",
) -> Tensor:
    """Mean squared error between equally shaped ``input`` and ``target``.

    Raises:
        ConfigError: the shapes differ or the reduction is unknown.
    """
    _check_reduction("mse_loss", reduction)
    tshape = tuple(getattr(target, "shape", ()))
    if tshape != input.shape:
        raise ConfigError(f"mse_loss: input shape {input.shape} != target shape {tshape}")
    diff: Tensor = input - target
    sq = diff * diff
    if reduction == "none":
        return sq
    return sq.sum() if reduction == "sum" else sq.mean()
