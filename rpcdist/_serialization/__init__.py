"""The wire codec: a msgpack header plus out-of-band buffers for arrays.

``encode`` turns a value into ``(header, buffers)``; ``decode`` turns them
back. Besides msgpack's own types the codec carries tuples, sets, bytearrays,
complex and big ints, NumPy arrays and scalars, CuPy arrays, torch tensors,
:class:`~rpcdist.WorkerInfo`, exceptions, functions (by name), registered
dataclasses and NamedTuples, and the extensions other rpcdist modules register.
"""

from __future__ import annotations

from ._codec import CODEC_VERSION, decode, encode
from ._exceptions import exception_from_wire, exception_to_wire
from ._functions import function_name, resolve_function
from ._plugins import register_extension
from ._types import register_type

__all__ = [
    "CODEC_VERSION",
    "decode",
    "encode",
    "exception_from_wire",
    "exception_to_wire",
    "function_name",
    "register_extension",
    "register_type",
    "resolve_function",
]
