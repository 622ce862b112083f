"""The two homes a PyTorch RPC program can run in: PyTorch's own RPC or rpcdist.torch.

Test programs import their RPC names through :func:`use`, so one program
runs under both, and a test compares what they learn.
"""

from __future__ import annotations

import types
from typing import Any


def use(flavor: str) -> types.SimpleNamespace:
    """The modules a PyTorch RPC program imports, from ``flavor``'s home."""
    if flavor == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        import torch.futures as futures
        from torch.distributed.nn import RemoteModule
        from torch.distributed.optim import DistributedOptimizer
    else:
        import rpcdist.torch.autograd as dist_autograd
        import rpcdist.torch.futures as futures
        import rpcdist.torch.rpc as rpc
        from rpcdist.torch.nn import RemoteModule
        from rpcdist.torch.optim import DistributedOptimizer
    return types.SimpleNamespace(
        rpc=rpc,
        dist_autograd=dist_autograd,
        futures=futures,
        DistributedOptimizer=DistributedOptimizer,
        RemoteModule=RemoteModule,
    )


def init_method_for(flavor: str, init_method: str) -> str:
    """rpcdist's and torch's file rendezvous formats differ: one file each."""
    return init_method + ".torch" if flavor == "torch" else init_method


def options(flavor: str, init_method: str, **kw: Any) -> Any:
    rpc = use(flavor).rpc
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method_for(flavor, init_method), **kw)
