"""PyTorch's operators and tensor methods travel by name like any function
(``rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))`` is the first
example of torch's RPC docs), and the default policy refuses torch's loaders
of files, pickles, native libraries and code."""

from __future__ import annotations

import pytest
import torch

import rpcdist
import rpcdist.torch.rpc as rpc
from rpcdist import RpcOptions
from rpcdist._serialization import function_name, resolve_function
from rpcdist.testing import as_current, local_agents

pytestmark = pytest.mark.torch


@pytest.mark.parametrize(
    ("fn", "name"),
    [
        (torch.add, "torch:add"),
        (torch.ones, "torch:ones"),
        (torch.Tensor.sum, "torch._C:TensorBase.sum"),
        (torch.Tensor.__add__, "torch._C:TensorBase.__add__"),
        (torch.ops.aten.mul, "torch:ops.aten.mul"),
        (torch.ops.aten.mul.Tensor, "torch:ops.aten.mul.Tensor"),
        (torch.nn.functional.relu, "torch.nn.functional:relu"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_torch_operators_have_names_that_lead_back_to_them(fn, name):
    assert function_name(fn) == name
    assert resolve_function(name) is fn


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
def test_torch_operators_run_on_another_worker(transport):
    with local_agents(2, options=RpcOptions(token=None, transport=transport)) as agents:
        with as_current(agents[0]):
            got = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
            torch.testing.assert_close(got, torch.full((2,), 4.0))
            rref = rpc.remote("worker1", torch.ones, args=(2, 3))
            torch.testing.assert_close(rref.to_here(), torch.ones(2, 3))
            del rref
            t = torch.arange(6.0).reshape(2, 3)
            assert rpc.rpc_async("worker1", torch.Tensor.sum, args=(t,)).wait().item() == 15.0
            got = rpc.rpc_sync("worker1", torch.ops.aten.mul.Tensor, args=(t, t))
            torch.testing.assert_close(got, t * t)


@pytest.mark.parametrize(
    "name",
    [
        "torch:load",  # unpickles (weights_only=False on request)
        "torch:save",
        "torch:from_file",
        "torch:UntypedStorage.from_file",
        "torch:ops.load_library",  # a native library
        "torch:jit.load",
        "torch:hub.load",  # runs a hubconf.py
        "torch.utils.cpp_extension:load_inline",  # compiles and loads C++ source
        "torch:CompilationUnit",  # TorchScript source
        "torch:compile",
        "torch._C:_pickle_load_obj",  # a private loader
        "torch:_C._load_jit_module_from_file",
        "torch._inductor.codecache:PyCodeCache.load_by_key_path",  # runs a Python file
        "torch.utils.benchmark:Timer",  # runs a statement given as a string
        "torch.utils.collect_env:get_pretty_env_info",  # runs commands
    ],
)
def test_default_policy_refuses_torch_loaders_of_files_and_code(name):
    with pytest.raises(rpcdist.CallPolicyError, match="refuses to call"):
        resolve_function(name)


def test_a_peer_cannot_make_a_worker_write_or_read_a_file_through_torch(tmp_path):
    target = tmp_path / "tensor.pt"
    with local_agents(2, options=RpcOptions(token=None, transport="inproc")) as agents:
        with as_current(agents[0]):
            with pytest.raises(rpcdist.CallPolicyError, match="torch"):
                rpc.rpc_sync("worker1", torch.save, args=(torch.ones(2), str(target)))
            assert not target.exists()
            target.write_bytes(b"not read")
            with pytest.raises(rpcdist.CallPolicyError, match="torch"):
                rpc.rpc_sync("worker1", torch.load, args=(str(target),), kwargs={})
            # it serves on
            assert rpc.rpc_sync("worker1", torch.Tensor.sum, args=(torch.ones(2),)).item() == 2
    assert target.read_bytes() == b"not read"


def test_arguments_that_are_not_a_tuple_or_list_are_named_and_none_is_no_arguments():
    with local_agents(2, options=RpcOptions(token=None, transport="inproc")) as agents:
        with as_current(agents[0]):
            for call in (rpc.rpc_sync, rpc.rpc_async, rpc.remote):
                with pytest.raises(
                    rpcdist.ConfigError, match="args must be a tuple or list, got int"
                ):
                    call("worker1", torch.ones, args=5)
                with pytest.raises(rpcdist.ConfigError, match="got Tensor"):  # args=(t) for (t,)
                    call("worker1", torch.neg, args=torch.ones(3))
            assert rpc.rpc_sync("worker1", torch.get_num_threads, args=None) >= 1
            assert rpc.rpc_sync("worker1", torch.ones, args=[2]).shape == (2,)


@pytest.mark.parametrize("allowed", [False, True])
def test_rpcdist_options_reach_the_worker_through_torchs_backend_options(tmp_path, allowed):
    target = tmp_path / "tensor.pt"
    extra = {"allowed_callables": ("torch.serialization:save",)} if allowed else {}
    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{tmp_path / 'rendezvous'}",
        rpcdist_options=RpcOptions(token=None, **extra),
    )
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        if allowed:
            rpc.rpc_sync("solo", torch.save, args=(torch.ones(2), str(target)))
            assert torch.load(target).sum().item() == 2
        else:
            with pytest.raises(rpcdist.CallPolicyError, match="torch"):
                rpc.rpc_sync("solo", torch.save, args=(torch.ones(2), str(target)))
            assert not target.exists()
    finally:
        rpc.shutdown()


def test_backend_options_refuse_rpcdist_options_of_another_type():
    with pytest.raises(rpcdist.ConfigError, match="rpcdist_options"):
        rpc.TensorPipeRpcBackendOptions(rpcdist_options={"allow_pickle": True})


def test_a_ported_program_turns_pickle_on_through_torchs_backend_options(tmp_path):
    import tfuncs as tf

    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{tmp_path / 'rendezvous'}",
        rpcdist_options=RpcOptions(token=None, allow_pickle=True),
    )
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        assert rpc.rpc_sync("solo", tf.bump, args=(tf.Plain(1),)).n == 2
    finally:
        rpc.shutdown()
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{tmp_path / 'again'}")
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        with pytest.raises(rpcdist.SerializationError, match="allow_pickle"):
            rpc.rpc_sync("solo", tf.bump, args=(tf.Plain(1),))
    finally:
        rpc.shutdown()
