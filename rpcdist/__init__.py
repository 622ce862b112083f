"""rpcdist: asyncio-native RPC, remote references, distributed autograd and collectives.

Vocabulary follows ``torch.distributed.rpc``::

    import rpcdist
    rpcdist.init_rpc("worker0", rank=0, world_size=2)
    ret = rpcdist.rpc_sync("worker1", operator.add, args=(2, 3))
    fut = rpcdist.rpc_async("worker1", operator.add, args=(2, 3))  # await it too
    rpcdist.shutdown()

Submodules: ``rpcdist.functions``, ``rpcdist.futures``, ``rpcdist.testing``,
``rpcdist.tensor``, ``rpcdist.nn``, ``rpcdist.optim``, ``rpcdist.collectives``.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import functions, futures
from ._deadline import UNSET
from ._errors import (
    AutogradError,
    ClosedError,
    CollectiveError,
    ConfigError,
    ConnectError,
    NotInitializedError,
    OwnerLostError,
    ProtocolError,
    RemoteError,
    RpcdistError,
    RpcError,
    RpcTimeoutError,
    RRefCreationError,
    RRefError,
    SerializationError,
    TransportError,
    WorkerLostError,
    WrongThreadError,
)
from ._futures import Future
from ._options import RpcOptions
from ._rpc._api import (
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    rpc_async,
    rpc_sync,
    set_rpc_timeout,
    shutdown,
)
from ._rref._rref import RRef, remote
from ._save import load, save
from ._serialization import register_type
from ._worker import WorkerInfo

__version__ = "0.1.0"

__all__ = [
    "UNSET",
    "AutogradError",
    "ClosedError",
    "CollectiveError",
    "ConfigError",
    "ConnectError",
    "Future",
    "NotInitializedError",
    "OwnerLostError",
    "ProtocolError",
    "RRef",
    "RRefCreationError",
    "RRefError",
    "RemoteError",
    "RpcError",
    "RpcOptions",
    "RpcTimeoutError",
    "RpcdistError",
    "SerializationError",
    "TransportError",
    "WorkerInfo",
    "WorkerLostError",
    "WrongThreadError",
    "functions",
    "futures",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "load",
    "register_type",
    "remote",
    "rpc_async",
    "rpc_sync",
    "save",
    "set_rpc_timeout",
    "shutdown",
]


def _publish(namespace: str, names: list[str], scope: dict[str, Any]) -> None:
    """Report the public namespace as ``__module__`` of re-exported names (as trio does)."""
    for name in names:
        obj = scope[name]
        mod = getattr(obj, "__module__", None)
        if isinstance(mod, str) and mod.startswith(namespace + "._"):
            try:
                obj.__module__ = namespace
            except (AttributeError, TypeError):
                pass


_publish(__name__, __all__, globals())

_LAZY_MODULES = {"tensor", "nn", "optim", "collectives", "autograd", "testing", "parallel"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'rpcdist' has no attribute {name!r}")
