"""Fixtures for the rpcdist.nn tests: the device parametrisation."""

from __future__ import annotations

import pytest

from rpcdist.tensor import cuda_is_available

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu, id="cuda")]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """``"cpu"``, and ``"cuda:0"`` where CuPy and a CUDA device are present."""
    dev: str = request.param
    if dev != "cpu" and not cuda_is_available():
        pytest.skip("CuPy or a CUDA device is not available")
    return dev
