"""``Optimizer``: parameter groups, per-parameter state, stepping from grads."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import ConfigError
from ..tensor import Tensor, enable_grad
from ..tensor._device import array_module, move_to

__all__ = ["Optimizer", "Scratch"]


class Scratch:
    """Room for one update's temporaries: a flat buffer per array module and
    dtype, as large as the largest of ``arrays`` of that kind, viewed in each
    parameter's shape (:meth:`like`).

    An update written as expressions allocates a fresh array per operation
    and parameter; for large parameters each is new pages to fault in and
    zero, which costs more than the arithmetic (docs/benchmarks.md,
    "Figures behind the code's choices"; the same bits either way). The
    buffers live for one step only, so they add nothing between steps.
    """

    def __init__(self, arrays: Iterable[Any]) -> None:
        self._sizes: dict[tuple[Any, Any], int] = {}
        for a in arrays:
            key = (array_module(a), a.dtype)
            self._sizes[key] = max(self._sizes.get(key, 0), a.size)
        self._bufs: dict[tuple[Any, Any], Any] = {}

    def like(self, data: Any, grad: Any) -> Any | None:
        """A scratch array shaped as ``data``, or None where ``grad`` differs
        from ``data`` in module, dtype or shape (then plain expressions keep
        NumPy's promotion and broadcasting rules)."""
        key = (array_module(data), data.dtype)
        if (array_module(grad), grad.dtype) != key or grad.shape != data.shape:
            return None
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = key[0].empty(self._sizes.get(key, data.size), data.dtype)
        return buf[: data.size].reshape(data.shape)


ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


def _host(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if hasattr(value, "get") and hasattr(value, "shape"):
        return value.get()
    return value


class Optimizer:
    """Base class: holds ``param_groups`` and ``state``; subclasses update.

    Args:
        params: Tensors, or dicts with a ``"params"`` list and per-group
            options overriding ``defaults``.
        defaults: Option values for groups that do not set them.

    Raises:
        ConfigError: no parameters, a parameter listed twice, or a bad option.
    """

    __module__ = "rpcdist.optim"

    def __init__(self, params: ParamsT, defaults: Mapping[str, Any]) -> None:
        self.defaults = dict(defaults)
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Tensor, dict[str, Any]] = {}
        items = list(params)
        if not items:
            raise ConfigError(f"{type(self).__name__}: got an empty parameter list")
        if isinstance(items[0], dict):
            for group in items:
                self.add_param_group(group)  # type: ignore[arg-type]
        else:
            self.add_param_group({"params": items})

    def _check_group(self, group: dict[str, Any]) -> None:
        """Validate a group's options (subclasses extend)."""
        if group["lr"] < 0:
            raise ConfigError(f"{type(self).__name__}: invalid learning rate {group['lr']}")

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a group of parameters with its own options.

        Raises:
            ConfigError: a parameter already in another group, a non-tensor,
                or an invalid option.
        """
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for p in params:
            if not isinstance(p, Tensor):
                raise ConfigError(
                    f"{type(self).__name__}: parameters must be Tensors, got {type(p).__name__}"
                )
            if id(p) in seen:
                raise ConfigError(f"{type(self).__name__}: a parameter appears in two groups")
            seen.add(id(p))
        full = {**self.defaults, **group, "params": params}
        self._check_group(full)
        self.param_groups.append(full)

    def parameters(self) -> list[Tensor]:
        """Every parameter, in group order (the order ``step(grads=...)`` uses)."""
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' ``.grad`` (to None, or zeros in place)."""
        for p in self.parameters():
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.data[...] = 0

    def _gather(self, grads: Sequence[Any] | Mapping[Tensor, Any] | None) -> list[Any]:
        params = self.parameters()
        if grads is None:
            raw = [None if p.grad is None else p.grad.data for p in params]
        elif isinstance(grads, Mapping):
            raw = [grads.get(p) for p in params]
        else:
            raw = list(grads)
            if len(raw) != len(params):
                raise ConfigError(
                    f"{type(self).__name__}.step: {len(raw)} gradients for {len(params)} parameters"
                )
        out: list[Any] = []
        for i, (p, g) in enumerate(zip(params, raw)):
            if g is None:
                out.append(None)
                continue
            if isinstance(g, Tensor):
                g = g.data
            if not hasattr(g, "shape"):
                g = np.asarray(g)
            if tuple(g.shape) != p.shape:
                raise ConfigError(
                    f"{type(self).__name__}.step: gradient {i} has shape {tuple(g.shape)}, "
                    f"its parameter has shape {p.shape}"
                )
            if type(g) is not np.ndarray or type(p.data) is not np.ndarray:
                g = move_to(g, p.device)
            if g.dtype != p.data.dtype:
                g = g.astype(p.data.dtype)
            out.append(g)
        return out

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grads: Sequence[Any] | Mapping[Tensor, Any] | None = None,
    ) -> Any:
        """Update every parameter once.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).
            grads: Gradients to use instead of ``.grad``: a sequence aligned
                with :meth:`parameters` (None entries skip a parameter) or a
                mapping from parameter to array, as distributed autograd's
                ``get_gradients`` returns. ``.grad`` is not read or changed.

        Returns:
            The closure's loss, or None.

        Raises:
            ConfigError: gradients of the wrong number or shape.
        """
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        flat = self._gather(grads)
        k = 0
        for group in self.param_groups:
            n = len(group["params"])
            self._update(group, group["params"], flat[k : k + n])
            k += n
        return loss

    def _update(self, group: dict[str, Any], params: list[Tensor], grads: list[Any]) -> None:
        """Apply one step to ``params`` with ``grads`` (None: skip)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Options and per-parameter state; parameters referred to by index.

        Arrays are host NumPy copies, so the result can go to ``rpcdist.save``.
        """
        index = {id(p): i for i, p in enumerate(self.parameters())}
        state = {
            index[id(p)]: {k: _host(v) for k, v in st.items()}
            for p, st in self.state.items()
            if id(p) in index
        }
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index[id(p)] for p in g["params"]],
            }
            for g in self.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore options and state saved by :meth:`state_dict`.

        Raises:
            ConfigError: the group structure does not match this optimizer's.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)
        ):
            raise ConfigError(
                f"{type(self).__name__}.load_state_dict: parameter groups do not match"
            )
        by_index: dict[int, Tensor] = {}
        for saved, mine in zip(groups, self.param_groups):
            for i, p in zip(saved["params"], mine["params"]):
                by_index[int(i)] = p
            for k, v in saved.items():
                if k != "params":
                    mine[k] = tuple(v) if isinstance(v, list) else v
        self.state = {}
        for i, st in state_dict["state"].items():
            p = by_index.get(int(i))
            if p is None:
                raise ConfigError(f"{type(self).__name__}.load_state_dict: no parameter {i}")
            self.state[p] = {k: _restore(v, p) for k, v in st.items()}


def _restore(value: Any, p: Tensor) -> Any:
    """A saved state entry back on ``p``'s device (arrays) or as is (scalars)."""
    if isinstance(value, Tensor):
        value = value.data
    if hasattr(value, "shape") and tuple(value.shape) == p.shape:
        return move_to(value, p.device).astype(p.data.dtype, copy=True)
    if hasattr(value, "shape") and value.shape == ():
        return value.item()
    return value
