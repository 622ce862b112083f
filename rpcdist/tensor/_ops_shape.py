"""Shape operations: reshape, permute, expand, indexing, cat/stack/split."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import ConfigError
from ._device import array_module
from ._function import Function, unbroadcast

if TYPE_CHECKING:
    from ._tensor import Tensor

__all__ = [
    "cat",
    "chunk",
    "expand",
    "flatten",
    "index",
    "permute",
    "reshape",
    "split",
    "squeeze",
    "stack",
    "transpose",
    "unsqueeze",
]


def _dims(args: Sequence[Any]) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], list | tuple):
        return tuple(int(a) for a in args[0])
    return tuple(int(a) for a in args)


class Reshape(Function):
    __slots__ = ("src",)

    def forward(self, a: Any, *, shape: tuple[int, ...]) -> Any:
        self.src = a.shape
        return a.reshape(shape)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g.reshape(self.src),)


class Permute(Function):
    __slots__ = ("dims",)

    def forward(self, a: Any, *, dims: tuple[int, ...]) -> Any:
        if sorted(d % max(a.ndim, 1) for d in dims) != list(range(a.ndim)):
            raise ValueError(f"dims {dims} are not a permutation of {a.ndim} dimensions")
        self.dims = dims
        return a.transpose(dims)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g.transpose(np.argsort([d % g.ndim for d in self.dims])),)


class Expand(Function):
    __slots__ = ("src",)

    def forward(self, a: Any, *, shape: tuple[int, ...]) -> Any:
        lead = len(shape) - a.ndim
        if lead < 0:
            raise ValueError(f"cannot expand {a.ndim} dimensions to {len(shape)}")
        full = tuple(a.shape[i - lead] if s == -1 else s for i, s in enumerate(shape))
        self.src = a.shape
        return array_module(a).broadcast_to(a, full)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (unbroadcast(g, self.src),)


def _normalize_index(index: Any, xp: Any) -> tuple[tuple[Any, ...], bool]:
    """The index as a tuple of NumPy-style components; and whether it is basic."""
    from ._tensor import Tensor

    parts = index if isinstance(index, tuple) else (index,)
    out: list[Any] = []
    basic = True
    for p in parts:
        if isinstance(p, Tensor):
            p = p.data
        elif isinstance(p, list):
            p = np.asarray(p)
        if p is None or p is Ellipsis or isinstance(p, slice | int | np.integer):
            out.append(p)
            continue
        if not hasattr(p, "dtype"):
            raise TypeError(f"unsupported index component {p!r}")
        if p.dtype.kind not in "biu":
            raise TypeError(f"index arrays must be integer or boolean, got dtype {p.dtype}")
        if p.ndim == 0 and p.dtype.kind != "b":
            out.append(int(p))
            continue
        p = xp.asarray(p)
        basic = False
        if p.dtype.kind == "b":
            out.extend(p.nonzero())
        else:
            out.append(p)
    return tuple(out), basic


class Index(Function):
    __slots__ = ("basic", "dtype", "idx", "src")

    def forward(self, a: Any, *, index: Any) -> Any:
        xp = array_module(a)
        self.idx, self.basic = _normalize_index(index, xp)
        self.src, self.dtype = a.shape, a.dtype
        return a[self.idx]

    def backward(self, g: Any) -> tuple[Any, ...]:
        xp = array_module(g)
        gx = xp.zeros(self.src, dtype=self.dtype)
        if self.basic:
            gx[self.idx] = g
        else:
            xp.add.at(gx, self.idx, g)
        return (gx,)


class Cat(Function):
    __slots__ = ("axis", "sizes")

    def forward(self, *arrays: Any, axis: int) -> Any:
        xp = array_module(arrays[0])
        self.axis = axis
        self.sizes = [a.shape[axis] for a in arrays]
        return xp.concatenate(arrays, axis=axis)

    def backward(self, g: Any) -> tuple[Any, ...]:
        axis = self.axis % g.ndim
        out = []
        start = 0
        for size, need in zip(self.sizes, self.needs_input_grad):
            sl = (slice(None),) * axis + (slice(start, start + size),)
            out.append(g[sl] if need else None)
            start += size
        return tuple(out)


class Stack(Function):
    __slots__ = ("axis",)

    def forward(self, *arrays: Any, axis: int) -> Any:
        xp = array_module(arrays[0])
        out = xp.stack(arrays, axis=axis)
        self.axis = axis % out.ndim
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        lead = (slice(None),) * self.axis
        return tuple(
            g[(*lead, i)] if need else None for i, need in enumerate(self.needs_input_grad)
        )


class Split(Function):
    __slots__ = ("axis", "bounds", "dtype", "src")

    def forward(self, a: Any, *, bounds: list[tuple[int, int]], axis: int) -> Any:
        self.axis = axis % a.ndim
        self.bounds, self.src, self.dtype = bounds, a.shape, a.dtype
        lead = (slice(None),) * self.axis
        return tuple(a[(*lead, slice(s, e))] for s, e in bounds)

    def backward(self, *grads: Any) -> tuple[Any, ...]:
        xp = array_module(next(g for g in grads if g is not None))
        if all(g is not None for g in grads):
            return (xp.concatenate(grads, axis=self.axis),)
        gx = xp.zeros(self.src, dtype=self.dtype)
        lead = (slice(None),) * self.axis
        for (s, e), g in zip(self.bounds, grads):
            if g is not None:
                gx[(*lead, slice(s, e))] = g
        return (gx,)


def reshape(a: Tensor, *shape: Any) -> Tensor:
    """``a`` with a new shape (one entry may be -1).

    Raises:
        ConfigError: the sizes do not match.
    """
    return Reshape.call(a, shape=_dims(shape))  # type: ignore[no-any-return]


def flatten(a: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """Merge dimensions ``start_dim..end_dim`` (inclusive) into one."""
    shape = a.shape
    if not shape:
        return reshape(a, 1)
    s, e = start_dim % len(shape), end_dim % len(shape)
    return reshape(a, *shape[:s], -1, *shape[e + 1 :])


def permute(a: Tensor, *dims: Any) -> Tensor:
    """``a`` with its dimensions reordered."""
    return Permute.call(a, dims=_dims(dims))  # type: ignore[no-any-return]


def transpose(a: Tensor, dim0: int, dim1: int) -> Tensor:
    """``a`` with dimensions ``dim0`` and ``dim1`` swapped."""
    dims = list(range(a.ndim))
    dims[dim0], dims[dim1] = dims[dim1], dims[dim0]
    return permute(a, *dims)


def expand(a: Tensor, *sizes: Any) -> Tensor:
    """``a`` broadcast to ``sizes`` (-1 keeps a dimension)."""
    return Expand.call(a, shape=_dims(sizes))  # type: ignore[no-any-return]


def squeeze(a: Tensor, dim: int | None = None) -> Tensor:
    """Remove dimension ``dim`` if it has size 1 (every size-1 dimension if None)."""
    shape = a.shape
    if dim is None:
        new = tuple(s for s in shape if s != 1)
    else:
        d = dim % max(len(shape), 1)
        new = shape if not shape or shape[d] != 1 else shape[:d] + shape[d + 1 :]
    return a if new == shape else reshape(a, new)


def unsqueeze(a: Tensor, dim: int) -> Tensor:
    """Insert a dimension of size 1 at ``dim`` (negative counts from the end)."""
    shape = a.shape
    d = dim if dim >= 0 else dim + len(shape) + 1
    if not 0 <= d <= len(shape):
        raise ConfigError(f"unsqueeze: dim {dim} out of range for shape {shape}")
    return reshape(a, *shape[:d], 1, *shape[d:])


def index(a: Tensor, index: Any) -> Tensor:
    """``a[index]``: slices, ints, None, Ellipsis, integer or boolean arrays.

    The gradient scatter-adds, so repeated indices accumulate.
    """
    return Index.call(a, index=index)  # type: ignore[no-any-return]


def cat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Concatenate along an existing axis.

    Raises:
        ConfigError: empty input, or shapes that differ off ``axis``.
    """
    if not tensors:
        raise ConfigError("cat: expected at least one tensor")
    return Cat.call(*tensors, axis=axis)  # type: ignore[no-any-return]


