"""Send and receive edges of torch tensors that cross workers inside a context.

The codec asks this module (through the tensor-gradient hook ``_extension``
registers on every agent's codec) about every torch tensor that requires grad. Inside a distributed autograd
context (the message's metadata carries ``"ad"``) the sender keeps the tensor
in the message's :class:`TorchSend` (its gradient will come back to it) and
the tensor travels with its index there; the receiver makes it the output of
:class:`RecvFunction`, a ``torch.autograd.Function`` whose one input is the
message's *anchor* (a scalar leaf that only ties the receive edges into the
graph). When torch's engine reaches that node during a backward pass, its
``backward`` hands the gradient to the sender (:mod:`._backward`). A CUDA
tensor's edge is two nodes instead (:func:`receive` says why).

Everything sits in the rpcdist context (``DistContext.extras["torch"]``), so
leaving ``with context()`` frees it here and on every worker it touched, by
rpcdist's own release protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._errors import SerializationError
from .._rpc._context import WireContext
from ..autograd._extension import ext

if TYPE_CHECKING:
    from ..autograd._context import DistContext
    from ._host import Host

__all__ = [
    "ANCHOR_ATTR",
    "Deliverer",
    "RecvFunction",
    "TensorEdges",
    "TorchRecv",
    "TorchSend",
    "TorchState",
    "receive",
    "state",
]

#: Attribute marking the anchor leaves of receive functions (not parameters).
ANCHOR_ATTR = "_rpcdist_anchor"


class TorchSend:
    """The tensors (that require grad) one message took to ``peer``."""

    __slots__ = ("peer", "tensors")

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.tensors: list[torch.Tensor] = []


class TorchRecv:
    """The tensors one message brought from ``peer``: their anchor leaf."""

    __slots__ = ("anchor", "message_id", "peer")

    def __init__(self, message_id: int, peer: int) -> None:
        self.message_id = message_id
        self.peer = peer
        self.anchor = torch.zeros((), requires_grad=True)
        setattr(self.anchor, ANCHOR_ATTR, True)


class TorchState:
    """The torch side of one context on one worker."""

    __slots__ = ("context_id", "grads", "host", "lock", "recvs", "sends")

    def __init__(self, context_id: int) -> None:
        self.context_id = context_id
        self.lock = threading.Lock()
        self.sends: dict[int, TorchSend] = {}
        self.recvs: dict[int, TorchRecv] = {}
        #: Leaf gradients accumulated by backward passes, keyed by the leaf itself.
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        #: The thread of a profiled backward pass from here, while it runs
        #: (``_backward``): gradients that come back run there.
        self.host: Host | None = None

    def add_grad(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        with self.lock:
            old = self.grads.get(leaf)
            self.grads[leaf] = grad if old is None else old + grad


def state(ctx: DistContext) -> TorchState:
    """The torch state of ``ctx``, made on first use."""
    with ctx.lock:
        st = ctx.extras.get("torch")
        if st is None:
            st = ctx.extras["torch"] = TorchState(ctx.id)
        assert isinstance(st, TorchState)
        return st


class RecvFunction(torch.autograd.Function):  # type: ignore[misc]  # Any without torch
    """Identity on a received tensor; its backward sends the gradient home."""

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, data: torch.Tensor, deliver: Any, index: int
    ) -> torch.Tensor:
        ctx.deliver = deliver
        ctx.index = index
        return data.clone() if data.is_sparse else data.view_as(data)  # (no sparse views)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.deliver(ctx.index, grad)
        return None, None, None, None


class _StashFunction(torch.autograd.Function):  # type: ignore[misc]  # Any without torch
    """The device half of a received CUDA tensor's edge: identity forward; its
    backward, which torch runs on its own thread for that device, only leaves
    the gradient in ``box`` for :class:`_DeliverFunction`."""

    @staticmethod
    def forward(ctx: Any, link: torch.Tensor, data: torch.Tensor, box: list[Any]) -> torch.Tensor:
        ctx.box = box
        return data.view_as(data)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.box.append(grad)
        return torch.zeros(()), None, None


class _DeliverFunction(torch.autograd.Function):  # type: ignore[misc]  # Any without torch
    """The CPU half: its output (a scalar) links the anchor to the device half,
    so its backward runs after that one's, on the thread that runs the pass,
    and sends the gradient the device half left in ``box`` home."""

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, box: list[Any], deliver: Any, index: int
    ) -> torch.Tensor:
        ctx.box = box
        ctx.deliver = deliver
        ctx.index = index
        return torch.zeros((), dtype=anchor.dtype)

    @staticmethod
    def backward(ctx: Any, _link: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.deliver(ctx.index, ctx.box.pop())
        return None, None, None, None


def _on_device_thread(tensor: torch.Tensor) -> bool:
    """Whether torch's engine runs the backward of an op on ``tensor`` on a
    device thread of its own (every device but the CPU)."""
    return bool(tensor.device.type != "cpu")


def receive(anchor: torch.Tensor, tensor: torch.Tensor, deliver: Any, index: int) -> torch.Tensor:
    """``tensor`` as the output of a receive edge whose backward calls
    ``deliver(index, grad)``.

    Sending a gradient home waits for the whole pass below it, which may come
    back to this process (a round trip: this worker's tensor went out and a
    result came back). Torch runs every backward op on a CUDA tensor on one
    thread per device, so a receive edge that waited there would keep that
    round trip's own CUDA work from running: a deadlock until the timeout. A
    CUDA tensor's edge is therefore two nodes: the device half only hands the
    gradient over, and the CPU half (run on the pass's own thread) sends it
    and waits.
    """
    if not _on_device_thread(tensor):
        out: torch.Tensor = RecvFunction.apply(  # type: ignore[no-untyped-call]
            anchor, tensor, deliver, index
        )
        return out
    box: list[Any] = []
    link = _DeliverFunction.apply(anchor, box, deliver, index)  # type: ignore[no-untyped-call]
    out = _StashFunction.apply(link, tensor, box)  # type: ignore[no-untyped-call]
    return out


#: ``deliverer(agent, context_id, recv)``: what a receive function calls with
#: its gradient (``_backward.deliverer``: send it home and wait).
Deliverer = Callable[[Any, int, TorchRecv], Callable[[int, Any], None]]


class TensorEdges:
    """What an agent's codec calls for torch tensors that require grad (its
    tensor-gradient hook, see ``_serialization._hooks.TensorGradHook``);
    ``deliverer`` makes the receive functions' gradient senders."""

    def __init__(self, deliverer: Deliverer) -> None:
        self._deliverer = deliverer

    def record(self, context: object, tensor: Any) -> int:
        wire = context
        if not isinstance(wire, WireContext) or wire.meta is None:
            return -1
        context_id = wire.meta.get("ad")
        if not isinstance(context_id, int) or wire.extra.get("aborted"):
            return -1
        e = ext(wire.agent)
        message_id = wire.meta.get("am")
        if not isinstance(message_id, int):
            message_id = wire.meta["am"] = e.ids.new()
        ctx = e.context(context_id)
        st = state(ctx)
        peer = wire.peer.id
        with ctx.lock:
            ctx.known.add(peer)
        with st.lock:
            send = st.sends.get(message_id)
            if send is None:
                send = st.sends[message_id] = TorchSend(peer)
            send.tensors.append(tensor)
            index = len(send.tensors) - 1
        if not wire.extra.get("torch_undo"):
            wire.extra["torch_undo"] = True
            wire.extra.setdefault("undo", []).append(lambda: _forget(st, message_id))
        return index

    def attach(self, context: object, tensor: Any, index: int) -> Any:
        wire = context
        meta = wire.meta if isinstance(wire, WireContext) else None
        context_id = meta.get("ad") if meta else None
        message_id = meta.get("am") if meta else None
        if not isinstance(context_id, int) or not isinstance(message_id, int):
            raise SerializationError(
                "a torch tensor recorded for distributed autograd arrived without its context "
                "and message ids"
            )
        assert isinstance(wire, WireContext)
        agent = wire.agent
        ctx = ext(agent).context(context_id)
        st = state(ctx)
        peer = wire.peer.id
        with ctx.lock:
            ctx.known.add(peer)
        with st.lock:
            recv = st.recvs.get(message_id)
            if recv is None:
                recv = st.recvs[message_id] = TorchRecv(message_id, peer)
        with torch.enable_grad():
            return receive(recv.anchor, tensor, self._deliverer(agent, context_id, recv), index)


def _forget(st: TorchState, message_id: int) -> None:
    with st.lock:
        st.sends.pop(message_id, None)
