"""Tensor-level entry points to the engine: ``backward`` and ``tensor_roots``."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import AutogradError
from ._device import array_module, move_to
from ._engine import GraphTask, Root
from ._node import Node

if TYPE_CHECKING:
    from ._tensor import Tensor

__all__ = ["backward", "tensor_roots"]


def _root_grad(t: Tensor, grad: Any) -> Any:
    from ._tensor import Tensor

    if grad is None:
        if t.data.size != 1:
            raise AutogradError(
                f"backward: a gradient can be implied only for one-element outputs; got "
                f"shape {t.shape}: pass gradient= of that shape"
            )
        return array_module(t.data).ones_like(t.data)
    g = grad.data if isinstance(grad, Tensor) else grad
    xp = array_module(t.data)
    g = xp.asarray(move_to(g, t.device) if hasattr(g, "shape") else g, dtype=t.data.dtype)
    if tuple(g.shape) != t.shape:
        raise AutogradError(
            f"backward: gradient of shape {tuple(g.shape)} given for an output of shape {t.shape}"
        )
    return g


def tensor_roots(
    tensors: Sequence[Tensor], grad_tensors: Sequence[Any] | None = None
) -> list[Root]:
    """Turn output tensors (and their gradients) into engine roots.

    Args:
        tensors: Outputs to differentiate; each must require grad.
        grad_tensors: d(loss)/d(output) per tensor; None entries (or the whole
            argument) imply ones for one-element outputs.

    Returns:
        ``(node, grads)`` pairs for :func:`run_backward` / :class:`GraphTask`;
        outputs of one node are merged into one pair.

    Raises:
        AutogradError: an output does not require grad, or its gradient is
            missing (non-scalar) or of the wrong shape.
    """
    if grad_tensors is None:
        grad_tensors = [None] * len(tensors)
    if len(grad_tensors) != len(tensors):
        raise AutogradError(f"backward: {len(tensors)} outputs but {len(grad_tensors)} gradients")
    merged: dict[Node, list[Any]] = {}
    for i, (t, g) in enumerate(zip(tensors, grad_tensors)):
        edge = t.gradient_edge()
        if edge is None:
            raise AutogradError(
                f"backward: output {i} (shape {t.shape}) does not require grad and has no grad_fn"
            )
        node, nr = edge
        grads = merged.get(node)
        if grads is None:
            grads = merged[node] = [None] * node.num_outputs
        arr = _root_grad(t, g)
        grads[nr] = arr if grads[nr] is None else grads[nr] + arr
    return list(merged.items())


def backward(
    tensors: Tensor | Sequence[Tensor],
    grad_tensors: Any = None,
    *,
    retain_graph: bool = False,
    grad_map: MutableMapping[Tensor, Any] | None = None,
) -> None:
    """Differentiate ``tensors`` and accumulate into the leaves.

    Callbacks that hooks queued with ``queue_callback`` run before it returns.

    Args:
        tensors: One output or a sequence of outputs.
        grad_tensors: Gradient(s) with respect to the outputs (see
            :func:`tensor_roots`).
        retain_graph: Keep the graph for another backward pass.
        grad_map: Sum leaf gradients into this dict (keyed by leaf tensor)
            instead of ``.grad``.

    Raises:
        AutogradError: see :func:`tensor_roots`; or a freed graph.
    """
    from ._tensor import Tensor

    if isinstance(tensors, Tensor):
        tensors = [tensors]
        if grad_tensors is not None:
            grad_tensors = [grad_tensors]
    roots = tensor_roots(list(tensors), grad_tensors)
    task = GraphTask([n for n, _ in roots], grad_map=grad_map, retain_graph=retain_graph)
    task.execute(roots)
    task.run_final_callbacks()
