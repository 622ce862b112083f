"""A fixed part of PyTorch's own RPC test suite, run against rpcdist.torch
in every ``make test`` (the whole suite: ``make test-torch-suite``).

Each test is one of PyTorch's, unchanged, in its own processes with a hard
timeout (``run_suite.run_one``); one of each kind: plain calls, RRefs, user
errors, distributed autograd, the optimizer, RemoteModule, an example.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest", reason="PyTorch's test helpers need expecttest")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_suite

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch, pytest.mark.timeout(900)]

SUBSET = (
    "RpcTest.test_self_add",
    "RpcTest.test_py_raise_in_user_func",
    "RpcTest.test_rref_forward_chain",
    "DistAutogradTest.test_backward_simple",
    "DistOptimizerTest.test_dist_optim",
    "RemoteModuleTest.test_send_remote_module_with_a_new_attribute_not_pickled_over_the_wire",
)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
@pytest.mark.parametrize("name", SUBSET)
def test_pytorch_rpc_test_passes_on_rpcdist(name: str) -> None:
    row = run_suite.run_one(name, "rpcdist", timeout=420)
    assert row["status"] == "passed", row["tail"]
