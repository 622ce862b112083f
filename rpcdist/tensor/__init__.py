"""Local tensors with reverse-mode automatic differentiation, on NumPy or CuPy.

Example::

    from rpcdist import tensor as rt

    w = rt.randn(3, 2, requires_grad=True)
    loss = (rt.tensor([[1.0, 2.0, 3.0]]) @ w).relu().sum()
    loss.backward()
    w.grad            # d(loss)/dw

The engine's low-level entry point, :func:`run_backward` (and the
:class:`GraphTask` it returns), is what distributed autograd builds on; it
counts dependencies from extra start nodes, sums leaf gradients into a
caller-supplied map and hands :class:`RecvFunction` nodes to a callback.
"""

from __future__ import annotations

import numpy as _np

from .._publish import publish
from ._backward import backward, tensor_roots
from ._device import cuda_device_count, cuda_is_available
from ._engine import GraphTask, compute_dependencies, run_backward
from ._factories import (
    arange,
    from_numpy,
    full,
    ones,
    ones_like,
    rand,
    randn,
    tensor,
    zeros,
    zeros_like,
)
from ._function import Function
from ._grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from ._gradcheck import gradcheck
from ._node import AccumulateGrad, Node, RecvFunction, RemovableHandle, SendFunction
from ._ops_math import (
    abs,
    add,
    clamp,
    div,
    dropout,
    exp,
    gelu,
    log,
    matmul,
    mul,
    neg,
    pow,
    relu,
    sigmoid,
    sqrt,
    sub,
    tanh,
    where,
)
from ._ops_reduce import amax, amin, log_softmax, mean, softmax, sum
from ._ops_shape import (
    cat,
    chunk,
    expand,
    flatten,
    permute,
    reshape,
    split,
    squeeze,
    stack,
    transpose,
    unsqueeze,
)
from ._random import Generator, default_generator, manual_seed
from ._tensor import Tensor

float32 = _np.dtype(_np.float32)
float64 = _np.dtype(_np.float64)
int32 = _np.dtype(_np.int32)
int64 = _np.dtype(_np.int64)

__all__ = [
    "AccumulateGrad",
    "Function",
    "Generator",
    "GraphTask",
    "Node",
    "RecvFunction",
    "RemovableHandle",
    "SendFunction",
    "Tensor",
    "abs",
    "add",
    "amax",
    "amin",
    "arange",
    "backward",
    "cat",
    "chunk",
    "clamp",
    "compute_dependencies",
    "cuda_device_count",
    "cuda_is_available",
    "default_generator",
    "div",
    "dropout",
    "enable_grad",
    "exp",
    "expand",
    "flatten",
    "float32",
    "float64",
    "from_numpy",
    "full",
    "gelu",
    "gradcheck",
    "int32",
    "int64",
    "is_grad_enabled",
    "log",
    "log_softmax",
    "manual_seed",
    "matmul",
    "mean",
    "mul",
    "neg",
    "no_grad",
    "ones",
    "ones_like",
    "permute",
    "pow",
    "rand",
    "randn",
    "relu",
    "reshape",
    "run_backward",
    "set_grad_enabled",
    "sigmoid",
    "softmax",
    "split",
    "sqrt",
    "squeeze",
    "stack",
    "sub",
    "sum",
    "tanh",
    "tensor",
    "tensor_roots",
    "transpose",
    "unsqueeze",
    "where",
    "zeros",
    "zeros_like",
]

publish(__name__, __all__, globals())
