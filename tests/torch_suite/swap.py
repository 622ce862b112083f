"""Put rpcdist.torch where PyTorch's RPC tests import torch's modules.

Imported first in every process of a suite run (the runner and the
processes PyTorch's ``MultiProcessTestCase`` spawns, which import the
module that defines the test classes): ``torch.distributed.rpc`` (and its
``api``, ``functions``, ``constants``), ``torch.distributed.autograd``,
``torch.distributed.optim.DistributedOptimizer`` and
``torch.distributed.nn.RemoteModule`` then resolve to rpcdist.torch. The
tests' own code is not changed. torch's private RPC modules that have no
rpcdist counterpart (``internal``, ``backend_registry``...) stay torch's.
"""

from __future__ import annotations

import importlib
import sys

#: torch's RPC modules the tests import by path, and rpcdist.torch's stand-ins.
SWAPPED = {
    "torch.distributed.rpc": "rpcdist.torch.rpc",
    "torch.distributed.rpc.api": "rpcdist.torch.rpc.api",
    "torch.distributed.rpc.functions": "rpcdist.torch.rpc.functions",
    "torch.distributed.rpc.constants": "rpcdist.torch.rpc.constants",
    "torch.distributed.autograd": "rpcdist.torch.autograd",
}


def install() -> None:
    """Swap the modules (idempotent)."""
    if getattr(sys.modules[__name__], "_installed", False):
        return
    import torch.distributed.nn
    import torch.distributed.nn.api.remote_module
    import torch.distributed.optim
    import torch.distributed.rpc
    import torch.distributed.rpc.internal

    import rpcdist.torch.nn
    import rpcdist.torch.optim

    for torch_name, ours in SWAPPED.items():
        module = importlib.import_module(ours)
        sys.modules[torch_name] = module
        parent, _, leaf = torch_name.rpartition(".")
        setattr(sys.modules[parent], leaf, module)
    torch.distributed.optim.DistributedOptimizer = rpcdist.torch.optim.DistributedOptimizer
    torch.distributed.nn.RemoteModule = rpcdist.torch.nn.RemoteModule
    torch.distributed.nn.api.remote_module.RemoteModule = rpcdist.torch.nn.RemoteModule
    sys.modules[__name__]._installed = True  # type: ignore[attr-defined]
