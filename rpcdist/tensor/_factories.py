"""Tensor factories: ``tensor``, ``zeros``, ``ones``, ``full``, ``arange``, random."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._device import move_to, normalize_device
from ._random import Generator, default_generator
from ._tensor import Tensor

__all__ = [
    "arange",
    "from_numpy",
    "full",
    "ones",
    "ones_like",
    "rand",
    "randn",
    "tensor",
    "zeros",
    "zeros_like",
]

#: Floating-point dtype used when none is given (as in PyTorch).
DEFAULT_DTYPE = np.dtype(np.float32)


def _shape(args: Sequence[Any]) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], list | tuple):
        return tuple(int(s) for s in args[0])
    return tuple(int(s) for s in args)


def _finish(arr: Any, device: Any, requires_grad: bool) -> Tensor:
    return Tensor(move_to(arr, normalize_device(device)), requires_grad=requires_grad)


def tensor(
    data: Any, *, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False
) -> Tensor:
    """A new tensor holding a copy of ``data``.

    Python floats become float32 unless ``dtype`` says otherwise; arrays keep
    their dtype.

    Raises:
        AutogradError: ``requires_grad`` with a non-floating dtype.
    """
    if isinstance(data, Tensor):
        data = data.data
    if isinstance(data, np.ndarray) or type(data).__module__.startswith("cupy"):
        arr = data.astype(dtype if dtype is not None else data.dtype, copy=True)
    else:
        arr = np.array(data, dtype=dtype)
        if dtype is None and arr.dtype == np.float64:
            arr = arr.astype(DEFAULT_DTYPE)
    return _finish(arr, device, requires_grad)


def from_numpy(array: np.ndarray[Any, Any]) -> Tensor:
    """A tensor sharing memory with ``array``."""
    return Tensor(array)


def zeros(
    *shape: Any, dtype: Any = DEFAULT_DTYPE, device: Any = "cpu", requires_grad: bool = False
) -> Tensor:
    """A tensor of zeros of ``shape`` (ints or one tuple)."""
    return _finish(np.zeros(_shape(shape), dtype=dtype), device, requires_grad)


def ones(
    *shape: Any, dtype: Any = DEFAULT_DTYPE, device: Any = "cpu", requires_grad: bool = False
) -> Tensor:
    """A tensor of ones of ``shape`` (ints or one tuple)."""
    return _finish(np.ones(_shape(shape), dtype=dtype), device, requires_grad)


def full(
    shape: Sequence[int],
    fill_value: Any,
    *,
    dtype: Any = None,
    device: Any = "cpu",
    requires_grad: bool = False,
) -> Tensor:
    """A tensor of ``shape`` filled with ``fill_value``."""
    if dtype is None:
        dtype = DEFAULT_DTYPE if isinstance(fill_value, float) else np.asarray(fill_value).dtype
    return _finish(np.full(tuple(shape), fill_value, dtype=dtype), device, requires_grad)


def zeros_like(t: Tensor, *, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    """Zeros with ``t``'s shape, device and (unless given) dtype."""
    return zeros(t.shape, dtype=dtype or t.dtype, device=t.device, requires_grad=requires_grad)


def ones_like(t: Tensor, *, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    """Ones with ``t``'s shape, device and (unless given) dtype."""
    return ones(t.shape, dtype=dtype or t.dtype, device=t.device, requires_grad=requires_grad)


def arange(
    start: float,
    end: float | None = None,
    step: float = 1,
    *,
    dtype: Any = None,
    device: Any = "cpu",
    requires_grad: bool = False,
) -> Tensor:
    """Values from ``start`` (or 0) up to ``end`` (exclusive) by ``step``.

    The dtype is int64 for integer arguments, float32 otherwise.
    """
    if end is None:
        start, end = 0, start
    if dtype is None:
        ints = all(isinstance(v, int) for v in (start, end, step))
        dtype = np.int64 if ints else DEFAULT_DTYPE
    return _finish(np.arange(start, end, step, dtype=dtype), device, requires_grad)


def randn(
    *shape: Any,
    generator: Generator | None = None,
    dtype: Any = DEFAULT_DTYPE,
    device: Any = "cpu",
    requires_grad: bool = False,
) -> Tensor:
    """Standard normal draws of ``shape`` from ``generator`` (or the default one)."""
    gen = generator if generator is not None else default_generator()
    arr = gen.normal(_shape(shape), dtype=dtype, device=normalize_device(device))
    return Tensor(arr, requires_grad=requires_grad)


def rand(
    *shape: Any,
    generator: Generator | None = None,
    dtype: Any = DEFAULT_DTYPE,
    device: Any = "cpu",
    requires_grad: bool = False,
) -> Tensor:
    """Uniform ``[0, 1)`` draws of ``shape`` from ``generator`` (or the default one)."""
    gen = generator if generator is not None else default_generator()
    arr = gen.uniform(_shape(shape), dtype=dtype, device=normalize_device(device))
    return Tensor(arr, requires_grad=requires_grad)
