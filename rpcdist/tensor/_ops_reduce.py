"""Reductions (sum, mean, max, min) and the softmax family."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._device import array_module
from ._function import Function

if TYPE_CHECKING:
    from ._tensor import Tensor

__all__ = ["amax", "amin", "log_softmax", "mean", "softmax", "sum"]

Axis = int | Sequence[int] | None


def _axes(axis: Axis, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    out = []
    for a in axis:
        if not -ndim <= a < max(ndim, 1):
            raise ValueError(f"axis {a} is out of range for {ndim} dimensions")
        out.append(a % max(ndim, 1))
    return tuple(sorted(set(out)))


def _expand(g: Any, axes: tuple[int, ...], keepdims: bool, src: tuple[int, ...]) -> Any:
    """``g`` with the reduced ``axes`` of shape ``src`` put back as size 1."""
    if keepdims or not axes:
        return g
    if len(axes) == len(src):  # a full reduction: broadcasting takes the scalar as it is
        return g
    return g.reshape(tuple(1 if i in axes else n for i, n in enumerate(src)))


class Sum(Function):
    __slots__ = ("axes", "keepdims", "src")

    def forward(self, a: Any, *, axis: Axis, keepdims: bool) -> Any:
        self.axes, self.keepdims, self.src = _axes(axis, a.ndim), keepdims, a.shape
        return a.sum(axis=self.axes, keepdims=keepdims)

    def backward(self, g: Any) -> tuple[Any, ...]:
        xp = array_module(g)
        return (xp.broadcast_to(_expand(g, self.axes, self.keepdims, self.src), self.src),)


class Mean(Function):
    __slots__ = ("axes", "keepdims", "src")

    def forward(self, a: Any, *, axis: Axis, keepdims: bool) -> Any:
        self.axes, self.keepdims, self.src = _axes(axis, a.ndim), keepdims, a.shape
        return a.mean(axis=self.axes, keepdims=keepdims)

    def backward(self, g: Any) -> tuple[Any, ...]:
        xp = array_module(g)
        n = math.prod(self.src[i] for i in self.axes)
        g = _expand(g, self.axes, self.keepdims, self.src) / n
        return (xp.broadcast_to(g, self.src),)


class Amax(Function):
    """Max over axes; tied maxima share the gradient equally."""

    __slots__ = ("a", "axes", "keepdims", "out")

    def _reduce(self, a: Any) -> Any:
        return a.max(axis=self.axes, keepdims=True)

    def forward(self, a: Any, *, axis: Axis, keepdims: bool) -> Any:
        if a.size == 0:
            raise ValueError("reduction of an empty tensor")
        self.axes, self.keepdims, self.a = _axes(axis, a.ndim), keepdims, a
        out = self.out = self._reduce(a)
        if keepdims:
            return out
        return out.reshape(tuple(s for i, s in enumerate(a.shape) if i not in self.axes))

    def backward(self, g: Any) -> tuple[Any, ...]:
        mask = self.a == self.out
        count = mask.sum(axis=self.axes, keepdims=True)
        g = _expand(g, self.axes, self.keepdims, self.a.shape) / count
        return (mask * g,)


class Amin(Amax):
    """Min over axes; tied minima share the gradient equally."""

    __slots__ = ()

    def _reduce(self, a: Any) -> Any:
        return a.min(axis=self.axes, keepdims=True)


class Softmax(Function):
    __slots__ = ("axis", "out")

    def forward(self, a: Any, *, axis: int) -> Any:
        xp = array_module(a)
        e = xp.exp(a - a.max(axis=axis, keepdims=True))
        e /= e.sum(axis=axis, keepdims=True)
        self.axis, self.out = axis, e
        return e

    def backward(self, g: Any) -> tuple[Any, ...]:
        out = self.out
        gy = g * out
        return (gy - out * gy.sum(axis=self.axis, keepdims=True),)


class LogSoftmax(Function):
    __slots__ = ("axis", "out")

    def forward(self, a: Any, *, axis: int) -> Any:
        xp = array_module(a)
        shifted = a - a.max(axis=axis, keepdims=True)
        shifted -= xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
        self.axis, self.out = axis, shifted
        return shifted

    def backward(self, g: Any) -> tuple[Any, ...]:
        xp = array_module(g)
        return (g - xp.exp(self.out) * g.sum(axis=self.axis, keepdims=True),)


def sum(a: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Sum over ``axis`` (an int, a tuple, or None for all)."""
    return Sum.call(a, axis=axis, keepdims=keepdims)  # type: ignore[no-any-return]


def mean(a: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis`` (an int, a tuple, or None for all)."""
    return Mean.call(a, axis=axis, keepdims=keepdims)  # type: ignore[no-any-return]


def amax(a: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Maximum over ``axis``; tied maxima share the gradient equally."""
    return Amax.call(a, axis=axis, keepdims=keepdims)  # type: ignore[no-any-return]


def amin(a: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Minimum over ``axis``; tied minima share the gradient equally."""
    return Amin.call(a, axis=axis, keepdims=keepdims)  # type: ignore[no-any-return]


def softmax(a: Tensor, axis: int = -1) -> Tensor:
    """``exp(a) / sum(exp(a))`` along ``axis``, computed without overflow."""
    return Softmax.call(a, axis=axis)  # type: ignore[no-any-return]


def log_softmax(a: Tensor, axis: int = -1) -> Tensor:
    """``a - logsumexp(a)`` along ``axis``, computed without overflow."""
    return LogSoftmax.call(a, axis=axis)  # type: ignore[no-any-return]
