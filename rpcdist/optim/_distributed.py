"""``DistributedOptimizer``: one local optimizer per parameter owner, stepped
with a distributed autograd context's gradients where the parameters live.

Each owner gets, once, a local optimizer over its parameters (made at
construction, so a bad option fails there, at the caller, with the owner's
error type). ``step(context_id)`` asks every owner at once to step with that
context's gradients (``rpcdist.autograd.get_gradients`` there), each under a
lock of its own; there is no order across owners, so several trainers may
step one server concurrently (Hogwild). The optimizer's hyperparameters live
here in ``param_groups`` (one group, as PyTorch's), so a learning-rate
scheduler can drive them: changes travel with the next step.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .._deadline import UNSET
from .._errors import AutogradError, ConfigError
from .._rpc._api import rpc_async
from .._rpc._context import current_agent
from .._rpc._dispatch import resolve
from .._rref._rref import RRef
from .._worker import WorkerInfo
from ..autograd import get_gradients
from ..tensor import Tensor

__all__ = ["DistributedOptimizer"]


class _Local:
    """An owner's optimizer over its parameters, with a lock. Its methods are
    called through the owner RRef's proxy (by id: no RRef fork per call)."""

    def __init__(self, optimizer: Any, params: list[Tensor]) -> None:
        self.optimizer = optimizer
        self.params = params
        self.lock = threading.Lock()

    def step(self, context_id: int, hyper: dict[str, Any] | None, scale: float | None) -> None:
        grads = _grads(context_id)
        with self.lock:
            if hyper:
                for group in self.optimizer.param_groups:
                    group.update(hyper)
            if scale is not None:
                grads = {p: g * scale for p, g in grads.items()}
            self.optimizer.step(grads=grads)

    def square_norm(self, context_id: int) -> float:
        grads = _grads(context_id)
        total = 0.0
        for p in self.params:
            g = grads.get(p)
            if g is not None:
                total += float((g * g).sum())
        return total

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            sd: dict[str, Any] = self.optimizer.state_dict()
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.optimizer.load_state_dict(state)


def _new_local(cls_name: str, rrefs: list[RRef[Tensor]], defaults: dict[str, Any]) -> RRef[_Local]:
    params = [r.local_value() for r in rrefs]
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise ConfigError(f"DistributedOptimizer: params_rref[{i}] names a {type(p).__name__}")
    optimizer = resolve(cls_name)(params, **defaults)
    return RRef(_Local(optimizer, params))


def _grads(context_id: int) -> Mapping[Tensor, Any]:
    try:
        return get_gradients(context_id)
    except AutogradError:  # this owner took no part in the context: nothing to step with
        return {}


def _wait_all(futures: list[Any]) -> list[Any]:
    """Every result (of Futures, or calls with ``wait()``); the first error
    (with its remote traceback) after all finished."""
    results: list[Any] = []
    first: BaseException | None = None
    for fut in futures:
        try:
            results.append(fut.wait())
        except BaseException as e:
            first = first or e
            results.append(None)
    if first is not None:
        raise first
    return results


def step_all(calls: list[Any], here: Sequence[Callable[[], None]]) -> None:
    """Run ``here`` (this worker's own steps) while ``calls`` (the owners'
    steps, already sent) run elsewhere, then wait for those; re-raise the
    first error after all ended."""
    first: BaseException | None = None
    for step in here:
        try:
            step()
        except BaseException as e:
            first = first or e
    try:
        _wait_all(calls)
    except BaseException as e:
        first = first or e
    if first is not None:
        raise first


