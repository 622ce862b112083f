"""The hooks one agent's codec asks, registered on that agent by its extensions.

The codec's type tables (``register_extension``, ``register_type``) belong to
the process: a type has one wire form everywhere. What an *agent* does with
some values belongs to that agent: its CUDA IPC extension lends large CuPy
arrays to workers of its host by handle, and the torch interop records the
tensors that cross inside a distributed autograd context. Each such
extension registers its hook on the agent's :class:`CodecHooks` when it is
installed on the agent, and the codec finds them through the message's
context (``context.codec_hooks``). A value encoded without a context, or for
an agent without the hook, takes the plain path, so two agents in one
process may differ, and what a worker does never depends on which modules
some code imported.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from .._errors import ConfigError

__all__ = ["CodecHooks", "CupyIpcHook", "TensorGradHook", "hooks_of"]


class CupyIpcHook(Protocol):
    """Sends large CuPy arrays between workers of one host by CUDA IPC handle
    (registered by ``rpcdist._device._cuda_ipc``)."""

    @property
    def min_bytes(self) -> int:
        """Smaller arrays are never lent."""
        ...

    def lend(self, context: object, array: Any) -> list[Any] | None:
        """Fields that stand for C-contiguous ``array``, or ``None``: send its bytes."""
        ...

    def take(
        self,
        context: object,
        fields: list[Any],
        shape: tuple[int, ...],
        dtype: Any,
        out: Any = None,
    ) -> Any:
        """The array ``lend``'s fields stand for, on this worker's current device
        (copied into ``out``, a C-contiguous CuPy array of that shape and dtype,
        when given)."""
        ...


class TensorGradHook(Protocol):
    """Records torch tensors that cross workers inside a distributed autograd
    context (registered by ``rpcdist.torch``; the codec never imports torch)."""

    def record(self, context: object, tensor: Any) -> int:
        """The tensor's index in its message's send function, or -1: not recorded."""
        ...

    def attach(self, context: object, tensor: Any, index: int) -> Any:
        """The received tensor as output ``index`` of its message's receive function."""
        ...


class CodecHooks:
    """The codec hooks of one agent: at most one of each kind.

    Attributes:
        cupy_ipc: Lends CuPy arrays (and CUDA tensors) by CUDA IPC handle.
        tensor_grad: Records torch tensors that require grad for distributed
            autograd.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cupy_ipc: CupyIpcHook | None = None
        self.tensor_grad: TensorGradHook | None = None

    def set_cupy_ipc(self, hook: CupyIpcHook) -> None:
        """Lend CuPy arrays through ``hook``.

        Raises:
            ConfigError: another CUDA IPC hook is registered.
        """
        with self._lock:
            self.cupy_ipc = _the_only_hook("CUDA IPC", self.cupy_ipc, hook)

    def set_tensor_grad(self, hook: TensorGradHook) -> None:
        """Record tensors that require grad through ``hook``.

        Raises:
            ConfigError: another tensor-gradient hook is registered.
        """
        with self._lock:
            self.tensor_grad = _the_only_hook("tensor-gradient", self.tensor_grad, hook)


def _the_only_hook(kind: str, old: Any, new: Any) -> Any:
    if old is not None and old is not new:
        raise ConfigError(f"this agent's codec already has a {kind} hook ({old!r})")
    return new


def hooks_of(context: object) -> CodecHooks | None:
    """The codec hooks of the agent a message's ``context`` belongs to, if any."""
    hooks = getattr(context, "codec_hooks", None)
    return hooks if isinstance(hooks, CodecHooks) else None
