"""A stand-in for CuPy in tests without a GPU: arrays whose "device memory"
is a NumPy array, and a ``cupy`` module with the few functions rpcdist calls."""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest


class FakeArray:
    """Stands in for cupy.ndarray: device memory that is host memory here."""

    __module__ = "cupy"

    def __init__(self, host: np.ndarray[Any, Any]) -> None:
        self.host = host

    dtype = property(lambda self: self.host.dtype)
    ndim = property(lambda self: self.host.ndim)
    shape = property(lambda self: self.host.shape)
    nbytes = property(lambda self: self.host.nbytes)
    flags = property(lambda self: self.host.flags)
    T = property(lambda self: FakeArray(self.host.T))


def install(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Put a fake ``cupy`` module in ``sys.modules`` (undone with ``monkeypatch``)."""
    module = types.ModuleType("cupy")
    module.ndarray = FakeArray  # type: ignore[attr-defined]
    module.asnumpy = lambda a: np.ascontiguousarray(a.host)  # type: ignore[attr-defined]  # as CuPy's: C order
    module.asarray = lambda a: FakeArray(np.array(a))  # type: ignore[attr-defined]
    module.ascontiguousarray = lambda a: FakeArray(np.ascontiguousarray(a.host))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module
