"""``DistributedOptimizer`` over ``torch.optim`` classes.

Each owner of parameters gets, once, a local ``torch.optim`` optimizer over
them (made at construction, so a bad option fails there). ``step(context_id)``
asks every owner at once to set ``.grad`` of its parameters to the context's
gradients there and step, under a lock per owner, as torch's does.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .._futures import wait_all
from .._rpc._context import current_agent
from .._rpc._dispatch import resolve
from .._rref._rref import RRef, remote
from .._worker import WorkerInfo
from ._grads import get_gradients

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """An owner's optimizer over its parameters (called through its RRef's proxy)."""

    def __init__(self, optimizer_class: str, param_rrefs: list[RRef[torch.Tensor]],
                 args: list[Any], kwargs: dict[str, Any]) -> None:  # fmt: skip
        self.params = [r.local_value() for r in param_rrefs]
        self.optimizer = resolve(optimizer_class)(self.params, *args, **kwargs)
        self.lock = threading.Lock()

    def ready(self) -> bool:
        return True

    def step(self, context_id: int) -> None:
        grads = get_gradients(context_id)
        with self.lock:
            for p in self.params:
                g = grads.get(p)
                if g is not None:
                    p.grad = g
            self.optimizer.step()


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

    def __init__(self, optimizer_class: Any, params_rref: list[RRef[torch.Tensor]],
                 *args: Any, **kwargs: Any) -> None:  # fmt: skip
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

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of ``context_id`` there.

        Raises:
            AutogradError: an owner has no such context.
        """
        wait_all([r.rpc_async().step(context_id) for r in self.local_optimizers])
