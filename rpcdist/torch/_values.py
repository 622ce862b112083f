"""torch values that programs pass around besides tensors and modules:
``torch.Size`` (a shape: ``x.shape``), ``torch.dtype``, ``torch.device`` and
``PackedSequence`` (an RNN's padded batch, a NamedTuple of tensors), and the
named tuples torch's operators return (``torch.max(x, dim=0)``: a
``torch.return_types.max`` of values and indices).

Each travels as plain data (the ints of the shape, the dtype's name, the
device's string) and is rebuilt from it on the receiver: no pickle, and
nothing a peer sends names more than a dtype or a device.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import SerializationError
from .._serialization import register_extension, register_type
from .._serialization._plugins import register_family

__all__ = ["install"]

SIZE_CODE = 36
DTYPE_CODE = 37
DEVICE_CODE = 38
#: The ``torch.return_types`` classes (75 of them, without a common base: one
#: family, not one registered class per code).
RETURN_TYPE_CODE = 39


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


def install() -> None:
    """Teach the codec torch shapes, dtypes, devices, packed sequences and
    operators' named tuples (idempotent)."""
    register_extension(torch.Size, SIZE_CODE, _encode_size, _decode_size)
    register_type(torch.nn.utils.rnn.PackedSequence)
    register_family(_is_return, RETURN_TYPE_CODE, _encode_return, _decode_return, _RETURNS)
    register_extension(torch.dtype, DTYPE_CODE, _encode_dtype, _decode_dtype)
    register_extension(torch.device, DEVICE_CODE, _encode_device, _decode_device)
