"""Array-module dispatch: NumPy for ``"cpu"``, CuPy for ``"cuda:N"``.

CuPy is imported lazily, the first time a CUDA device or a CuPy array is
involved, so that importing rpcdist never needs a GPU.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np

from .._errors import ConfigError

__all__ = [
    "array_module",
    "check_same_device",
    "cuda_device_count",
    "cuda_is_available",
    "device_of",
    "move_to",
    "normalize_device",
]


def _cupy() -> ModuleType:
    try:
        import cupy as mod
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ConfigError(
            "a CUDA device was requested but CuPy is not installed (install rpcdist[gpu])"
        ) from exc
    cupy: ModuleType = mod
    return cupy


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    """The number of CUDA devices CuPy can see (0 without CuPy or a driver)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # ImportError, CUDARuntimeError, missing driver, ...
        return 0


def cuda_is_available() -> bool:
    """Whether CuPy is installed and at least one CUDA device is present."""
    return cuda_device_count() > 0


def array_module(arr: Any) -> ModuleType:
    """NumPy or CuPy: the module whose functions operate on ``arr``."""
    if isinstance(arr, np.ndarray | np.generic):
        return np
    if type(arr).__module__.startswith("cupy"):
        return _cupy()
    return np


def device_of(arr: Any) -> str:
    """The device string of an array: ``"cpu"`` or ``"cuda:N"``."""
    if isinstance(arr, np.ndarray | np.generic):
        return "cpu"
    if type(arr).__module__.startswith("cupy"):
        return f"cuda:{int(arr.device.id)}"
    return "cpu"


def normalize_device(device: object) -> str:
    """Canonical form of a device spec: ``"cpu"``, ``"cuda"``→``"cuda:0"``.

    Raises:
        ConfigError: the spec is neither ``"cpu"`` nor ``"cuda[:N]"``.
    """
    if device is None:
        return "cpu"
    text = str(device).strip().lower()
    if text == "cpu":
        return "cpu"
    if text == "cuda":
        return "cuda:0"
    if text.startswith("cuda:") and text[5:].isdigit():
        return f"cuda:{int(text[5:])}"
    raise ConfigError(f"unknown device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")


def move_to(arr: Any, device: str) -> Any:
    """Return ``arr`` on ``device`` (the same object when already there)."""
    src = device_of(arr)
    if src == device:
        return arr
    if device == "cpu":
        return arr.get()
    cupy = _cupy()
    index = int(device.split(":", 1)[1])
    if index >= cuda_device_count():
        raise ConfigError(
            f"device {device!r} requested but only {cuda_device_count()} CUDA device(s) present"
        )
    with cupy.cuda.Device(index):
        return cupy.asarray(arr)


def check_same_device(op: str, arrays: tuple[Any, ...]) -> None:
    """Raise unless every array in ``arrays`` lives on one device.

    Raises:
        ConfigError: naming ``op`` and the devices found.
    """
    first = type(arrays[0])
    if all(type(a) is first for a in arrays[1:]) and first is np.ndarray:
        return
    devices = [device_of(a) for a in arrays]
    if len(set(devices)) > 1:
        raise ConfigError(f"{op}: expected all tensors on one device, found {', '.join(devices)}")
