"""Neural-network building blocks on :mod:`rpcdist.tensor`.

``Module`` registers parameters and submodules on attribute assignment and
round-trips its state through ``state_dict()`` (NumPy arrays). Layers are
initialised as PyTorch initialises them, from a seeded generator, and use
PyTorch's parameter names, so state dicts can be exchanged with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    # RemoteModule needs the RPC stack: loaded on first use, so that
    # ``import rpcdist.nn`` stays a local library.
    if name == "RemoteModule":
        from .._publish import publish

        obj = importlib.import_module("._remote", __name__).RemoteModule
        publish(__name__, [name], {name: obj})
        globals()[name] = obj
        return obj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
