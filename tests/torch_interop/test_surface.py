"""What PyTorch RPC programs import is importable from rpcdist.torch under the
same names (the examples' and tutorials' surface): a program moves over by
changing its imports only."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

pytestmark = [
    pytest.mark.torch,
    # (importing torch.distributed.optim warns that torch.jit.script is deprecated)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

#: (torch's module, rpcdist's, the names programs use)
SURFACE = [
    (
        "torch.distributed.rpc",
        "rpcdist.torch.rpc",
        [
            "BackendType",
            "RRef",
            "TensorPipeRpcBackendOptions",
            "WorkerInfo",
            "get_worker_info",
            "init_rpc",
            "is_available",
            "remote",
            "rpc_async",
            "rpc_sync",
            "shutdown",
            # private, but programs and libraries call them
            "_get_current_rpc_agent",
            "_is_current_rpc_agent_set",
            "_set_rpc_timeout",
            "api",
            "RpcBackendOptions",
            "constants",
        ],
    ),
    (
        "torch.distributed.rpc.api",
        "rpcdist.torch.rpc.api",
        [
            "_all_gather",
            "_barrier",
            "_get_current_rpc_agent",
            "_is_current_rpc_agent_set",
            "_require_initialized",
            "_wait_all_workers",
            "get_worker_info",
            "rpc_sync",
        ],
    ),
    ("torch.distributed.rpc.functions", "rpcdist.torch.rpc.functions", ["async_execution"]),
    (
        "torch.distributed.autograd",
        "rpcdist.torch.autograd",
        [
            "backward",
            "context",
            "get_gradients",
            "is_available",
        ],
    ),
    ("torch.distributed.optim", "rpcdist.torch.optim", ["DistributedOptimizer"]),
    ("torch.distributed.nn", "rpcdist.torch.nn", ["RemoteModule"]),
    ("torch.futures", "rpcdist.torch.futures", ["Future", "collect_all", "wait_all"]),
]


@pytest.mark.parametrize(("theirs", "ours", "names"), SURFACE, ids=[s[1] for s in SURFACE])
def test_the_names_programs_import_exist_on_both_sides(theirs, ours, names):
    torch_mod, our_mod = importlib.import_module(theirs), importlib.import_module(ours)
    missing = [n for n in names if not hasattr(our_mod, n)]
    assert not missing, f"{ours} lacks {missing}"
    assert all(hasattr(torch_mod, n) for n in names)  # (the list is torch's own surface)
    if hasattr(our_mod, "is_available"):
        assert our_mod.is_available() is torch_mod.is_available() is True


def test_the_constants_are_torchs():
    import torch.distributed.rpc.constants as theirs

    import rpcdist.torch.rpc as rpc

    for name in rpc.constants.__all__:
        assert getattr(rpc.constants, name) == getattr(theirs, name), name
    opts = rpc.TensorPipeRpcBackendOptions()
    assert isinstance(opts, rpc.RpcBackendOptions)
    assert (opts.rpc_timeout, opts.num_worker_threads, opts.init_method) == (
        theirs.DEFAULT_RPC_TIMEOUT_SEC,
        theirs.DEFAULT_NUM_WORKER_THREADS,
        theirs.DEFAULT_INIT_METHOD,
    )


def test_init_rpc_takes_the_base_options_class(tmp_path):
    # (in a process of its own: init_rpc sets this process's agent)
    code = f"""
import torch
import rpcdist.torch.rpc as rpc
opts = rpc.RpcBackendOptions(rpc_timeout=7.5, init_method="file://{tmp_path / "rdv"}")
rpc.init_rpc("only", rank=0, world_size=1, rpc_backend_options=opts)
assert rpc.get_rpc_timeout() == 7.5
assert rpc.rpc_sync("only", torch.add, args=(torch.ones(1), 1)).item() == 2.0
rpc.shutdown()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_device_map_that_moves_tensors_warns_rather_than_being_ignored_silently():
    import torch

    import rpcdist.torch.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # identity maps are what rpcdist does anyway
        opts.set_device_map("w1", {0: 0, "cuda:1": torch.device("cuda", 1)})
    with pytest.warns(RuntimeWarning, match=r"not as mapped by \{0: 1\}"):
        opts.set_device_map("w2", {0: 1})
    with pytest.warns(RuntimeWarning, match="'w3'"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"w3": {"cuda:1": "cuda:0"}})
    assert opts.device_maps == {"w1": {0: 0, "cuda:1": torch.device("cuda", 1)}, "w2": {0: 1}}
