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
from .._serialization._extensions import (
    DECODERS,
    FINDERS,
    MARKS,
    DecodeState,
    EncodeState,
    Handler,
    unknown_code,
)

__all__ = ["install"]

SIZE_CODE = 36
DTYPE_CODE = 37
DEVICE_CODE = 38
#: The ``torch.return_types`` classes (75 of them, without a common base: a
#: finder, not one registered class per code).
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


def _encode_return(state: EncodeState, obj: tuple[Any, ...]) -> list[Any]:
    payload = [type(obj).__name__, list(obj)]
    state.remember(obj, payload)
    return [MARKS[RETURN_TYPE_CODE], payload]


def _decode_return(state: DecodeState, items: list[Any]) -> object:
    payload = items[1] if len(items) == 2 else None
    if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[1], list)):
        raise SerializationError("malformed torch return type payload")
    name, values = payload
    cls = vars(torch.return_types).get(name) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, tuple) and cls.__module__ == _RETURNS):
        raise SerializationError(f"received an unknown torch return type {str(name)[:40]!r}")
    try:
        return cls(values)
    except (TypeError, ValueError) as e:  # (the wrong number of fields)
        raise SerializationError(f"malformed torch.return_types.{name} payload: {e}") from e


_RETURNS = "torch.return_types"


def _find_return(obj: object) -> Handler | None:
    return _encode_return if type(obj).__module__ == _RETURNS and isinstance(obj, tuple) else None


def install() -> None:
    """Teach the codec torch shapes, dtypes, devices, packed sequences and
    operators' named tuples (idempotent)."""
    register_extension(torch.Size, SIZE_CODE, _encode_size, _decode_size)
    register_type(torch.nn.utils.rnn.PackedSequence)
    if _find_return not in FINDERS:
        if DECODERS[RETURN_TYPE_CODE] is not unknown_code:
            raise RuntimeError(f"codec extension code {RETURN_TYPE_CODE} is taken")
        DECODERS[RETURN_TYPE_CODE] = _decode_return
        FINDERS.append(_find_return)
    register_extension(torch.dtype, DTYPE_CODE, _encode_dtype, _decode_dtype)
    register_extension(torch.device, DEVICE_CODE, _encode_device, _decode_device)
