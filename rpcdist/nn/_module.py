"""``Module`` and ``Parameter``: the containers models are built from."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from .._errors import ConfigError
from ..tensor import Tensor
from ..tensor._device import move_to, normalize_device

__all__ = ["IncompatibleKeys", "Module", "Parameter"]


class Parameter(Tensor):
    """A tensor that a :class:`Module` registers as one of its parameters.

    Args:
        data: A Tensor (its data is shared) or an array-like.
        requires_grad: Whether it is trained (default True).
    """

    __module__ = "rpcdist.nn"
    __slots__ = ()

    def __init__(self, data: Any, requires_grad: bool = True) -> None:
        super().__init__(
            data.data if isinstance(data, Tensor) else data, requires_grad=requires_grad
        )

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict(strict=False)`` could not match."""

    missing_keys: list[str]
    unexpected_keys: list[str]


IncompatibleKeys.__module__ = "rpcdist.nn"


def _host(arr: Any) -> np.ndarray[Any, Any]:
    return np.array(arr if isinstance(arr, np.ndarray) else arr.get(), copy=True)


class Module:
    """Base class of layers and models.

    Assigning a :class:`Parameter` or a ``Module`` to an attribute registers
    it; ``register_buffer`` registers non-trained state that ``state_dict``
    also saves. Calling the module calls :meth:`forward`.
    """

    __module__ = "rpcdist.nn"

    training: bool
    _parameters: dict[str, Parameter | None]
    _buffers: dict[str, Tensor | None]
    _modules: dict[str, Module | None]

    def __init__(self) -> None:
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})

    def _registry(self, name: str) -> dict[str, Any]:
        reg = self.__dict__.get(name)
        if reg is None:
            raise ConfigError(
                f"{type(self).__name__}: call super().__init__() before assigning attributes"
            )
        return reg  # type: ignore[no-any-return]

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Parameter):
            self._registry("_parameters")[name] = value
            self._modules.pop(name, None)
            self._buffers.pop(name, None)
        elif isinstance(value, Module):
            self._registry("_modules")[name] = value
            self._parameters.pop(name, None)
            self._buffers.pop(name, None)
        elif name in self.__dict__.get("_parameters", {}):
            if value is not None:
                raise ConfigError(
                    f"cannot assign {type(value).__name__} to parameter {name!r} "
                    "(expected Parameter or None)"
                )
            self._parameters[name] = None
        elif name in self.__dict__.get("_buffers", {}):
            if value is not None and not isinstance(value, Tensor):
                raise ConfigError(f"buffer {name!r} must be a Tensor or None")
            self._buffers[name] = value
        elif name in self.__dict__.get("_modules", {}) and value is None:
            self._modules[name] = None
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        for reg in (self._parameters, self._buffers, self._modules):
            reg.pop(name, None)
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Register ``param`` (or None: a declared but absent parameter)."""
        self._registry("_parameters")[name] = param
        object.__setattr__(self, name, param)

    def register_buffer(self, name: str, tensor: Tensor | None) -> None:
        """Register non-trained state that ``state_dict`` includes."""
        self._registry("_buffers")[name] = tensor
        object.__setattr__(self, name, tensor)

    def add_module(self, name: str, module: Module | None) -> None:
        """Register a submodule under ``name``."""
        self._registry("_modules")[name] = module
        object.__setattr__(self, name, module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The computation; subclasses override it."""
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    # ----------------------------------------------------------------- traversal
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This module and all below it, with dotted names (each once)."""
        seen: set[int] = set()
        stack: list[tuple[str, Module]] = [(prefix, self)]
        while stack:
            name, mod = stack.pop()
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            yield name, mod
            children = [
                (f"{name}.{k}" if name else k, m) for k, m in mod._modules.items() if m is not None
            ]
            stack.extend(reversed(children))

    def modules(self) -> Iterator[Module]:
        """This module and all below it."""
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, Module]]:
        """Direct submodules with their names."""
        for k, m in self._modules.items():
            if m is not None:
                yield k, m

    def children(self) -> Iterator[Module]:
        """Direct submodules."""
        for _, m in self.named_children():
            yield m

    def named_parameters(
        self, prefix: str = "", recurse: bool = True
    ) -> Iterator[tuple[str, Parameter]]:
        """Parameters with dotted names, each shared parameter once."""
        seen: set[int] = set()
        mods = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for mname, mod in mods:
            for k, p in mod._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                yield (f"{mname}.{k}" if mname else k), p

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """All parameters (each once), in registration order."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        """Buffers with dotted names."""
        for mname, mod in self.named_modules(prefix):
            for k, b in mod._buffers.items():
                if b is not None:
                    yield (f"{mname}.{k}" if mname else k), b

    def buffers(self) -> Iterator[Tensor]:
        """All buffers."""
        for _, b in self.named_buffers():
            yield b

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, np.ndarray[Any, Any]]:
        """Parameters and buffers by dotted name, as host NumPy copies."""
        out: dict[str, np.ndarray[Any, Any]] = {}
        for name, p in self.named_parameters():
            out[name] = _host(p.data)
        for name, b in self.named_buffers():
            out[name] = _host(b.data)
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> IncompatibleKeys:
        """Copy arrays from ``state_dict`` into parameters and buffers (in place).

        Args:
            state_dict: Name to array (NumPy/CuPy array or Tensor).
            strict: Raise when keys are missing or unexpected.

        Returns:
            The keys that did not match.

        Raises:
            ConfigError: a shape differs, or (strict) keys do not match.
        """
        own: dict[str, Tensor] = dict(self.named_parameters())
        own.update(self.named_buffers())
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise ConfigError(
                f"load_state_dict for {type(self).__name__}: missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
        for name, t in own.items():
            if name not in state_dict:
                continue
            value = state_dict[name]
            if isinstance(value, Tensor):
                arr = value.data
            elif hasattr(value, "shape"):
                arr = value
            else:
                arr = np.asarray(value)
            if tuple(arr.shape) != t.shape:
                raise ConfigError(
                    f"load_state_dict: {name!r} has shape {tuple(arr.shape)} in the state dict "
                    f"but {t.shape} in the module"
                )
            t.data[...] = move_to(arr, t.device)
        return IncompatibleKeys(missing, unexpected)

    # ------------------------------------------------------------------ modes
    def train(self, mode: bool = True) -> Module:
        """Set training mode (affects dropout) here and below; returns self."""
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        """Set evaluation mode; returns self."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's ``.grad`` (to None, or zeros in place)."""
        for p in self.parameters():
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.data[...] = 0

    def apply(self, fn: Callable[[Module], Any]) -> Module:
        """Call ``fn`` on every module (children first); returns self."""
        for m in reversed(list(self.modules())):
            fn(m)
        return self

    def to(self, device: Any = None, *, dtype: Any = None) -> Module:
        """Move (and/or cast floating) parameters and buffers in place; returns self."""
        dev = normalize_device(device) if device is not None else None
        for t in [*self.parameters(), *self.buffers()]:
            arr = t.data
            if dtype is not None and arr.dtype.kind == "f":
                arr = arr.astype(dtype)
            if dev is not None:
                arr = move_to(arr, dev)
            t.data = arr
            if t.grad is not None:
                t.grad = None
        return self

    def extra_repr(self) -> str:
        """Extra text inside this module's repr."""
        return ""

    def __repr__(self) -> str:
        lines = [f"({k}): " + repr(m).replace("\n", "\n  ") for k, m in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not lines:
            return head + ")"
        return head + "\n  " + "\n  ".join(lines) + "\n)"
