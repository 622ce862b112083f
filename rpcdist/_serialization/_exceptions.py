"""Exceptions on the wire: a small dict, re-created on the receiver when possible.

Only :class:`Exception` subclasses are re-created (never ``SystemExit``,
``KeyboardInterrupt`` or ``GeneratorExit``), and only types under the
exposure rule: builtin exceptions, rpcdist's own errors and exception
classes of the program's own modules; anything else arrives as a
:class:`~rpcdist.RemoteError` naming the remote type. The sender's traceback
is chained as ``__cause__`` (as :mod:`concurrent.futures` does), so an
uncaught remote error prints the callee's frames.
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

import msgpack

from .._errors import RemoteError, RpcdistError, SerializationError
from ._exposure import is_program_module
from ._extensions import STR_ERRORS, EncodeState

__all__ = ["exception_from_wire", "exception_to_wire"]

_local = threading.local()


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<unprintable {type(exc).__qualname__}>"


def _encodable_args(exc: BaseException) -> tuple[Any, ...] | None:
    busy: set[int] = _local.__dict__.setdefault("busy", set())
    if id(exc) in busy:
        # The exception is inside its own args: fail the enclosing check.
        raise SerializationError("an exception's args contain the exception itself")
    busy.add(id(exc))
    state = EncodeState(False, None)  # (as ``encode(args)`` does, which needs this module)
    try:
        args = exc.args
        msgpack.packb(args, default=state.default, strict_types=True, unicode_errors=STR_ERRORS)
    except Exception:
        return None
    finally:
        busy.discard(id(exc))
        state.failed = None  # (it holds the exception, whose traceback holds ``state``)
    return args


def exception_to_wire(exc: BaseException) -> dict[str, Any]:
    """Describe ``exc`` for another worker.

    A :class:`~rpcdist.RemoteError` is described by the type it stands for, so
    an error that crossed several workers keeps its original type; tracebacks
    from earlier workers are kept in front of this worker's.

    Args:
        exc: The exception.

    Returns:
        ``{"type": "module:qualname", "message": str(exc), "args": args or
        None (when they cannot be encoded), "traceback": formatted text}``.

    Raises:
        SerializationError: only while checking the args of an exception that
            contains ``exc`` (a cycle); that check then drops its args.
    """
    cls = type(exc)
    remote_type = getattr(exc, "remote_type", "") if isinstance(exc, RemoteError) else ""
    type_name = remote_type or f"{cls.__module__}:{cls.__qualname__}"
    try:
        # (a re-raised remote error: its cause is the earlier text, added below)
        chain = not isinstance(exc.__cause__, _RemoteTraceback)
        text = "".join(traceback.format_exception(exc, chain=chain))
    except Exception:
        text = f"{cls.__qualname__}: {_text(exc)}\n"
    earlier = getattr(exc, "remote_traceback", None)
    if isinstance(earlier, str) and earlier:
        text = f"{earlier}\nThe exception above was re-raised on another worker:\n\n{text}"
    return {
        "type": type_name,
        "message": _text(exc),
        "args": _encodable_args(exc),
        "traceback": text,
    }


class _RemoteTraceback(Exception):
    """The callee's formatted traceback, chained as a rebuilt error's ``__cause__``."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


def _admitted(cls: type[BaseException], module: str) -> bool:
    """Whether a reply may rebuild errors of ``cls`` (found as ``module``)."""
    if not issubclass(cls, Exception):
        return False  # (SystemExit, KeyboardInterrupt, GeneratorExit: never)
    if module == "builtins" or is_program_module(module):
        return True
    return issubclass(cls, RpcdistError) and module.partition(".")[0] == "rpcdist"


def _local_type(name: str) -> type[BaseException] | None:
    """Find an exception class among modules already imported (imports nothing),
    if the exposure rule admits it."""
    module_name, _, qualname = name.partition(":")
    target: object = sys.modules.get(module_name)
    if target is None or not qualname:
        return None
    for part in qualname.split("."):
        try:
            target = vars(target).get(part)
        except TypeError:
            return None
    if isinstance(target, type) and issubclass(target, BaseException):
        return target if _admitted(target, module_name) else None
    return None


def exception_from_wire(d: object) -> BaseException:
    """Re-create an exception described by :func:`exception_to_wire`.

    The original type is used when it is already imported here, is an
    ``Exception`` the exposure rule admits (see the module docstring) and can
    be built from its args (or from its message alone); otherwise the result
    is a :class:`~rpcdist.RemoteError` carrying ``remote_type``, its text
    PyTorch's ("Failed to create original exception type. Error msg was
    <why> Original exception on remote side was <type>: <message>"). Either way
    the result's ``remote_traceback`` holds the sender's traceback text, also
    chained as its ``__cause__``.

    Args:
        d: The wire description (anything else raises SerializationError).

    Returns:
        The exception, ready to raise.

    Raises:
        SerializationError: ``d`` is not such a description.
    """
    if not isinstance(d, dict):
        raise SerializationError(f"malformed exception payload: expected a dict, got {type(d)}")
    name, message, args, text = (d.get(k) for k in ("type", "message", "args", "traceback"))
    if not (
        isinstance(name, str)
        and isinstance(message, str)
        and isinstance(text, str)
        and (args is None or isinstance(args, tuple | list))
    ):
        raise SerializationError("malformed exception payload: missing or mistyped fields")
    cls = _local_type(name)
    exc: BaseException | None = None
    failed: Exception | None = None
    if cls is not None:
        for attempt in (args, (message,)):
            if attempt is None:
                continue
            try:
                made = cls(*attempt)
            except Exception as e:
                failed = e
                continue
            if isinstance(made, BaseException):
                exc = made
                break
    if exc is not None:
        try:
            exc.remote_traceback = text  # type: ignore[attr-defined]
        except Exception:
            exc = None
    if exc is None:  # (in torch's words, which programs match, then the remote message)
        why = failed if failed is not None else f"{name} is not re-created on this worker"
        exc = RemoteError(
            f"Failed to create original exception type. Error msg was {why} Original "
            f"exception on remote side was {name.rpartition(':')[2]}: {message}",
            remote_type=name,
            remote_traceback=text,
        )
    exc.__cause__ = _RemoteTraceback(text)
    return exc
