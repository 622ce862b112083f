"""A fixed part of PyTorch's own RPC test suite, run against rpcdist.torch
in every ``make test`` (the whole suite: ``make test-torch-suite``).

Each test is one of PyTorch's, unchanged, in its own processes with a hard
timeout (``run_suite.run_one``), forked from a parent that imported torch
and the tests once (the runner's zygote; its workers are forked too), so a
test costs about a second instead of a fresh interpreter's imports; one of
each kind: plain calls, init and an immediate shutdown, futures and their
callbacks (a callback's own error), RPC profiling (a nested call's remote
events), distributed autograd (argument checks, sparse tensors, to_here()
of a value still being created, a pass under the profiler), the
distributed optimizer, an example with RRefs and the optimizer,
RemoteModule. Each passed in a suite run
(docs/compatibility.md).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest", reason="PyTorch's test helpers need expecttest")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_suite

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch, pytest.mark.timeout(900)]

SUBSET = (
    "RpcTest.test_self_add",
    "RpcTest.test_callback_none",
    "RpcTest.test_callback_chain",
    "RpcTest.test_rref_proxy_non_exist",
    "RpcTest.test_reinit",
    "RpcTest.test_local_shutdown",
    "RpcTest.test_callback_wrong_arg_num",
    "RpcTest.test_rpc_profiling_async_function_single_threaded",
    "DistAutogradTest.test_backward_invalid_args",
    "DistAutogradTest.test_thread_local_context_id",
    "DistAutogradTest.test_dist_autograd_profiling",
    "DistOptimizerTest.test_dist_optim",
    "TensorPipeAgentDistAutogradTest.test_backward_simple_self_sparse",
    "ParameterServerTest.test_batch_updating_parameter_server",
    "RemoteModuleTest.test_train_eval",
)


@pytest.fixture(scope="module")
def zygote() -> Iterator[None]:
    """The runner's pre-imported parent, shared by this module's tests and
    killed (its process group) after them."""
    try:
        yield
    finally:
        run_suite.close_zygotes()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
@pytest.mark.parametrize("name", SUBSET)
def test_pytorch_rpc_test_passes_on_rpcdist(name: str, zygote: None) -> None:
    row = run_suite.run_one(name, "rpcdist", timeout=420, start_mode="zygote")
    assert row is not None
    assert row["status"] == "passed", row["tail"]