class DistributedOptimizer:
    """Steps parameters held on many workers, each where it lives.

    Args:
        optimizer_class: A local optimizer class (``rpcdist.optim.SGD``,
            ``Adam``, ...), sent to the owners by name.
        params_rref: RRefs to the parameters (``rpcdist.tensor.Tensor``),
            e.g. from ``RemoteModule.remote_parameters()``.
        **defaults: The optimizer's options (``lr=0.05``, ``momentum=0.9``).

    Raises:
        ConfigError: no parameters, or an option the owner's optimizer rejects.
        Exception: what constructing an optimizer raised on an owner.
    """

    __module__ = "rpcdist.optim"

    def __init__(
        self, optimizer_class: type, params_rref: Iterable[RRef[Tensor]], **defaults: Any
    ) -> None:
        agent = current_agent()
        rrefs = list(params_rref)
        if not rrefs:
            raise ConfigError("DistributedOptimizer: got an empty list of parameter RRefs")
        by_owner: dict[WorkerInfo, list[RRef[Tensor]]] = {}
        for i, r in enumerate(rrefs):
            if not isinstance(r, RRef):
                raise ConfigError(
                    f"DistributedOptimizer: params_rref[{i}] is a {type(r).__name__}, not an RRef"
                )
            by_owner.setdefault(r.owner(), []).append(r)
        name = agent.function_name(optimizer_class)
        futs = [rpc_async(w, _new_local, args=(name, rs, defaults)) for w, rs in by_owner.items()]
        self._owners: list[WorkerInfo] = list(by_owner)
        self._locals: list[RRef[_Local]] = _wait_all(futs)
        self._remote = [r for r in self._locals if not r.is_owner()]
        self._here = [r.local_value() for r in self._locals if r.is_owner()]
        self._class_name = name
        #: One group of hyperparameters (no ``"params"``: they live on the owners).
        self.param_groups: list[dict[str, Any]] = [dict(defaults)]
        self._sent = dict(defaults)
        self._scale: dict[int, float] = {}

    def _changed(self) -> dict[str, Any] | None:
        group = self.param_groups[0]
        changed = {k: v for k, v in group.items() if self._sent.get(k) != v}
        if not changed:
            return None
        self._sent.update(changed)
        return changed

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with context ``context_id``'s gradients.

        Owners step concurrently; the call returns when all have.

        Raises:
            Exception: the first error an owner raised (with ``remote_traceback``).
        """
        hyper = self._changed()
        scale = self._scale.pop(context_id, None)
        remote = self._remote
        if len(remote) == 1 and not self._here:  # a blocking call: its cheapest path
            remote[0].rpc_sync().step(context_id, hyper, scale)
            return
        # Sent now, read here after the local step (a thread-driven link each
        # when the calls qualify: no loop thread wakes for them).
        calls = [opt._start_invoke("step", (context_id, hyper, scale), {}, UNSET) for opt in remote]
        here = [functools.partial(local.step, context_id, hyper, scale) for local in self._here]
        step_all(calls, here)

    def clip_grad_norm_(self, context_id: int, max_norm: float) -> float:
        """Clip context ``context_id``'s gradients to a total 2-norm of ``max_norm``.

        One round to the owners gathers their norms; the scaling is applied
        by every owner at the next :meth:`step` of this context (the
        gradients in the context are left as they are).

        Returns:
            The total norm before clipping.

        Raises:
            ConfigError: ``max_norm`` is not a positive number.
        """
        if not isinstance(max_norm, int | float) or max_norm <= 0:
            raise ConfigError(f"clip_grad_norm_: max_norm must be positive, got {max_norm!r}")
        squares = _wait_all([opt.rpc_async().square_norm(context_id) for opt in self._locals])
        total = math.sqrt(sum(squares))
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            self._scale[context_id] = coef
        return total

    def state_dict(self) -> dict[str, Any]:
        """Every owner's optimizer state, gathered here (for ``rpcdist.save``)."""
        states = _wait_all([opt.rpc_async().state_dict() for opt in self._locals])
        return {
            "optimizer": self._class_name,
            "owners": [w.name for w in self._owners],
            "states": states,
            "param_groups": [dict(g) for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Scatter a :meth:`state_dict` back to the owners.

        Raises:
            ConfigError: it was saved for other owners or another optimizer.
        """
        owners = [w.name for w in self._owners]
        if list(state_dict.get("owners", ())) != owners:
            raise ConfigError(
                f"DistributedOptimizer.load_state_dict: saved for owners "
                f"{list(state_dict.get('owners', ()))}, these are {owners}"
            )
        if state_dict.get("optimizer") != self._class_name:
            raise ConfigError(
                f"DistributedOptimizer.load_state_dict: saved for {state_dict.get('optimizer')}, "
                f"this one is {self._class_name}"
            )
        _wait_all(
            [
                opt.rpc_async().load_state_dict(st)
                for opt, st in zip(self._locals, state_dict["states"])
            ]
        )
        self.param_groups = [dict(g) for g in state_dict["param_groups"]]
        self._sent = {}  # send every hyperparameter with the next step

    def __repr__(self) -> str:
        owners = ", ".join(w.name for w in self._owners)
        return f"DistributedOptimizer({self._class_name}, owners=[{owners}])"
