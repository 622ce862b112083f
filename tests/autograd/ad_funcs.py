"""Forward pieces run on other workers by the distributed autograd tests.

Each worker keeps its parameters in ``PARAMS[worker name]`` (in-process agents
share this module); ``oracle`` modules compute the same functions locally.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist import tensor as rt
from rpcdist.functions import async_execution
from rpcdist.tensor import Function, Tensor

PARAMS: dict[str, dict[str, Tensor]] = {}
_lock = threading.Lock()


def me() -> str:
    return rpcdist.get_worker_info().name


def param(name: str, shape: tuple[int, ...] = (3,), seed: int = 0) -> Tensor:
    """This worker's parameter ``name`` (made on first use, deterministic)."""
    with _lock:
        table = PARAMS.setdefault(me(), {})
        if name not in table:
            rng = np.random.default_rng(seed)
            table[name] = Tensor(rng.standard_normal(shape), requires_grad=True)
        return table[name]


def scale(x: Tensor, name: str = "w") -> Tensor:
    return x * param(name)


def tanh_scale(x: Tensor) -> Tensor:
    return rt.tanh(x) * param("v", seed=1)


def chain(x: Tensor, rest: list[str]) -> Tensor:
    """``x * w`` here, then on through ``rest`` (nested calls inherit the context)."""
    y = x * param("w", seed=len(rest))
    if not rest:
        return rt.tanh(y)
    return rpcdist.rpc_sync(rest[0], chain, args=(y, rest[1:]))


def linear_stage(x: Tensor, rest: list[str]) -> Tensor:
    """A pipeline stage, ``tanh(linear(x, W, b))`` here, then on through ``rest``.
    Its backward sends ``x``'s gradient upstream before computing W's and b's."""
    from rpcdist.nn import functional as F

    k = len(rest)
    w, b = param("W", shape=(4, 4), seed=10 + k), param("b", shape=(4,), seed=20 + k)
    y = rt.tanh(F.linear(x, w, b))
    if not rest:
        return y
    return rpcdist.rpc_sync(rest[0], linear_stage, args=(y, rest[1:]))


def embed(tokens: Any) -> Tensor:
    """Rows of this worker's table ``E`` (7 x 3): the rnn workload's first server."""
    from rpcdist.nn import functional as F

    return F.embedding(tokens, param("E", shape=(7, 3), seed=30))


def decode(h: Tensor) -> Tensor:
    """``linear(h, D, d)`` to 5 outputs: the rnn workload's second server."""
    from rpcdist.nn import functional as F

    return F.linear(h, param("D", shape=(5, 4), seed=31), param("d", shape=(5,), seed=32))


def mul(a: Tensor, b: Tensor) -> Tensor:
    return a * b


def pair(x: Tensor) -> list[Tensor]:
    return [x * param("w"), x * x]


@async_execution
def scale_later(x: Tensor) -> rpcdist.Future[Tensor]:
    fut: rpcdist.Future[Tensor] = rpcdist.Future()
    w = param("w")  # (the thread below has no current agent)

    def finish() -> None:
        fut.set_result(x * w)

    threading.Thread(target=finish).start()
    return fut


async def scale_async(x: Tensor) -> Tensor:
    return x * param("w")


def plain_forward(x: Any) -> Tensor:
    """A parameter server's forward: plain (no grad) input, output from its parameters."""
    return Tensor(np.asarray(x)) @ param("m", shape=(3, 2), seed=5)


_SHARED: dict[str, Tensor] = {}


def first_half(x: Tensor) -> Tensor:
    """``h = x * w`` kept here; returns ``h * 2`` (see ``second_half``)."""
    h = x * param("w")
    _SHARED[me()] = h
    return h * 2.0


def second_half() -> Tensor:
    """Another output of the same ``h``: a second send sharing a node with the first."""
    return _SHARED.pop(me()) * 3.0


class Explode(Function):
    """Raises in backward, to test error propagation."""

    def forward(self, x: Any) -> Any:
        return x * 1.0

    def backward(self, g: Any) -> tuple[Any]:
        raise ValueError("exploded in backward")


def explode(x: Tensor) -> Tensor:
    return Explode.call(x) * param("w")


def grads_here(context_id: int) -> dict[str, Any]:
    """This worker's gradients in the context, by parameter name."""
    got = dist_autograd.get_gradients(context_id)
    table = PARAMS.get(me(), {})
    return {n: got[p] for n, p in table.items() if p in got}


class Box:
    """A module-like value owned by one worker, used through an RRef."""

    def __init__(self) -> None:
        self.w = Tensor(np.arange(1.0, 4.0), requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w

    def grad(self, context_id: int) -> Any:
        return dist_autograd.get_gradients(context_id)[self.w]


def loss_here(x: Tensor) -> Tensor:
    """A scalar loss computed on this worker (for RRef.backward)."""
    return (x * param("w")).sum()


def grads_of_module(module_rref: Any, context_id: int) -> list[Any]:
    """The gradients of a module's parameters in the context, in order."""
    got = dist_autograd.get_gradients(context_id)
    return [got[p] for p in module_rref.local_value().parameters()]


HOLD = threading.Event()
ENTERED = threading.Event()


class Hold(Function):
    """Blocks in backward until ``HOLD`` is set (a worker busy mid-pass)."""

    def forward(self, x: Any) -> Any:
        return x * 1.0

    def backward(self, g: Any) -> tuple[Any]:
        ENTERED.set()
        HOLD.wait(30)
        return (g,)


def hold(x: Tensor) -> Tensor:
    return Hold.call(x) * param("w")


class FailWhenHeld(Function):
    """Raises in backward once a :class:`Hold` elsewhere holds its pass (a
    worker's own part failing while a gradient message it sent is still in
    flight)."""

    def forward(self, x: Any) -> Any:
        return x * 1.0

    def backward(self, g: Any) -> tuple[Any]:
        ENTERED.wait(20)
        raise ValueError("local part failed")


def contexts_here() -> int:
    return int(dist_autograd.statistics()["contexts"])


#: Weak references to arrays made by :func:`fresh_weight` (to see when they are freed).
MADE: list[Any] = []


def fresh_weight(x: Tensor) -> Tensor:
    """``x @ w`` with a weight made here for this call only: the graph and
    the context are all that keep ``w`` alive once this returns."""
    w = Tensor(np.ones((x.shape[-1], 8)), requires_grad=True)
    MADE.append(weakref.ref(w.data))
    return x @ w
