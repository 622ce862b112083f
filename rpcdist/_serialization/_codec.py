"""``encode`` and ``decode``: a msgpack header plus out-of-band array buffers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgpack

from .._errors import RpcdistError, SerializationError
from . import _arrays, _builtins  # noqa: F401  (install their extensions)
from ._errorpath import locate
from ._extensions import MARKS, STR_ERRORS, TUPLE, DecodeState, EncodeState

__all__ = ["CODEC_VERSION", "EMPTY_CALL_HEADER", "NONE_HEADER", "decode", "encode"]

CODEC_VERSION: Final = 1
"""Bumped whenever the wire format changes; peers compare it at handshake."""

Buffer = bytes | bytearray | memoryview
_packb = msgpack.packb
_unpackb = msgpack.unpackb
_STR_ERRORS = STR_ERRORS
#: The headers of ``((), {})`` (the payload of a call without arguments) and
#: of ``None`` (a reply without a value), the same bytes the general path
#: writes: :func:`encode` returns them and :func:`decode` recognises them
#: without running msgpack and its hooks (a no-op call's whole codec cost).
EMPTY_CALL_HEADER: Final = _packb([MARKS[TUPLE], [MARKS[TUPLE]], {}])
NONE_HEADER: Final = _packb(None)


def encode(
    obj: object, *, allow_pickle: bool = False, context: object = None, where: str = "value"
) -> tuple[bytes, list[memoryview]]:
    """Encode ``obj`` as a msgpack header plus out-of-band buffers for its arrays.

    C-contiguous (and Fortran-contiguous) arrays are not copied: their buffers
    are views of the arrays' memory, so the arrays must not change until the
    buffers have been sent.

    Args:
        obj: The value.
        allow_pickle: Pickle values of unknown types instead of refusing them.
        context: Handed to extension encoders (see ``register_extension``).
        where: Name of ``obj`` in error messages, e.g. ``"args"``.

    Returns:
        ``(header, buffers)``.

    Raises:
        SerializationError: Some part of ``obj`` cannot be encoded; the message
            names its type and where it sat, e.g. ``args[1]['opt']``.
        RpcdistError: An extension encoder refused a value with an rpcdist
            error of another kind (e.g. ``RRefError``); it passes unchanged.
    """
    if obj is None:
        return NONE_HEADER, []
    if type(obj) is tuple and len(obj) == 2:
        args, kwargs = obj
        if type(args) is tuple and not args and type(kwargs) is dict and not kwargs:
            return EMPTY_CALL_HEADER, []
    state = EncodeState(allow_pickle, context)
    try:
        header = _packb(obj, default=state.default, strict_types=True, unicode_errors=_STR_ERRORS)
    except Exception as exc:
        if isinstance(exc, RpcdistError) and not isinstance(exc, SerializationError):
            raise
        raise _explain(obj, where, state, exc) from exc
    finally:
        # ``failed`` holds the exception, whose traceback holds ``state``:
        # left in place, that cycle would keep ``obj`` alive until the
        # garbage collector next ran.
        state.failed = None
    return header, state.buffers


def _explain(obj: object, where: str, state: EncodeState, exc: Exception) -> SerializationError:
    path = where
    if state.failed is not None:
        bad, cause = state.failed
        reason = str(cause) if isinstance(cause, SerializationError) else repr(cause)
        try:
            path = _short(locate(obj, where, bad, state.expanded) or where)
        except Exception:
            pass
        return SerializationError(
            f"cannot serialize value of type '{type(bad).__qualname__}' at {path}: {reason}"
        )
    if isinstance(exc, ValueError) and "recursion" in str(exc):
        try:
            path = _short(locate(obj, where, None, state.expanded) or where)
        except Exception:
            pass
        return SerializationError(
            f"cannot serialize {where}: nested too deeply at {path} (a reference cycle?)"
        )
    return SerializationError(f"cannot serialize {where}: {exc!r}")


def _short(path: str) -> str:
    return path if len(path) <= 200 else f"{path[:90]} ... {path[-90:]}"


def decode(
    header: bytes | memoryview,
    buffers: Sequence[Buffer],
    *,
    allow_pickle: bool = False,
    context: object = None,
) -> object:
    """Rebuild a value from a header and buffers made by :func:`encode`.

    Arrays are views over ``buffers`` (no copy), writable where the buffer is.

    Args:
        header: The msgpack header.
        buffers: The out-of-band buffers, in order.
        allow_pickle: Accept pickled values (only from trusted peers).
        context: Handed to extension decoders (see ``register_extension``).

    Returns:
        The value.

    Raises:
        SerializationError: The input is malformed, truncated or does not match
            its buffers; a type or function it names is unknown here; or it
            holds a pickled value and ``allow_pickle`` is off.
        RpcdistError: An extension decoder raised an rpcdist error of another
            kind; it passes unchanged.
    """
    if not buffers:
        if header == EMPTY_CALL_HEADER:
            return (), {}
        if header == NONE_HEADER:
            return None
    state = DecodeState(buffers, allow_pickle, context)
    try:
        obj = _unpackb(
            header,
            ext_hook=state.ext_hook,
            list_hook=state.list_hook,
            strict_map_key=False,
            unicode_errors=_STR_ERRORS,
        )
        count = len(buffers)
    except RpcdistError:
        raise
    except Exception as exc:
        raise SerializationError(f"malformed message header: {exc!r}") from exc
    if state.pending:
        raise SerializationError("malformed message header: stray extension marker")
    used = 0 if state.used is None else len(state.used)
    if used != count:
        raise SerializationError(
            f"message has {count} out-of-band buffers, but its header uses {used}"
        )
    return obj
