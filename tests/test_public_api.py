"""Every public name is importable, documented and reports its public module."""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC = ["rpcdist", "rpcdist.functions", "rpcdist.futures", "rpcdist.launch", "rpcdist.testing"]
OPTIONAL = [
    "rpcdist.tensor",
    "rpcdist.nn",
    "rpcdist.optim",
    "rpcdist.collectives",
    "rpcdist.data",
    "rpcdist.parallel",
    "rpcdist.parallel.comm_hooks",
]


#: Need torch (the ``torch`` extra); skipped without it.
TORCH = [
    "rpcdist.torch",
    "rpcdist.torch.rpc",
    "rpcdist.torch.rpc.functions",
    "rpcdist.torch.autograd",
    "rpcdist.torch.optim",
    "rpcdist.torch.nn",
    "rpcdist.torch.futures",
]


@pytest.mark.parametrize("modname", PUBLIC + OPTIONAL + TORCH)
def test_all_is_sorted_importable_and_documented(modname):
    if modname in TORCH:
        pytest.importorskip("torch")
    mod = importlib.import_module(modname)
    names = mod.__all__
    # isort-style, as ruff's RUF022 keeps it: CONSTANTS, Classes, functions.
    key = lambda n: (0 if n.isupper() else 1 if n[:1].isupper() else 2, n)  # noqa: E731
    assert sorted(names, key=key) == list(names), f"{modname}.__all__ is not sorted"
    for name in names:
        obj = getattr(mod, name)
        if inspect.ismodule(obj) or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        assert inspect.getdoc(obj), f"{modname}.{name} has no docstring"
        public_mod = obj.__module__
        assert not any(part.startswith("_") for part in public_mod.split(".")), (
            f"{modname}.{name} reports private module {public_mod!r}"
        )


def test_pinned_rpc_api_is_present():
    import rpcdist

    for name in [
        "init_rpc",
        "shutdown",
        "rpc_sync",
        "rpc_async",
        "get_worker_info",
        "WorkerInfo",
        "Future",
        "RpcOptions",
    ]:
        assert hasattr(rpcdist, name)
    assert hasattr(rpcdist.functions, "async_execution")
    assert hasattr(rpcdist.futures, "collect_all") and hasattr(rpcdist.futures, "wait_all")


def test_the_error_tree_is_the_pinned_one_and_every_error_is_a_runtime_error():
    import rpcdist
    from rpcdist import _errors

    tree = {
        "RpcError": "RpcdistError",
        "RemoteError": "RpcError",
        "RpcTimeoutError": "RpcError",
        "TransportError": "RpcError",
        "ConnectError": "TransportError",
        "WorkerLostError": "TransportError",
        "ProtocolError": "TransportError",
        "OwnerLostError": "WorkerLostError",
        "ClosedError": "RpcdistError",
        "SerializationError": "RpcdistError",
        "RRefError": "RpcdistError",
        "RRefCreationError": "RRefError",
        "AutogradError": "RpcdistError",
        "CollectiveError": "RpcdistError",
        "ConfigError": "RpcdistError",
        "CallPolicyError": "RpcdistError",
        "NotInitializedError": "RpcdistError",
        "WrongThreadError": "RpcdistError",
    }
    assert set(tree) | {"RpcdistError"} == set(_errors.__all__)
    for name, parent in tree.items():
        assert issubclass(getattr(rpcdist, name), getattr(rpcdist, parent)), name
    assert issubclass(rpcdist.RpcTimeoutError, TimeoutError)
    assert issubclass(rpcdist.ConfigError, ValueError)
    assert issubclass(rpcdist.CallPolicyError, PermissionError)
    assert issubclass(rpcdist.OwnerLostError, rpcdist.RRefError)
    # as torch.distributed.rpc's errors are: `except RuntimeError` in a
    # PyTorch RPC program keeps catching timeouts and lost workers
    assert all(issubclass(getattr(rpcdist, n), RuntimeError) for n in _errors.__all__)
