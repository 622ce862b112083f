"""Graph nodes: what the backward engine walks.

A :class:`Node` stands for one recorded operation. It receives one gradient
per output (``num_outputs``) and returns one gradient per entry of
``next_edges``: the ``(node, output_nr)`` that produced each input, or
``None`` where that input needs no gradient.

Three node kinds are part of the engine's contract and may be subclassed by
higher layers (distributed autograd does):

- :class:`AccumulateGrad` ends the walk at a leaf tensor that requires grad.
- :class:`SendFunction` stands for tensors that left this worker in an RPC:
  its inputs are their gradient edges and it passes the gradients that come
  back, one per tensor, on to them.
- :class:`RecvFunction` is the ``grad_fn`` of tensors that arrived in an RPC:
  it has no inputs here; the engine hands its gradients to a callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .._errors import AutogradError

if TYPE_CHECKING:
    from ._tensor import Tensor

__all__ = [
    "AccumulateGrad",
    "Edge",
    "Node",
    "RecvFunction",
    "RemovableHandle",
    "SendFunction",
]

#: ``(node, output_nr)``: which output of which node a gradient flows into.
Edge = tuple["Node", int]
#: A hook on a gradient: takes it (as a Tensor), may return a replacement.
GradHook = Callable[["Tensor"], Any]


class RemovableHandle:
    """Returned by the ``register_*hook`` methods; ``remove()`` unregisters."""

    __module__ = "rpcdist.tensor"
    __slots__ = ("_entry", "_hooks")

    def __init__(self, hooks: list[Any], entry: Any) -> None:
        self._hooks = hooks
        self._entry = entry

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        try:
            self._hooks.remove(self._entry)
        except ValueError:
            pass


class Node:
    """One operation in the backward graph.

    Attributes:
        next_edges: Per input, the ``(node, output_nr)`` its gradient goes
            to, or ``None`` when that input needs no gradient.
        num_outputs: How many gradients this node receives.
    """

    __module__ = "rpcdist.tensor"
    __slots__ = ("__weakref__", "_pre_hooks", "next_edges", "num_outputs")

    #: Whether :meth:`apply_split` may compute some input gradients now and
    #: the rest later, each part doing only its own share of the work (a
    #: matrix product's two gradients). The engine then sends a gradient that
    #: leaves the worker before it computes the parameters' (see GraphTask).
    splittable: ClassVar[bool] = False

    next_edges: tuple[Edge | None, ...]
    num_outputs: int
    _pre_hooks: list[tuple[int, GradHook]] | None

    def __init__(self, next_edges: Sequence[Edge | None] = (), num_outputs: int = 1) -> None:
        self.next_edges = tuple(next_edges)
        self.num_outputs = num_outputs
        self._pre_hooks = None

    def name(self) -> str:
        """The node's kind, for messages (its class name)."""
        return type(self).__name__

    def apply(self, grads: Sequence[Any | None]) -> Sequence[Any | None]:
        """Map output gradients to input gradients (one per ``next_edges``).

        Args:
            grads: One array (or ``None``: no gradient reached it) per output.
                Arrays may be shared with other nodes; never modify them.

        Returns:
            One array or ``None`` per entry of ``next_edges``. A returned array
            must be new, ``grads``' own object, or a view of it; never an
            array this node keeps.
        """
        raise NotImplementedError

    def apply_some(
        self, grads: Sequence[Any | None], wanted: Sequence[bool]
    ) -> Sequence[Any | None]:
        """:meth:`apply`, computing only the input gradients where ``wanted`` is
        true (the others are ``None``); only for :attr:`splittable` nodes."""
        raise NotImplementedError(f"{self.name()} cannot compute some input gradients alone")

    def apply_split(
        self, grads: Sequence[Any | None], first: Sequence[bool]
    ) -> tuple[Sequence[Any | None], Callable[[], Sequence[Any | None]]]:
        """:meth:`apply` in two parts: the input gradients where ``first`` is
        true now, and a function computing the others later (it is called
        once, before :meth:`release`). By default two :meth:`apply_some`
        calls; a node whose two parts share work (an LSTM's gate gradients)
        overrides this to do that work once."""
        rest = tuple(not f for f in first)
        return self.apply_some(grads, first), lambda: self.apply_some(grads, rest)

    def release(self) -> None:
        """Free what the backward pass needed (called unless retain_graph)."""

    def add_pre_hook(self, output_nr: int, hook: GradHook) -> RemovableHandle:
        """Run ``hook`` on output ``output_nr``'s summed gradient before apply."""
        if self._pre_hooks is None:
            self._pre_hooks = []
        entry = (output_nr, hook)
        self._pre_hooks.append(entry)
        return RemovableHandle(self._pre_hooks, entry)

    def __repr__(self) -> str:
        return f"<{self.name()} at {id(self):#x}>"


class AccumulateGrad(Node):
    """Terminal node of a leaf tensor: sums the gradient that reaches it.

    The engine handles it itself: into ``.grad`` (then post-accumulate hooks
    run) or into the caller's gradient map.
    """

    __module__ = "rpcdist.tensor"
    __slots__ = ("variable",)

    def __init__(self, variable: Tensor) -> None:
        super().__init__((), 1)
        self.variable = variable

    def apply(self, grads: Sequence[Any | None]) -> Sequence[Any | None]:
        raise AutogradError("AccumulateGrad is handled by the engine; it is never applied")


class SendFunction(Node):
    """Stands for tensors sent to another worker; gradients come back to it.

    Its ``next_edges`` are the sent tensors' gradient edges; it receives one
    gradient per tensor (output ``i`` is tensor ``i``) and passes them on
    unchanged. Distributed autograd subclasses it to remember the message.

    Args:
        tensors: The tensors that left this worker (those that require grad
            get an edge; others get ``None``).
    """

    __module__ = "rpcdist.tensor"
    __slots__ = ()

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        edges = [t.gradient_edge() for t in tensors]
        super().__init__(edges, len(edges))

    def apply(self, grads: Sequence[Any | None]) -> Sequence[Any | None]:
        return tuple(grads)


class RecvFunction(Node):
    """The ``grad_fn`` of tensors received from another worker.

    It has no inputs on this worker: when the engine reaches it, it calls the
    callback given to the run with ``(node, grads)`` so that the gradients can
    be sent back. Distributed autograd subclasses it to remember the message.

    Args:
        num_outputs: How many received tensors share this node.
    """

    __module__ = "rpcdist.tensor"
    __slots__ = ()

    def __init__(self, num_outputs: int = 1) -> None:
        super().__init__((), num_outputs)

    def make_outputs(self, arrays: Sequence[Any]) -> list[Tensor]:
        """Wrap received arrays as tensors whose ``grad_fn`` is this node.

        Raises:
            AutogradError: ``len(arrays)`` is not ``num_outputs``.
        """
        from ._tensor import Tensor

        if len(arrays) != self.num_outputs:
            raise AutogradError(
                f"{self.name()}.make_outputs: expected {self.num_outputs} arrays, got {len(arrays)}"
            )
        return [Tensor._from_op(a, self, i) for i, a in enumerate(arrays)]

    def apply(self, grads: Sequence[Any | None]) -> Sequence[Any | None]:
        raise AutogradError(
            f"backward reached {self.name()} (a tensor received over RPC) but no "
            "callback for it was given; run backward through rpcdist.autograd.backward"
        )
