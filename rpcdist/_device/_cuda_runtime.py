"""The CUDA runtime calls CUDA IPC makes (through CuPy, imported on first
use), and the staging blocks they allocate (see ``_cuda_ipc``)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Block", "Runtime"]


class Runtime:
    """The CUDA runtime calls this module makes, through CuPy (tests swap in a fake)."""

    def __init__(self) -> None:
        self.cupy: Any = importlib.import_module("cupy")  # (waits for a thread importing it)
        self._rt = self.cupy.cuda.runtime

    def current_device(self) -> int:
        return int(self._rt.getDevice())

    def malloc(self, device: int, nbytes: int) -> int:
        with self.cupy.cuda.Device(device):
            return int(self._rt.malloc(nbytes))

    def free(self, device: int, ptr: int) -> None:
        with self.cupy.cuda.Device(device):
            self._rt.free(ptr)

    def export(self, device: int, ptr: int) -> bytes:
        with self.cupy.cuda.Device(device):
            return bytes(self._rt.ipcGetMemHandle(ptr))

    def open(self, handle: bytes, device: int) -> int:
        """Map an exported block into this process, in ``device``'s context."""
        with self.cupy.cuda.Device(device):
            return int(self._rt.ipcOpenMemHandle(handle, self._rt.cudaIpcMemLazyEnablePeerAccess))

    def close(self, ptr: int) -> None:
        self._rt.ipcCloseMemHandle(ptr)

    def stage(self, array: Any, ptr: int) -> None:
        """Copy C-contiguous ``array`` to device pointer ``ptr``; return when done."""
        with array.device:
            stream = self.cupy.cuda.get_current_stream()
            self._rt.memcpyAsync(ptr, array.data.ptr, array.nbytes, 3, stream.ptr)
            stream.synchronize()

    def fetch(self, ptr: int, shape: tuple[int, ...], dtype: Any, out: Any = None) -> Any:
        """A new array on the current device (or ``out``) with the bytes at
        ``ptr``; done when returned."""
        if out is None:
            out = self.cupy.empty(shape, dtype)
        stream = self.cupy.cuda.get_current_stream()
        self._rt.memcpyAsync(out.data.ptr, ptr, out.nbytes, 4, stream.ptr)  # cudaMemcpyDefault
        stream.synchronize()
        return out

    def write(self, device: int, ptr: int, data: bytes) -> None:
        src = np.frombuffer(data, np.uint8)
        with self.cupy.cuda.Device(device):
            self._rt.memcpy(ptr, src.ctypes.data, src.nbytes, 1)  # host to device

    def read(self, ptr: int, nbytes: int) -> bytes:
        dst = np.empty(nbytes, np.uint8)
        self._rt.memcpy(dst.ctypes.data, ptr, nbytes, 4)
        return dst.tobytes()

    def device_of(self, array: Any) -> int:
        return int(array.device.id)


@dataclass(slots=True, eq=False)
class Block:
    id: int
    device: int
    size: int
    ptr: int
    handle: bytes
    #: The peers it was lent to (they may have it mapped).
    peers: set[int] = field(default_factory=set)
    idle_since: float = 0.0