def stack(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Stack equally shaped tensors along a new axis.

    Raises:
        ConfigError: empty input or differing shapes.
    """
    if not tensors:
        raise ConfigError("stack: expected at least one tensor")
    return Stack.call(*tensors, axis=axis)  # type: ignore[no-any-return]


def split(a: Tensor, split_size_or_sections: Any, dim: int = 0) -> tuple[Tensor, ...]:
    """Split along ``dim`` into pieces of one size (last may be smaller) or given sizes.

    Raises:
        ConfigError: sizes that do not add up to the dimension.
    """
    n = a.shape[dim]
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        if step <= 0:
            raise ConfigError(f"split: split size must be positive, got {step}")
        sizes = [min(step, n - s) for s in range(0, n, step)] or [0]
    else:
        sizes = [int(s) for s in split_size_or_sections]
        if sum(sizes) != n:
            raise ConfigError(
                f"split: sections {sizes} do not add up to dimension {dim} of shape {a.shape}"
            )
    bounds = []
    start = 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    out = Split.call(a, bounds=bounds, axis=dim)
    return out if isinstance(out, tuple) else (out,)


def chunk(a: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    """Split along ``dim`` into ``chunks`` pieces of size ``ceil(n / chunks)``."""
    if chunks <= 0:
        raise ConfigError(f"chunk: chunks must be positive, got {chunks}")
    n = a.shape[dim]
    return split(a, max(1, -(-n // chunks)), dim)
