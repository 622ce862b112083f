"""torch values that programs pass around besides dense tensors and modules:
``torch.Size`` (a shape: ``x.shape``), ``torch.dtype``, ``torch.device`` and
``PackedSequence`` (an RNN's padded batch, a NamedTuple of tensors), the
named tuples torch's operators return (``torch.max(x, dim=0)``: a
``torch.return_types.max`` of values and indices), and sparse COO tensors
(an embedding's sparse gradient): their indices and values travel as dense
tensors (inside a distributed autograd context, with a send and receive edge
as a dense tensor's), and the receiver rebuilds the tensor with torch's own invariant
checks (indices within the shape), so a peer cannot hand it a tensor that
reads out of bounds.

Each travels as plain data (the ints of the shape, the dtype's name, the
device's string) and is rebuilt from it on the receiver: no pickle, and
nothing a peer sends names more than a dtype or a device.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import SerializationError
from .._serialization import register_extension, register_type
from .._serialization._arrays import TENSOR_LAYOUTS
from .._serialization._hooks import TensorGradHook, hooks_of
from .._serialization._plugins import register_family, register_variant

__all__ = ["install"]

SIZE_CODE = 36
DTYPE_CODE = 37
DEVICE_CODE = 38
#: The ``torch.return_types`` classes (75 of them, without a common base: one
#: family, not one registered class per code).
RETURN_TYPE_CODE = 39
SPARSE_CODE = 40


def _encode_size(size: torch.Size, wire: Any) -> list[int]:
    return list(size)


def _decode_size(payload: Any, wire: Any) -> torch.Size:
    if not isinstance(payload, list) or any(type(n) is not int or n < 0 for n in payload):
        raise SerializationError("malformed torch.Size payload")
    return torch.Size(payload)


def _encode_dtype(dtype: torch.dtype, wire: Any) -> str:
    return str(dtype).removeprefix("torch.")


#: torch's dtypes by name (a lookup, not ``getattr(torch, name)``: that can
#: import a submodule of torch on a peer's say).
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def _decode_dtype(payload: Any, wire: Any) -> torch.dtype:
    dtype = _DTYPES.get(payload) if isinstance(payload, str) else None
    if dtype is None:
        raise SerializationError(f"received an unknown torch dtype {str(payload)[:40]!r}")
    return dtype


def _encode_device(device: torch.device, wire: Any) -> str:
    return str(device)


def _decode_device(payload: Any, wire: Any) -> torch.device:
    if not isinstance(payload, str) or len(payload) > 64:
        raise SerializationError("malformed torch.device payload")
    try:
        return torch.device(payload)
    except RuntimeError as e:
        raise SerializationError(f"received an invalid torch device {payload!r}: {e}") from e


_RETURNS = "torch.return_types"


def _is_return(obj: object) -> bool:
    return type(obj).__module__ == _RETURNS and isinstance(obj, tuple)


def _encode_return(obj: tuple[Any, ...], wire: Any) -> list[Any]:
    return [type(obj).__name__, list(obj)]


def _decode_return(payload: Any, wire: Any) -> tuple[Any, ...]:
    if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[1], list)):
        raise SerializationError("malformed torch return type payload")
    name, values = payload
    cls = vars(torch.return_types).get(name) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, tuple) and cls.__module__ == _RETURNS):
        raise SerializationError(f"received an unknown torch return type {str(name)[:40]!r}")
    return cls(values)  # (a wrong field count raises: the codec says it cannot decode it)


def _grad_hook(wire: Any) -> TensorGradHook | None:
    """The tensor-gradient hook of the agent the message belongs to, if any."""
    hooks = hooks_of(wire)
    return None if hooks is None else hooks.tensor_grad


def _encode_sparse(t: torch.Tensor, wire: Any) -> list[Any]:
    # Inside a distributed autograd context a sparse tensor that requires grad
    # records its send edge as a dense one does (index >= 0; -1: none).
    index = -1
    grad_hook = _grad_hook(wire) if t.requires_grad else None
    if grad_hook is not None:
        index = grad_hook.record(wire, t)
    d = t.detach()
    return [d._indices(), d._values(), list(d.shape), d.is_coalesced(), t.requires_grad, index]


def _decode_sparse(payload: Any, wire: Any) -> torch.Tensor:
    if not (isinstance(payload, list) and len(payload) == 6):
        raise SerializationError("malformed sparse tensor payload")
    indices, values, shape, coalesced, requires_grad, index = payload
    grad_hook = _grad_hook(wire)
    if not (
        isinstance(indices, torch.Tensor)
        and isinstance(values, torch.Tensor)
        and indices.dtype == torch.int64
        and indices.dim() == 2
        and isinstance(shape, list)
        and all(type(n) is int and n >= 0 for n in shape)
        and type(coalesced) is bool
        and type(requires_grad) is bool
        and type(index) is int
        and (index < 0 or (requires_grad and grad_hook is not None))
    ):
        raise SerializationError("malformed sparse tensor payload")
    try:
        out = torch.sparse_coo_tensor(
            indices, values, shape, is_coalesced=coalesced, check_invariants=True
        )
    except RuntimeError as e:
        raise SerializationError(f"received an invalid sparse tensor: {e}") from e
    if index >= 0 and grad_hook is not None:  # the receive edge of a tensor sent
        edge: torch.Tensor = grad_hook.attach(wire, out, index)  # inside a context
        return edge
    return out.requires_grad_(requires_grad)


def install() -> None:
    """Teach the codec torch shapes, dtypes, devices, packed sequences,
    operators' named tuples and sparse tensors (idempotent)."""
    register_extension(torch.Size, SIZE_CODE, _encode_size, _decode_size)
    register_type(torch.nn.utils.rnn.PackedSequence)
    register_family(_is_return, RETURN_TYPE_CODE, _encode_return, _decode_return, _RETURNS)
    register_extension(torch.dtype, DTYPE_CODE, _encode_dtype, _decode_dtype)
    register_extension(torch.device, DEVICE_CODE, _encode_device, _decode_device)
    TENSOR_LAYOUTS[torch.sparse_coo] = register_variant(
        SPARSE_CODE, _encode_sparse, _decode_sparse, "a sparse torch tensor", _encode_sparse
    )
