"""Seeded random numbers for factories, initialisers and dropout."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._device import array_module, device_of, move_to

__all__ = ["Generator", "default_generator", "manual_seed"]


class Generator:
    """A seeded source of random numbers (NumPy's PCG64 underneath).

    Draws are made on the host and moved to the requested device, so a seed
    gives the same numbers on CPU and GPU; dropout masks on a GPU are drawn
    there from a seed taken from this generator.

    Args:
        seed: Integer seed; None draws fresh entropy.
    """

    __module__ = "rpcdist.tensor"

    def __init__(self, seed: int | None = None) -> None:
        self._lock = threading.Lock()
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._seed = seed

    def manual_seed(self, seed: int) -> Generator:
        """Re-seed in place and return self."""
        with self._lock:
            self._rng = np.random.Generator(np.random.PCG64(seed))
            self._seed = seed
        return self

    def initial_seed(self) -> int | None:
        """The seed last given (None if seeded from entropy)."""
        return self._seed

    def get_state(self) -> dict[str, Any]:
        """The generator's state, to restore with :meth:`set_state`."""
        with self._lock:
            return dict(self._rng.bit_generator.state)

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore a state returned by :meth:`get_state`."""
        with self._lock:
            self._rng.bit_generator.state = state

    def normal(
        self,
        shape: Sequence[int],
        *,
        mean: float = 0.0,
        std: float = 1.0,
        dtype: Any = np.float32,
        device: str = "cpu",
    ) -> Any:
        """An array of normal draws with ``mean`` and ``std``."""
        with self._lock:
            arr = self._rng.standard_normal(tuple(shape), dtype=np.float64)
        if std != 1.0:
            arr *= std
        if mean != 0.0:
            arr += mean
        return move_to(arr.astype(dtype, copy=False), device)

    def uniform(
        self,
        shape: Sequence[int],
        *,
        low: float = 0.0,
        high: float = 1.0,
        dtype: Any = np.float32,
        device: str = "cpu",
    ) -> Any:
        """An array of uniform draws from ``[low, high)``."""
        with self._lock:
            arr = self._rng.uniform(low, high, size=tuple(shape))
        return move_to(arr.astype(dtype, copy=False), device)

    def integers(self, low: int, high: int, shape: Sequence[int], *, device: str = "cpu") -> Any:
        """An int64 array of draws from ``[low, high)``."""
        with self._lock:
            arr = self._rng.integers(low, high, size=tuple(shape), dtype=np.int64)
        return move_to(arr, device)

    def permutation(self, n: int) -> np.ndarray[Any, Any]:
        """A random permutation of ``range(n)`` (int64, on the host)."""
        with self._lock:
            return self._rng.permutation(n)

    def _uniform_like(self, a: Any) -> Any:
        """Uniform [0, 1) draws shaped like ``a``, on its device, in its dtype."""
        xp = array_module(a)
        with self._lock:
            if xp is np:
                return self._rng.random(
                    a.shape, dtype=np.float32 if a.dtype == np.float32 else np.float64
                )
            seed = int(self._rng.integers(0, 2**63 - 1))
        with xp.cuda.Device(int(device_of(a).split(":")[1])):
            return xp.random.default_rng(seed).random(a.shape, dtype=a.dtype)


_DEFAULT = Generator(0)


def default_generator() -> Generator:
    """The process-wide generator used when none is given (seed 0 at start)."""
    return _DEFAULT


def manual_seed(seed: int) -> Generator:
    """Re-seed the default generator and return it."""
    return _DEFAULT.manual_seed(seed)
