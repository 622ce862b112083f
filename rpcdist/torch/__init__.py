"""PyTorch interop: PyTorch RPC programs run on rpcdist with their imports swapped.

==========================================  ==========================================
PyTorch                                     rpcdist
==========================================  ==========================================
``import torch.distributed.rpc as rpc``     ``import rpcdist.torch.rpc as rpc``
``import torch.distributed.autograd``       ``import rpcdist.torch.autograd``
``torch.distributed.optim``                 ``rpcdist.torch.optim``
``torch.distributed.nn.RemoteModule``       ``rpcdist.torch.nn.RemoteModule``
``torch.futures``                           ``rpcdist.torch.futures``
==========================================  ==========================================

Needs ``torch`` (the ``rpcdist[torch]`` extra); ``import rpcdist`` never
imports it. See ``docs/migrating.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["autograd", "futures", "nn", "optim", "rpc"]

_SUBMODULES = frozenset(__all__)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'rpcdist.torch' has no attribute {name!r}")
