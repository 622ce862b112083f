"""CuPy tensors cross workers with their gradients (needs CuPy and a CUDA device)."""

from __future__ import annotations

import numpy as np
import pytest

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist import RpcOptions
from rpcdist.tensor import Tensor, cuda_is_available
from rpcdist.testing import as_current, local_agents

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_is_available(), reason="needs CuPy and a CUDA device"),
]


def cube_on_device(x: Tensor) -> Tensor:
    assert x.device.startswith("cuda")
    return x * x * x


def test_a_cupy_tensor_and_its_gradient_cross_workers():
    import cupy

    with local_agents(2, options=RpcOptions(token=None)) as (a, _), as_current(a):
        x = Tensor(cupy.arange(1.0, 4.0), requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpcdist.rpc_sync("worker1", cube_on_device, args=(x,))
            assert isinstance(y.data, cupy.ndarray)
            dist_autograd.backward(cid, [y.sum()])
            g = dist_autograd.get_gradients(cid)[x]
        assert isinstance(g, cupy.ndarray)
        np.testing.assert_allclose(cupy.asnumpy(g), 3 * np.arange(1.0, 4.0) ** 2)
