"""What the ``gpu`` tests need: a CUDA device that CuPy can see."""

from __future__ import annotations

import pytest


def cuda_devices() -> int:
    """How many CUDA devices CuPy sees (0 without CuPy or a driver)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def has_nccl() -> bool:
    """Whether CuPy has NCCL and sees a CUDA device."""
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception:
        return False
    return cuda_devices() >= 1


needs_gpu = pytest.mark.skipif(cuda_devices() < 1, reason="needs CuPy and a CUDA device")
