"""Functions the in-process interop tests call on other agents."""

from __future__ import annotations

import threading
from typing import Any

import torch

import rpcdist.torch.autograd as dist_autograd
import rpcdist.torch.rpc as rpc

#: Parameters by worker name (the agents share this process).
PARAMS: dict[str, torch.Tensor] = {}
#: Holds back :func:`layer_when_released` until a test opens it.
CREATION_GATE = threading.Event()


def param(seed: int, shape: tuple[int, ...] = (3, 3)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def layer(x: torch.Tensor) -> torch.Tensor:
    """``tanh(x @ W)`` with this worker's parameter ``W``."""
    w = PARAMS[rpc.get_worker_info().name]
    return torch.tanh(x @ w)


def layer_then(x: torch.Tensor, nxt: str) -> torch.Tensor:
    """:func:`layer`, then the same on ``nxt`` (a nested call inside the context)."""
    return rpc.rpc_sync(nxt, layer, args=(layer(x),))


def twice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = layer(x)
    return y, y * 2


def grads_here(context_id: int) -> dict[str, torch.Tensor]:
    """This worker's parameter gradient in the context (by name, for the caller)."""
    name = rpc.get_worker_info().name
    got = dist_autograd.get_gradients(context_id)
    return {name: got[PARAMS[name]]} if PARAMS[name] in got else {}


class Explode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward exploded on purpose")


def explode(x: torch.Tensor) -> torch.Tensor:
    return Explode.apply(layer(x))


#: Set when :class:`Stall`'s backward starts; it waits for ``RESUME``.
STALLED = threading.Event()
RESUME = threading.Event()


class Stall(torch.autograd.Function):
    """Identity whose backward holds the pass on this worker until ``RESUME``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        STALLED.set()
        RESUME.wait(30)
        return grad


def stall(x: torch.Tensor) -> torch.Tensor:
    return Stall.apply(layer(x))


@rpc.functions.async_execution
def later(x: torch.Tensor) -> Any:
    """Returns a torch Future completed by another thread."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    threading.Timer(0.05, fut.set_result, args=(x * 3,)).start()
    return fut


class WithLambdaHook(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.register_forward_hook(lambda m, i, o: o)


def double_with_device(x: torch.Tensor) -> tuple[torch.Tensor, str]:
    """``2 x`` and the device ``x`` arrived on."""
    return x * 2, str(x.device)


def fail_with(message: str) -> None:
    """Raise ``ValueError(message)`` (a call that fails on the callee)."""
    raise ValueError(message)


def layer_loss(x: torch.Tensor) -> torch.Tensor:
    """``sum(layer(x) ** 2)``: a scalar loss kept where it is computed."""
    return (layer(x) ** 2).sum()


class Plain:
    """An object rpcdist sends only by pickle (as PyTorch RPC sends everything)."""

    def __init__(self, n: int) -> None:
        self.n = n


def bump(p: Plain) -> Plain:
    return Plain(p.n + 1)


def layer_when_released(x: torch.Tensor) -> torch.Tensor:
    """:func:`layer` once the test opens ``CREATION_GATE`` (a ``remote()``
    value still being made meanwhile)."""
    if not CREATION_GATE.wait(60):
        raise TimeoutError("the test never opened CREATION_GATE")
    return layer(x)


def public_state(m: Any) -> dict[str, Any]:
    """What a worker that received RemoteModule ``m`` sees of torch's public state."""
    names = ("on", "device", "is_device_map_set", "is_scriptable")
    return {n: getattr(m, n) for n in names} | {"owner": m.get_module_rref().owner().name}


def forward_there(m: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``m``'s forward and forward_async, run by the worker ``m`` was sent to."""
    return m(x), m.forward_async(x).wait()


def echo_kind(m: Any) -> str:
    ok = isinstance(m, torch.nn.Module) and type(m).__name__ == "RemoteModule"
    return "RemoteModule is an nn.Module" if ok else f"got {type(m).__name__}"


def training_mode(module_rref: Any) -> bool:
    return bool(module_rref.local_value().training)
