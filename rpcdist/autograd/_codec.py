"""How an ``rpcdist.tensor.Tensor`` crosses the wire, recording autograd edges.

A tensor travels as ``[data, requires_grad, index]`` (its array goes
out-of-band like any array). Inside a distributed autograd context (the
message's metadata carries ``"ad"``, the context id), a tensor that requires
grad is recorded in the sender's :class:`DistSend` for the message and gets
``index``, its output number there; the message's metadata then also carries
``"am"``, the message id (added while encoding, before the message leaves).
The receiver makes it a non-leaf tensor whose ``grad_fn`` is the message's
:class:`DistRecv`. Outside a context (or without a gradient) ``index`` is
-1 and the receiver gets a plain tensor with the same ``requires_grad``.
"""

from __future__ import annotations

from typing import Any

from .._errors import SerializationError
from .._rpc._context import WireContext
from .._serialization import register_extension
from ..tensor import Tensor
from ._context import ContextTable

__all__ = ["TENSOR_CODE", "register_tensor_codec"]

#: Codec extension code of tensors (RRefs have 32).
TENSOR_CODE = 33


def _extension(wire: WireContext) -> ContextTable:
    ext: Any = wire.agent.registry.extensions.get("autograd")
    if ext is None:
        raise SerializationError(
            f"the rpcdist agent {wire.agent.name!r} has no distributed autograd installed"
        )
    ext_typed: ContextTable = ext
    return ext_typed


def _encode(t: Tensor, wire: Any) -> list[Any]:
    data = t.data
    if not t.requires_grad or not isinstance(wire, WireContext) or wire.meta is None:
        return [data, t.requires_grad, -1]
    context_id = wire.meta.get("ad")
    if not isinstance(context_id, int) or wire.extra.get("aborted"):
        return [data, True, -1]
    ext = _extension(wire)
    message_id = wire.meta.get("am")
    if not isinstance(message_id, int):
        message_id = wire.meta["am"] = ext.ids.new()
    ctx = ext.context(context_id)
    send = ctx.send_for(message_id, wire.peer.id)
    if not wire.extra.get("ad_undo"):
        wire.extra["ad_undo"] = True
        wire.extra.setdefault("undo", []).append(lambda: ext.forget_send(context_id, message_id))
    return [data, True, send.add(t)]


def _decode(items: Any, wire: Any) -> Tensor:
    if not (isinstance(items, list) and len(items) == 3):
        raise SerializationError("malformed tensor payload")
    data, requires_grad, index = items
    if not isinstance(index, int) or index < -1:
        raise SerializationError(f"malformed tensor payload: index {index!r}")
    if index < 0:
        return Tensor(data, requires_grad=bool(requires_grad))
    meta = wire.meta if isinstance(wire, WireContext) else None
    context_id = meta.get("ad") if meta else None
    message_id = meta.get("am") if meta else None
    if not isinstance(context_id, int) or not isinstance(message_id, int):
        raise SerializationError(
            "a tensor recorded for distributed autograd arrived without its context and message ids"
        )
    ext = _extension(wire)
    recv = ext.context(context_id).recv_for(message_id, wire.peer.id)
    recv.grow(index)
    return Tensor._from_op(data, recv, index)


def register_tensor_codec() -> None:
    """Teach the codec tensors (idempotent)."""
    register_extension(Tensor, TENSOR_CODE, _encode, _decode)
