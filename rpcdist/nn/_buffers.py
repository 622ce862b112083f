"""Reusable NumPy buffers for the fused layers, so a training step stops faulting in pages.

A training step of a small recurrent model allocates and frees tens of
megabytes of large temporaries (gate activations, logits, their gradients).
glibc serves them from fresh ``mmap``\\ s or from a heap it trims back after
every step, so each step touches new pages: the language-model step of
``benchmarks/bench_tensor.py`` spent more time faulting them in than on its
arithmetic (docs/benchmarks.md, "Figures behind the code's choices").

:func:`empty` hands out arrays from a small pool instead. An array of the
pool is reused once nothing but the pool refers to it: its reference count
(CPython's, which counts every view, tensor, saved graph node or exported
buffer that holds it) is back at the pool's own. So outputs and gradients
can come from the pool too; they return to it when the last tensor holding
them goes away. Only NumPy arrays of at least :data:`MIN_BYTES` are pooled,
at most :data:`MAX_PER_SHAPE` per shape and :data:`MAX_BYTES` in all; other
requests, CuPy (which has its own pool) and interpreters without CPython's
reference counts get plain ``empty``.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["MAX_BYTES", "MAX_PER_SHAPE", "MIN_BYTES", "clear", "empty", "statistics"]

#: Smallest array worth pooling: below it malloc reuses memory by itself.
MIN_BYTES = 64 * 1024
#: Arrays kept per (shape, dtype).
MAX_PER_SHAPE = 8
#: Bytes kept in all; least recently used shapes are dropped first.
MAX_BYTES = 256 * 1024 * 1024

_lock = threading.Lock()
_pool: OrderedDict[tuple[tuple[int, ...], str], list[np.ndarray]] = OrderedDict()
_bytes = 0
_stats = {"hits": 0, "misses": 0}


def _refs(a: np.ndarray) -> int:
    return sys.getrefcount(a)


def _idle_count() -> int:
    """The count :func:`_refs` gives, inside a loop over a pool list, for an array nobody holds."""
    probe = [np.empty(1)]
    count = -1
    for a in probe:
        count = _refs(a)
    return count


def _usable() -> bool:
    if sys.implementation.name != "cpython":
        return False
    gil = getattr(sys, "_is_gil_enabled", None)
    return gil is None or bool(gil())


_IDLE = _idle_count() if _usable() else -1


def _take(arrays: list[np.ndarray]) -> np.ndarray | None:
    for a in arrays:
        if _refs(a) == _IDLE:
            return a
    return None


def _evict(need: int) -> None:
    """Drop idle arrays of the least recently used shapes until ``need`` more bytes fit."""
    global _bytes
    for key in list(_pool):
        if _bytes + need <= MAX_BYTES:
            return
        keep = []
        for a in _pool[key]:
            if _refs(a) == _IDLE:
                _bytes -= a.nbytes
            else:
                keep.append(a)
        if keep:
            _pool[key] = keep
        else:
            del _pool[key]


def empty(xp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype``, from the pool when it can.

    Args:
        xp: The array module (``numpy`` or ``cupy``).
        shape: The array's shape.
        dtype: The array's dtype.

    Returns:
        An array owning its memory (``base is None``) that no live object refers to.
    """
    dt = np.dtype(dtype)
    nbytes = dt.itemsize
    for n in shape:
        nbytes *= n
    if xp is not np or nbytes < MIN_BYTES or _IDLE < 0:
        return xp.empty(shape, dtype=dt)
    global _bytes
    key = (tuple(shape), dt.str)
    with _lock:
        arrays = _pool.get(key)
        if arrays is not None:
            _pool.move_to_end(key)
            found = _take(arrays)
            if found is not None:
                _stats["hits"] += 1
                return found
        _stats["misses"] += 1
        out = np.empty(key[0], dtype=dt)
        if arrays is not None and len(arrays) >= MAX_PER_SHAPE:
            return out
        if _bytes + nbytes > MAX_BYTES:
            _evict(nbytes)
            if _bytes + nbytes > MAX_BYTES:
                return out
        if arrays is None:
            arrays = _pool[key] = []
        arrays.append(out)
        _bytes += nbytes
        return out


def statistics() -> dict[str, int]:
    """Pool counters: arrays and bytes held, hits and misses so far."""
    with _lock:
        return {
            "arrays": sum(len(v) for v in _pool.values()),
            "bytes": _bytes,
            "hits": _stats["hits"],
            "misses": _stats["misses"],
        }


def clear() -> None:
    """Forget every pooled array and zero the counters (arrays in use stay valid)."""
    global _bytes
    with _lock:
        _pool.clear()
        _bytes = 0
        _stats["hits"] = _stats["misses"] = 0
