"""Neural-network building blocks on :mod:`rpcdist.tensor`.

``Module`` registers parameters and submodules on attribute assignment and
round-trips its state through ``state_dict()`` (NumPy arrays). Layers are
initialised as PyTorch initialises them, from a seeded generator, and use
PyTorch's parameter names, so state dicts can be exchanged with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._publish import lazy
from . import functional, init
from ._layers import GELU, Dropout, Embedding, Identity, Linear, ReLU, Sequential, Sigmoid, Tanh
from ._lstm import LSTM
from ._module import IncompatibleKeys, Module, Parameter

__all__ = [
    "GELU",
    "LSTM",
    "Dropout",
    "Embedding",
    "Identity",
    "IncompatibleKeys",
    "Linear",
    "Module",
    "Parameter",
    "ReLU",
    "RemoteModule",
    "Sequential",
    "Sigmoid",
    "Tanh",
    "functional",
    "init",
]

if TYPE_CHECKING:
    from ._remote import RemoteModule


# It needs the RPC stack: loaded on first use, so ``import rpcdist.nn`` stays local.
__getattr__ = lazy(__name__, globals(), {"RemoteModule": "._remote"})
