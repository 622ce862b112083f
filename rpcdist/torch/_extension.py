"""What ``rpcdist.torch`` registers on every agent: autograd edges for the
torch tensors its messages carry, ``RRef.backward`` from a torch loss, and
the callee's side of RPC profiling (:mod:`._profile_ext`).

Installed on every agent when it is made (a built-in extension, see
``_rpc._registry``), after distributed autograd: it registers a
tensor-gradient hook on the agent's codec hooks and a loss hook on the
agent's autograd extension, and the profiling extension. None imports
torch: they load this package's torch modules (:mod:`._edges`,
:mod:`._backward`) when a torch tensor or loss first reaches them, which
can only happen once torch is loaded, and :mod:`._profile` when a peer that
profiles with torch first asks for this worker's events. So what an agent
does with torch tensors depends on the agent alone, never on which of this
package's modules a program imported, or when.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from .._rpc._registry import CallInfo
from ..autograd._extension import LossBackward, ext
from ._profile_ext import ProfileExtension
from ._profile_ext import install as install_profile_extension

if TYPE_CHECKING:
    from .._rpc._agent import Agent
    from ._edges import TensorEdges

__all__ = ["LazyTensorEdges", "install", "install_profiling", "torch_loss"]


class LazyTensorEdges:
    """An agent's tensor-gradient hook: :class:`._edges.TensorEdges`, loaded
    on the first tensor that requires grad."""

    def __init__(self) -> None:
        self._edges: TensorEdges | None = None

    def _load(self) -> TensorEdges:
        if self._edges is None:
            from ._backward import deliverer  # (import torch: loaded by now)
            from ._edges import TensorEdges

            self._edges = TensorEdges(deliverer)
        return self._edges

    def record(self, context: object, tensor: Any) -> int:
        return (self._edges or self._load()).record(context, tensor)

    def attach(self, context: object, tensor: Any, index: int) -> Any:
        return (self._edges or self._load()).attach(context, tensor, index)


def torch_loss(loss: Any) -> LossBackward | None:
    """``RRef.backward``'s pass for a torch loss (an autograd loss hook)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(loss, torch.Tensor):
        return None
    from ._backward import backward_from_loss

    return backward_from_loss


def install(agent: Agent) -> None:
    """Register torch's autograd hooks on ``agent`` (a built-in extension)."""
    agent.codec_hooks.set_tensor_grad(LazyTensorEdges())
    ext(agent).add_loss_hook(torch_loss)


def _serve_profile_request(
    ext: ProfileExtension, call: CallInfo, request: Any
) -> AbstractContextManager[Any] | None:
    """Serve a call that asks for the callee's profiler events (the caller
    profiles with torch, so torch is in use)."""
    from ._profile import serving

    return serving(ext, call, request)


def install_profiling(agent: Agent) -> None:
    """Give ``agent`` RPC profiling (a built-in extension, see ``_profile_ext``)."""
    install_profile_extension(agent, _serve_profile_request)
