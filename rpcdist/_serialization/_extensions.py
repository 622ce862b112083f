"""Extension codes, the type-dispatch tables and the per-call codec state.

A value msgpack cannot pack natively is written as a msgpack array whose first
element is an empty ext *marker* naming the extension: ``[marker(code),
*payload]``. The payload is ordinary packable data, so nested values need no
second msgpack pass. On decode the ext hook turns each marker into a
:class:`Marker` and the list hook rebuilds the value when the array closes.

Codes 0..31 are the codec's own; 32..63 are for other rpcdist modules through
:func:`~._plugins.register_extension`.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgpack

from .._errors import SerializationError

__all__ = [
    "BIGINT",
    "COMPLEX",
    "CUPY",
    "DECODERS",
    "ELLIPSIS",
    "ENCODERS",
    "EXCEPTION",
    "FINDERS",
    "FIRST_PLUGIN",
    "FROZENSET",
    "FUNCTION",
    "MARKS",
    "NDARRAY",
    "NPDTYPE",
    "NPSCALAR",
    "ORDEREDDICT",
    "PICKLE",
    "PLUGINS",
    "RANGE",
    "REGISTERED",
    "SET",
    "SLICE",
    "STR_ERRORS",
    "TENSOR",
    "TUPLE",
    "WORKERINFO",
    "DecodeState",
    "Decoder",
    "EncodeState",
    "Handler",
    "Marker",
    "Unsupported",
    "define",
    "forget_found",
    "unknown_code",
]

TUPLE: Final = 1
SET: Final = 2
FROZENSET: Final = 3
# 4 is reserved (bytearray: msgpack writes it as bin before any hook runs)
COMPLEX: Final = 5
BIGINT: Final = 6
NDARRAY: Final = 7
NPSCALAR: Final = 8
WORKERINFO: Final = 9
EXCEPTION: Final = 10
FUNCTION: Final = 11
REGISTERED: Final = 12
PICKLE: Final = 13
CUPY: Final = 14
TENSOR: Final = 15
ORDEREDDICT: Final = 16
SLICE: Final = 17
RANGE: Final = 18
ELLIPSIS: Final = 19
NPDTYPE: Final = 20
FIRST_PLUGIN: Final = 32
_CODES: Final = 64
#: Strings are UTF-8 on the wire; a lone surrogate (a str Python allows, e.g.
#: from ``os.fsdecode`` or inside a NumPy unicode scalar) travels as its
#: 3-byte form instead of failing, so every str round-trips exactly.
STR_ERRORS: Final = "surrogatepass"


class Marker:
    """Decoded form of an extension marker; consumed by the list hook."""

    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = code


class Unsupported(SerializationError):
    """A handler's refusal; the message is the reason, the codec adds where."""


Handler = Callable[["EncodeState", Any], list[Any]]
Decoder = Callable[["DecodeState", list[Any]], object]
Finder = Callable[[object], Handler | None]

MARKS: Final = tuple(msgpack.ExtType(code, b"") for code in range(_CODES))
_MARKERS: Final = tuple(Marker(code) for code in range(_CODES))

ENCODERS: dict[type, Handler] = {}
"""Exact type -> handler; the fast path. Finders' answers are cached here."""
FINDERS: list[Finder] = []
"""Slow-path lookups (subclasses, lazily imported libraries), in order."""
PLUGINS: dict[type, tuple[int, Handler]] = {}
"""Classes registered by other rpcdist modules -> (code, handler)."""
_found: set[type] = set()


def unknown_code(state: DecodeState, items: list[Any]) -> object:
    """Decoder of every code nobody registered."""
    raise SerializationError("malformed message header: unknown extension code")


DECODERS: list[Decoder] = [unknown_code] * _CODES
"""Code -> decoder of ``[marker, *payload]``."""


def define(code: int, types: Sequence[type], handler: Handler, decoder: Decoder) -> None:
    """Install one of the codec's own extensions (import-time only)."""
    for cls in types:
        ENCODERS[cls] = handler
    DECODERS[code] = decoder


class EncodeState:
    """What one ``encode`` call accumulates; ``default`` is msgpack's hook."""

    __slots__ = ("allow_pickle", "buffers", "context", "expanded", "failed")

    def __init__(self, allow_pickle: bool, context: object) -> None:
        self.allow_pickle = allow_pickle
        self.context = context
        self.buffers: list[memoryview] = []
        self.failed: tuple[object, BaseException] | None = None
        self.expanded: dict[int, object] | None = None

    def default(self, obj: object) -> list[Any]:
        """Turn a value msgpack cannot pack into ``[marker, *payload]``."""
        handler = ENCODERS.get(type(obj))
        try:
            if handler is None:
                handler = self._find(obj)
            return handler(self, obj)
        except BaseException as exc:
            self.failed = (obj, exc)
            raise

    def add_buffer(self, view: memoryview) -> int:
        """Append an out-of-band buffer and return its index."""
        self.buffers.append(view)
        return len(self.buffers) - 1

    def remember(self, obj: object, payload: object) -> None:
        """Keep a plugin's payload so a failure inside it can be located."""
        if self.expanded is None:
            self.expanded = {}
        self.expanded[id(obj)] = payload

    def _find(self, obj: object) -> Handler:
        cls = type(obj)
        for plugin, (_, handler) in PLUGINS.items():
            if isinstance(obj, plugin):
                _cache(cls, handler)
                return handler
        for finder in FINDERS:
            found = finder(obj)
            if found is not None:
                _cache(cls, found)
                return found
        if self.allow_pickle:
            return _encode_pickle
        raise Unsupported(_why_unsupported(obj))


