"""Put rpcdist.torch where PyTorch's RPC tests import torch's modules.

Imported first in every process of a suite run (the runner and the
processes PyTorch's ``MultiProcessTestCase`` spawns, which import the
module that defines the test classes): ``torch.distributed.rpc`` (and its
``api``, ``functions``, ``constants``), ``torch.distributed.autograd``,
``torch.distributed.optim.DistributedOptimizer`` and
``torch.distributed.nn.RemoteModule`` then resolve to rpcdist.torch. The
tests' own code is not changed. torch's private RPC modules that have no
rpcdist counterpart (``internal``) stay torch's.

torch-private names the tests import, with no public meaning and no
rpcdist counterpart (RRef-context and autograd-context introspection,
torch's pickler hooks, its backend registry...), are put on rpcdist.torch's
modules as stubs that raise :class:`TorchPrivate` when used, so that the
test modules import and only the tests that use them fail; the runner
counts those tests as out of scope (``run_suite.OUT_OF_SCOPE``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

#: torch's RPC modules the tests import by path, and rpcdist.torch's stand-ins.
SWAPPED = {
    "torch.distributed.rpc": "rpcdist.torch.rpc",
    "torch.distributed.rpc.api": "rpcdist.torch.rpc.api",
    "torch.distributed.rpc.functions": "rpcdist.torch.rpc.functions",
    "torch.distributed.rpc.constants": "rpcdist.torch.rpc.constants",
    "torch.distributed.autograd": "rpcdist.torch.autograd",
}


#: module -> torch-private names stubbed there (only where rpcdist.torch lacks them).
PRIVATE = {
    "rpcdist.torch.rpc": (
        "_rref_context_get_debug_info",
        "_get_debug_info",
        "_delete_all_user_and_unforked_owner_rrefs",
        "_init_rpc_backend",
        "_server_process_global_profile",
        "enable_gil_profiling",
        "TensorPipeAgent",
    ),
    "rpcdist.torch.rpc.api": (
        "_delete_all_user_and_unforked_owner_rrefs",
        "_use_rpc_pickler",
        "_thread_local_var",
        "_wait_all",
        "_broadcast_to_followers",
    ),
    "rpcdist.torch.autograd": (
        "_retrieve_context",
        "_current_context",
        "_get_debug_info",
        "_release_context",
        "_new_context",
        "_get_max_id",
    ),
}

#: torch-private submodules of torch.distributed.rpc, stubbed as a whole.
PRIVATE_MODULES = ("backend_registry", "_testing")


class TorchPrivate(NotImplementedError):
    """A torch-private helper with no rpcdist.torch counterpart was used."""


def _stub(name: str) -> Any:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise TorchPrivate(f"torch-private helper {name}: no rpcdist.torch counterpart")

    stub.__name__ = name.rpartition(".")[2]
    return stub


class _PrivateModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _stub(f"{self.__name__}.{attr}")


def _install_stubs() -> None:
    for module_name, names in PRIVATE.items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                setattr(module, name, _stub(f"{module_name}.{name}"))
    rpc = importlib.import_module("rpcdist.torch.rpc")
    for leaf in PRIVATE_MODULES:
        if not hasattr(rpc, leaf):
            stub = _PrivateModule(f"torch.distributed.rpc.{leaf}")
            setattr(rpc, leaf, stub)
            sys.modules[stub.__name__] = stub


def install() -> None:
    """Swap the modules (idempotent)."""
    if getattr(sys.modules[__name__], "_installed", False):
        return
    import torch.distributed.nn
    import torch.distributed.nn.api.remote_module
    import torch.distributed.optim
    import torch.distributed.rpc
    import torch.distributed.rpc.internal  # kept: torch's own

    import rpcdist.torch.nn
    import rpcdist.torch.optim

    _install_stubs()
    for torch_name, ours in SWAPPED.items():
        module = importlib.import_module(ours)
        sys.modules[torch_name] = module
        parent, _, leaf = torch_name.rpartition(".")
        setattr(sys.modules[parent], leaf, module)
    torch.distributed.optim.DistributedOptimizer = rpcdist.torch.optim.DistributedOptimizer
    torch.distributed.nn.RemoteModule = rpcdist.torch.nn.RemoteModule
    torch.distributed.nn.api.remote_module.RemoteModule = rpcdist.torch.nn.RemoteModule
    sys.modules[__name__]._installed = True  # type: ignore[attr-defined]
