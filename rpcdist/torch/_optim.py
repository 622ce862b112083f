"""``DistributedOptimizer`` over ``torch.optim`` classes.

Each owner of parameters gets, once, a local ``torch.optim`` optimizer over
them (made at construction, so a bad option fails there). ``step(context_id)``
asks every owner at once to step its parameters with the context's gradients
there, under a lock per owner, as torch's does (this worker's own parameters
step in the calling thread, meanwhile).

As under PyTorch's DistributedOptimizer with its functional optimizers, a
step moves only the parameters that have a gradient in the context and
leaves ``.grad`` as it was: plain SGD takes the gradients as arguments, and
any other class is stepped with ``.grad`` set to them (``None`` for the
rest), then put back. So a gradient the owner's own training left in
``.grad`` neither moves a parameter nor is lost.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

import torch
from torch.optim.sgd import sgd

from .._deadline import UNSET
from .._futures import wait_all
from .._rpc._context import current_agent
from .._rpc._dispatch import resolve
from .._rref._rref import RRef, remote
from .._worker import WorkerInfo
from ..optim._distributed import step_all
from ._grads import get_gradients

__all__ = ["DistributedOptimizer"]


class _FunctionalSGD:
    """``torch.optim.SGD``'s step through its functional form (``torch.optim.sgd.sgd``).

    Making the first ``torch.optim`` optimizer of a process imports
    ``torch._dynamo`` (seconds to import, more to tear down at exit); the
    functional form needs none of it. PyTorch's own
    DistributedOptimizer maps SGD to a functional optimizer for the same
    kind of reason. Same arithmetic, same state (``momentum_buffer``).
    """

    def __init__(self, params: list[torch.Tensor], hyper: dict[str, Any]) -> None:
        if hyper["lr"] < 0.0 or hyper["momentum"] < 0.0 or hyper["weight_decay"] < 0.0:
            raise ValueError(f"invalid SGD hyperparameters: {hyper}")
        if hyper["nesterov"] and (hyper["momentum"] <= 0 or hyper["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.params = params
        self.hyper = hyper
        self.buffers: dict[torch.Tensor, torch.Tensor | None] = {}
        #: No momentum, weight decay or maximizing: each step is ``p -= lr * g``.
        self.plain = (
            hyper["momentum"] == 0
            and hyper["weight_decay"] == 0
            and not hyper["maximize"]
            and not isinstance(hyper["lr"], torch.Tensor)
        )

    def step(self, grads: list[torch.Tensor | None]) -> None:
        """One step with ``grads`` (one per parameter; ``None``: leave it be)."""
        h = self.hyper
        if self.plain:  # what ``sgd`` does then, without its argument handling
            with torch.no_grad():
                for p, g in zip(self.params, grads):
                    if g is not None:
                        p.add_(g, alpha=-h["lr"])
            return
        with_grad = [p for p, g in zip(self.params, grads) if g is not None]
        present = [g for g in grads if g is not None]
        bufs = [self.buffers.get(p) for p in with_grad]
        with torch.no_grad():
            sgd(
                with_grad,
                present,
                bufs,
                foreach=h["foreach"],
                weight_decay=h["weight_decay"],
                momentum=h["momentum"],
                lr=h["lr"],
                dampening=h["dampening"],
                nesterov=h["nesterov"],
                maximize=h["maximize"],
            )
        if h["momentum"] != 0:
            for p, buf in zip(with_grad, bufs):
                self.buffers[p] = buf


class _ThroughGrad:
    """Any other ``torch.optim`` optimizer, stepped with ``.grad`` set to the
    given gradients for the step and put back after it."""

    def __init__(self, optimizer: Any, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = params

    def step(self, grads: list[torch.Tensor | None]) -> None:
        saved = [p.grad for p in self.params]
        try:
            for p, g in zip(self.params, grads):
                p.grad = g
            self.optimizer.step()
        finally:
            for p, old in zip(self.params, saved):
                p.grad = old


def _make_optimizer(
    cls: Any, params: list[torch.Tensor], args: list[Any], kwargs: dict[str, Any]
) -> _FunctionalSGD | _ThroughGrad:
    """What steps ``params`` as ``cls(params, *args, **kwargs)`` would, given
    the gradients: the functional twin for plain SGD, else ``cls`` itself."""
    if cls is torch.optim.SGD:
        try:
            bound = inspect.signature(cls.__init__).bind(None, params, *args, **kwargs)
        except TypeError:
            bound = None  # let torch say what is wrong, below
        if bound is not None:
            bound.apply_defaults()
            hyper = dict(bound.arguments)
            if not (hyper.get("differentiable") or hyper.get("fused")):
                return _FunctionalSGD(params, hyper)
    return _ThroughGrad(cls(params, *args, **kwargs), params)


class _LocalOptimizer:
    """An owner's optimizer over its parameters (called through its RRef's proxy)."""

    def __init__(
        self,
        optimizer_class: str,
        param_rrefs: list[RRef[torch.Tensor]],
        args: list[Any],
        kwargs: dict[str, Any],
    ) -> None:
        self.params = [r.local_value() for r in param_rrefs]
        self.optimizer = _make_optimizer(resolve(optimizer_class), self.params, args, kwargs)
        self.lock = threading.Lock()

    def ready(self) -> bool:
        return True

    def step(self, context_id: int) -> None:
        got = get_gradients(context_id)
        grads = [got.get(p) for p in self.params]
        with self.lock:
            self.optimizer.step(grads)


class DistributedOptimizer:
    """One ``torch.optim`` optimizer per parameter owner, stepped with a context's gradients.

    Args:
        optimizer_class: A ``torch.optim.Optimizer`` subclass (sent by name and
            resolved on each owner under its callable policy).
        params_rref: RRefs to the parameters, on any workers (this one too).
        *args: Positional arguments of ``optimizer_class`` after the parameters.
        **kwargs: Its keyword arguments (``lr=...``).

    Raises:
        Exception: what making the optimizer raised on an owner (same type).
    """

    __module__ = "rpcdist.torch.optim"

    def __init__(
        self, optimizer_class: Any, params_rref: list[RRef[torch.Tensor]], *args: Any, **kwargs: Any
    ) -> None:
        by_owner: dict[int, tuple[WorkerInfo, list[RRef[torch.Tensor]]]] = {}
        for rref in params_rref:
            owner = rref.owner()
            by_owner.setdefault(owner.id, (owner, []))[1].append(rref)
        name = current_agent().function_name(optimizer_class)
        self.local_optimizers: list[RRef[_LocalOptimizer]] = [
            remote(owner, _LocalOptimizer, args=(name, rrefs, list(args), kwargs))
            for owner, rrefs in by_owner.values()
        ]
        wait_all([r.rpc_async().ready() for r in self.local_optimizers])  # surface errors here
        self._remote = [r for r in self.local_optimizers if not r.is_owner()]
        self._here = [r.local_value() for r in self.local_optimizers if r.is_owner()]

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of ``context_id`` there.

        Raises:
            AutogradError: an owner has no such context.
        """
        remote = self._remote
        if len(remote) == 1 and not self._here:
            remote[0].rpc_sync().step(context_id)  # the blocking path: fewer thread hops
            return
        # Sent now, read here after the local step (a thread-driven link each
        # when the calls qualify: no loop thread wakes for them).
        calls = [r._start_invoke("step", (context_id,), {}, UNSET) for r in remote]
        step_all(calls, [functools.partial(local.step, context_id) for local in self._here])