def _cache(cls: type, handler: Handler) -> None:
    ENCODERS[cls] = handler
    _found.add(cls)


def forget_found() -> None:
    """Drop the finders' cached answers (after the plugin table changed)."""
    for cls in _found:
        ENCODERS.pop(cls, None)
    _found.clear()


def _why_unsupported(obj: object) -> str:
    cls = type(obj)
    if hasattr(cls, "__dataclass_fields__") or (issubclass(cls, tuple) and hasattr(cls, "_fields")):
        return (
            f"{cls.__qualname__} is not registered; decorate it with @rpcdist.register_type "
            "on every worker"
        )
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return "NumPy array subclasses are not supported; send numpy.asarray(value)"
    futures = {c.__module__.partition(".")[0] for c in cls.__mro__ if c.__name__ == "Future"}
    if futures & {"torch", "rpcdist"}:  # (torch's words first: programs match them)
        torchs = "Can not pickle torch.futures.Future: " if "torch" in futures else ""
        return f"{torchs}a Future cannot be sent; send its value once it is done"
    return (
        "no encoder for this type (register dataclasses and NamedTuples with "
        "rpcdist.register_type, or enable allow_pickle on a trusted cluster)"
    )


class DecodeState:
    """What one ``decode`` call tracks; ``ext_hook``/``list_hook`` are msgpack's hooks."""

    __slots__ = ("allow_pickle", "buffers", "context", "pending", "used")

    def __init__(self, buffers: Sequence[Any], allow_pickle: bool, context: object) -> None:
        self.buffers = buffers
        self.allow_pickle = allow_pickle
        self.context = context
        self.pending = 0
        self.used: set[int] | None = None  # indices of buffers taken, made on first use

    def ext_hook(self, code: int, data: bytes) -> Marker:
        """Turn an ext marker into a :class:`Marker`; reject anything else."""
        if data or not 0 <= code < _CODES or DECODERS[code] is unknown_code:
            raise SerializationError(
                f"malformed message header: unexpected extension (code {code}, {len(data)} bytes)"
            )
        self.pending += 1
        return _MARKERS[code]

    def list_hook(self, items: list[Any]) -> object:
        """Rebuild ``[marker, *payload]`` arrays; pass plain lists through."""
        if items and type(items[0]) is Marker:
            self.pending -= 1
            return DECODERS[items[0].code](self, items)
        return items

    def take_buffer(self, index: object) -> memoryview:
        """Return out-of-band buffer ``index``, each usable once.

        Raises:
            SerializationError: no such buffer, or it was already used.
        """
        if type(index) is not int or not 0 <= index < len(self.buffers):
            raise SerializationError(
                f"malformed message header: buffer index {index!r} out of range "
                f"(message has {len(self.buffers)} buffers)"
            )
        if self.used is None:
            self.used = set()
        elif index in self.used:
            raise SerializationError(f"malformed message header: buffer {index} used twice")
        self.used.add(index)
        view = memoryview(self.buffers[index])
        if not view.c_contiguous:
            raise SerializationError(f"out-of-band buffer {index} is not contiguous")
        return view


def _encode_pickle(state: EncodeState, obj: object) -> list[Any]:
    indices: list[int] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        try:
            view = buffer.raw()
        except BufferError:
            return True  # not contiguous: keep it in-band
        indices.append(state.add_buffer(view))
        return False

    data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    return [MARKS[PICKLE], data, indices]


def _decode_pickle(state: DecodeState, items: list[Any]) -> object:
    if not state.allow_pickle:
        raise SerializationError(
            "received a pickled value, but pickle is disabled on this worker (allow_pickle=False)"
        )
    if len(items) != 3 or type(items[1]) is not bytes or type(items[2]) is not list:
        raise SerializationError("malformed pickle payload in message header")
    buffers = [state.take_buffer(index) for index in items[2]]
    try:
        return pickle.loads(items[1], buffers=buffers)
    except Exception as exc:
        raise SerializationError(f"cannot unpickle value: {exc}") from exc


DECODERS[PICKLE] = _decode_pickle
