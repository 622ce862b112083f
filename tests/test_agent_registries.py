"""Behaviour an agent has is registered on that agent by the extension that
brings it: codec hooks on ``agent.codec_hooks``, loss hooks on its autograd
extension. Two agents in one process may differ, and importing a module
registers nothing anywhere."""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest
from fake_cupy import FakeArray, install

import rpcdist
from rpcdist import ConfigError, RpcOptions, SerializationError
from rpcdist._rpc._context import WireContext
from rpcdist._serialization import decode, encode
from rpcdist._serialization._hooks import CodecHooks
from rpcdist.autograd._extension import ext as autograd_of
from rpcdist.testing import as_current, local_agents


class StubIpc:
    """A CUDA IPC hook that lends an array by a key into ``lent``."""

    min_bytes = 0

    def __init__(self) -> None:
        self.lent: dict[int, Any] = {}

    def lend(self, context: object, array: Any) -> list[Any] | None:
        self.lent[len(self.lent)] = array
        return [len(self.lent) - 1, "stub"]

    def take(
        self, context: object, fields: list[Any], shape: Any, dtype: Any, out: Any = None
    ) -> Any:
        return self.lent[fields[0]]


class Loss:
    """A loss of another library: its own ``backward``."""

    def backward(self) -> None:
        raise AssertionError("RRef.backward runs the agent's loss hook, not this")


def test_two_agents_in_one_process_encode_by_their_own_codec_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch)  # a fake cupy module
    opts = RpcOptions(token=None, cuda_ipc=False)  # (no built-in CUDA IPC hook)
    with local_agents(2, options=opts) as (a, b):
        assert a.codec_hooks.cupy_ipc is None and b.codec_hooks.cupy_ipc is None
        stub = StubIpc()
        a.codec_hooks.set_cupy_ipc(stub)
        x = FakeArray(np.arange(8, dtype=np.float32))
        lent_header, lent_buffers = encode(x, context=WireContext(a, a.workers[1]))
        host_header, host_buffers = encode(x, context=WireContext(b, b.workers[0]))
        assert len(stub.lent) == 1 and not lent_buffers  # a's hook lent it
        assert len(host_buffers) == 1  # b has no hook: its bytes travel
        back = decode(lent_header, lent_buffers, context=WireContext(a, a.workers[1]))
        assert back is x
        with pytest.raises(SerializationError, match="malformed CuPy array payload"):
            decode(lent_header, lent_buffers, context=WireContext(b, b.workers[0]))
        got = decode(host_header, host_buffers, context=WireContext(a, a.workers[1]))
        assert np.array_equal(got.host, x.host)
        # At most one hook of a kind per agent.
        with pytest.raises(ConfigError, match="already has a CUDA IPC hook"):
            a.codec_hooks.set_cupy_ipc(StubIpc())


def test_an_agent_with_cuda_ipc_turned_off_has_no_hook_and_one_with_it_on_has_its_own() -> None:
    opts = [RpcOptions(token=None), RpcOptions(token=None), RpcOptions(token=None, cuda_ipc=False)]
    with local_agents(3, options=opts) as agents:
        hooks = [a.codec_hooks.cupy_ipc for a in agents]
        assert hooks[0] is not None and hooks[1] is not None and hooks[2] is None
        assert hooks[0] is not hooks[1]


def make_loss() -> Loss:
    return Loss()


def test_rref_backward_runs_the_loss_hooks_of_the_owners_agent_only() -> None:
    ran: list[tuple[int, Loss, bool]] = []

    def run(context_id: int, loss: Any, retain_graph: bool) -> None:
        ran.append((context_id, loss, retain_graph))

    def hook(loss: Any) -> Any:
        return run if isinstance(loss, Loss) else None

    with local_agents(3, options=RpcOptions(token=None)) as agents:
        autograd_of(agents[1]).add_loss_hook(hook)
        autograd_of(agents[1]).add_loss_hook(hook)  # (idempotent)
        assert autograd_of(agents[1]).loss_hooks.count(hook) == 1
        assert hook not in autograd_of(agents[2]).loss_hooks
        with as_current(agents[0]):
            with_hook = rpcdist.remote("worker1", make_loss)
            without = rpcdist.remote("worker2", make_loss)
            with rpcdist.autograd.context() as cid:
                with_hook.backward(cid, retain_graph=True)
                assert len(ran) == 1 and ran[0][0] == cid and ran[0][2] is True
                assert isinstance(ran[0][1], Loss)
                # worker2's agent knows no such loss: its own engine refuses it.
                with pytest.raises(ConfigError, match="roots\\[0\\] is a Loss, not a Tensor"):
                    without.backward(cid)
            assert len(ran) == 1
            del with_hook, without


def _holds(value: object, hooks: tuple[type, ...], functions: tuple[object, ...]) -> bool:
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, list | tuple | set | frozenset):
        items = list(value)
    else:
        return False
    return any(isinstance(i, hooks) or any(i is f for f in functions) for i in items)


def test_importing_the_extensions_registers_no_hook_in_any_module() -> None:
    pytest.importorskip("torch")
    import rpcdist._device._cuda_ipc as cuda_ipc
    import rpcdist.torch.autograd
    import rpcdist.torch.rpc  # noqa: F401
    from rpcdist.torch import _edges, _extension

    hook_types = (cuda_ipc.CudaIpc, _edges.TensorEdges, _extension.LazyTensorEdges)
    functions = (_extension.torch_loss,)

    def global_holders() -> list[str]:
        return [
            f"{name}.{attr}"
            for name, module in list(sys.modules.items())
            if name.startswith("rpcdist") and isinstance(module, types.ModuleType)
            for attr, value in list(vars(module).items())
            if _holds(value, hook_types, functions)
        ]

    assert global_holders() == []
    assert CodecHooks().cupy_ipc is None and CodecHooks().tensor_grad is None
    # The hooks live on the agents that installed them, and only there.
    with local_agents(2, options=RpcOptions(token=None)) as agents:
        for agent in agents:
            assert isinstance(agent.codec_hooks.tensor_grad, _extension.LazyTensorEdges)
            assert isinstance(agent.codec_hooks.cupy_ipc, cuda_ipc.CudaIpc)
            assert _extension.torch_loss in autograd_of(agent).loss_hooks
        assert agents[0].codec_hooks.tensor_grad is not agents[1].codec_hooks.tensor_grad
        assert global_holders() == []


def test_a_tensor_encoded_outside_an_agents_message_is_never_recorded() -> None:
    torch = pytest.importorskip("torch")
    import rpcdist.torch.autograd  # noqa: F401

    t = torch.ones(3, requires_grad=True)
    bare = types.SimpleNamespace(codec_hooks=CodecHooks(), meta={"ad": 1})
    for context in (None, bare):
        out = decode(*encode(t, context=context), context=context)
        assert out.requires_grad and out.is_leaf and out.grad_fn is None
