"""``torch.distributed.rpc`` over rpcdist: ``import rpcdist.torch.rpc as rpc``.

A PyTorch RPC program keeps its code and swaps the import; tensors travel
zero-copy on CPU and ``nn.Module`` objects travel without pickle (see
``docs/migrating.md``). :class:`RRef` and :class:`WorkerInfo` are rpcdist's
own: ``owner()``, ``owner_name()``, ``is_owner()``, ``local_value()``,
``to_here()`` and the ``rpc_sync()``/``rpc_async()``/``remote()`` proxies
behave as torch's.
"""

from __future__ import annotations

from ..._publish import publish
from ..._rref._rref import RRef
from ..._worker import WorkerInfo
from .._rpc import (
    BackendType,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    _set_rpc_timeout,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from . import api, constants, functions
from .api import _get_current_rpc_agent, _is_current_rpc_agent_set

__all__ = [
    "BackendType",
    "RRef",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "_get_current_rpc_agent",
    "_is_current_rpc_agent_set",
    "_set_rpc_timeout",
    "api",
    "constants",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

_MODULES = ("RRef", "WorkerInfo", "api", "constants", "functions")
publish(__name__, [n for n in __all__ if n not in _MODULES], globals())
