"""rpcdist: asyncio-native RPC, remote references, distributed autograd and collectives.

Vocabulary follows ``torch.distributed.rpc``::

    import rpcdist
    rpcdist.init_rpc("worker0", rank=0, world_size=2)
    ret = rpcdist.rpc_sync("worker1", operator.add, args=(2, 3))
    fut = rpcdist.rpc_async("worker1", operator.add, args=(2, 3))  # await it too
    rpcdist.shutdown()

Submodules: ``rpcdist.functions``, ``rpcdist.futures``, ``rpcdist.testing``,
``rpcdist.tensor``, ``rpcdist.nn``, ``rpcdist.optim``, ``rpcdist.collectives``,
``rpcdist.data``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import functions, futures
from ._deadline import UNSET
from ._errors import (
    AutogradError,
    CallPolicyError,
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
from ._publish import publish
from ._worker import WorkerInfo

if TYPE_CHECKING:  # imported on first use (below), so `import rpcdist.tensor` stays light
    from ._rpc._api import (
        debug_info,
        get_rpc_timeout,
        get_worker_info,
        init_rpc,
        rpc_async,
        rpc_sync,
        set_rpc_timeout,
        shutdown,
        statistics,
    )
    from ._rref._rref import RRef, remote
    from ._save import load, save
    from ._serialization import register_type
    from ._serialization._exposure import expose
    from ._spawn import ProcessFailedError, spawn

__version__ = "0.1.0"

__all__ = [
    "UNSET",
    "AutogradError",
    "CallPolicyError",
    "ClosedError",
    "CollectiveError",
    "ConfigError",
    "ConnectError",
    "Future",
    "NotInitializedError",
    "OwnerLostError",
    "ProcessFailedError",
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
    "debug_info",
    "expose",
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
    "spawn",
    "statistics",
]


#: Names imported on first use, and the private module each lives in.
_LAZY = {
    **dict.fromkeys(
        [
            "debug_info",
            "get_rpc_timeout",
            "get_worker_info",
            "init_rpc",
            "rpc_async",
            "rpc_sync",
            "set_rpc_timeout",
            "shutdown",
            "statistics",
        ],
        "._rpc._api",
    ),
    "RRef": "._rref._rref",
    "remote": "._rref._rref",
    "load": "._save",
    "save": "._save",
    "register_type": "._serialization",
    "spawn": "._spawn",
    "ProcessFailedError": "._spawn",
    "expose": "._serialization._exposure",
}
_LAZY_MODULES = {
    "tensor",
    "nn",
    "optim",
    "collectives",
    "autograd",
    "testing",
    "parallel",
    "launch",
    "data",
}

publish(__name__, [n for n in __all__ if n not in _LAZY], globals())


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is not None:
        obj = getattr(importlib.import_module(where, __name__), name)
        publish(__name__, [name], {name: obj})
        globals()[name] = obj
        return obj
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'rpcdist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
