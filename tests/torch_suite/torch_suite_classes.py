"""PyTorch's RPC test classes, mixed with a fixture, for ``run_suite.py``.

Importing this module swaps rpcdist.torch in for torch's RPC modules (unless
``RPCDIST_TORCH_SUITE_FLAVOR=torch``: PyTorch itself, for the side-by-side
counts) before torch's test modules are imported; the processes PyTorch's
``MultiProcessTestCase`` spawns import it by name, so they swap too.
The tests' code is torch's, unchanged. Run one test with::

    PYTHONPATH=.:tests/torch_suite python -m unittest torch_suite_classes.RpcTest.test_self_add
"""

from __future__ import annotations

import os
import unittest

import swap  # first: the swap precedes torch's test modules

FLAVOR = os.environ.get("RPCDIST_TORCH_SUITE_FLAVOR", "rpcdist")
if FLAVOR != "torch":
    swap.install()

import torch.distributed.rpc as rpc  # noqa: E402
import torch.multiprocessing  # noqa: E402
from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.distributed.nn.api.remote_module_test import (  # noqa: E402
    RemoteModuleTest as _RemoteModuleTest,
)
from torch.testing._internal.distributed.nn.api.remote_module_test import (  # noqa: E402
    ThreeWorkersRemoteModuleTest as _ThreeWorkersRemoteModuleTest,
)
from torch.testing._internal.distributed.rpc.dist_autograd_test import (  # noqa: E402
    DistAutogradTest as _DistAutogradTest,
)
from torch.testing._internal.distributed.rpc.dist_autograd_test import (  # noqa: E402
    TensorPipeAgentDistAutogradTest as _TensorPipeAgentDistAutogradTest,
)
from torch.testing._internal.distributed.rpc.dist_optimizer_test import (  # noqa: E402
    DistOptimizerTest as _DistOptimizerTest,
)
from torch.testing._internal.distributed.rpc.examples.parameter_server_test import (  # noqa: E402
    ParameterServerTest as _ParameterServerTest,
)
from torch.testing._internal.distributed.rpc.examples.reinforcement_learning_rpc_test import (  # noqa: E402
    ReinforcementLearningRpcTest as _ReinforcementLearningRpcTest,
)
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import (  # noqa: E402
    RpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc.rpc_test import RpcTest as _RpcTest  # noqa: E402
from torch.testing._internal.distributed.rpc.rpc_test import (  # noqa: E402
    TensorPipeAgentRpcTest as _TensorPipeAgentRpcTest,
)
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (  # noqa: E402
    TensorPipeRpcAgentTestFixture,
)

#: What the fixture supplies for rpcdist beyond torch's: the functions and
#: classes the tests call live in torch's test package.
ALLOWED_CALLABLES = ("torch.testing._internal",)


class RpcdistAgentTestFixture(RpcAgentTestFixture):
    """The agent-specific part of PyTorch's fixture, for rpcdist.torch: the
    timeout text rpcdist raises and rpcdist's callable policy."""

    @property
    def rpc_backend(self):  # type: ignore[no-untyped-def]
        return rpc.BackendType.TENSORPIPE

    @property
    def rpc_backend_options(self):  # type: ignore[no-untyped-def]
        import rpcdist

        return rpc.TensorPipeRpcBackendOptions(
            init_method=self.init_method,
            rpcdist_options=rpcdist.RpcOptions(allowed_callables=ALLOWED_CALLABLES),
        )

    def get_shutdown_error_regex(self) -> str:
        return "(.*)"  # as torch's TensorPipe fixture

    def get_timeout_error_regex(self) -> str:
        # a reply that came too late; a call that reached its callee too late
        return "timed out after|arrived after its deadline"


class _SpawnHelper(MultiProcessTestCase):
    """rpc_utils.SpawnHelper (file:// rendezvous; each test in its own processes).

    The workers are spawned (PyTorch's driver) or, under
    ``RPCDIST_TORCH_SUITE_START=fork`` (the runner's zygote, whose parent
    imported torch and the tests already), forked.
    """

    def setUp(self) -> None:
        super().setUp()
        if os.environ.get("RPCDIST_TORCH_SUITE_START") == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()


FIXTURE: type = TensorPipeRpcAgentTestFixture if FLAVOR == "torch" else RpcdistAgentTestFixture

#: The nine classes, by the name the runner uses.
SUITES = {
    "RpcTest": _RpcTest,
    "TensorPipeAgentRpcTest": _TensorPipeAgentRpcTest,
    "DistAutogradTest": _DistAutogradTest,
    "TensorPipeAgentDistAutogradTest": _TensorPipeAgentDistAutogradTest,
    "DistOptimizerTest": _DistOptimizerTest,
    "ParameterServerTest": _ParameterServerTest,
    "ReinforcementLearningRpcTest": _ReinforcementLearningRpcTest,
    "RemoteModuleTest": _RemoteModuleTest,
    "ThreeWorkersRemoteModuleTest": _ThreeWorkersRemoteModuleTest,
}

for _name, _suite in SUITES.items():
    _class = type(_name, (_suite, FIXTURE, _SpawnHelper), {})
    _class.__module__ = __name__
    globals()[_name] = _class


def test_names(class_name: str) -> list[str]:
    """The test methods of ``class_name``, sorted."""
    return sorted(unittest.TestLoader().getTestCaseNames(globals()[class_name]))
