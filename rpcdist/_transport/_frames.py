"""Pure framing: pack outgoing messages into stream messages and reassemble them.

A stream message is ``[u32 envelope length][envelope][payload area]``. The
envelope is a msgpack array of frames, each an array of the eleven fields of
:class:`Frame` in order (a first frame carries the message's method, codec
header, buffer sizes, remaining budget and extension fields; a continuation
frame only its id, kind, flags and payload length); the payload area holds
each frame's ``data_len`` bytes in frame order. :func:`parse_envelope`
checks every field's type and sign before anything reads them.
:func:`pack_batch_parts` copies nothing
(the TCP transport hands its parts to ``sendmsg``); :func:`pack_batch` joins
them for gRPC. The :class:`Reassembler` says where each frame's payload goes
(a fresh buffer or one the receiver posted in advance): the TCP transport
receives into it directly, :meth:`Reassembler.feed` copies a whole gRPC
message into it. No sockets, no event loop.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgpack
import numpy as np

from .._errors import ProtocolError

__all__ = [
    "CALL",
    "ERROR_REPLY",
    "HEARTBEAT",
    "INTERNAL",
    "P2P",
    "REPLY",
    "Frame",
    "InMessage",
    "Meta",
    "OutMessage",
    "Reassembler",
    "fault_label",
    "pack_batch",
    "pack_batch_parts",
    "pack_envelope",
    "parse_envelope",
]

_LEN = struct.Struct("<I")
#: Most messages one link may be receiving at once (started, not finished).
MAX_PARTIAL = 1024
#: Most frames coalesced into one stream message.
MAX_FRAMES_PER_BATCH = 512

#: What a message is: a user function's call (by qualified name,
#: ``"module:qualname"``), an rpcdist control method's (RRef protocol,
#: shutdown, ...), the value or the exception either returned, or a one-way
#: point-to-point message (collectives).
CALL, INTERNAL, REPLY, ERROR_REPLY, P2P = 1, 2, 3, 4, 5
KIND_NAMES = {CALL: "call", INTERNAL: "internal", REPLY: "reply", ERROR_REPLY: "error", P2P: "p2p"}
#: The key of a heartbeat: an empty one-way (P2P) message on an idle link,
#: which the receiver drops (it only shows that the sender is alive).
HEARTBEAT = "\x00hb"

#: Named extension fields of a message (``Frame.meta``): msgpack-able values.
Meta = dict[str, object]


class Frame(NamedTuple):
    """One frame of a stream message: a whole small message, or a chunk of a large one."""

    #: Message id, unique per sender and kind.
    id: int
    kind: int
    #: First and last frame of the message.
    first: bool = False
    last: bool = False
    #: Function name, internal method or P2P key (first frame).
    method: str = ""
    #: The codec's msgpack header (first frame).
    header: bytes = b""
    #: Sizes of the out-of-band buffers (first frame).
    buffer_sizes: tuple[int, ...] = ()
    #: Remaining budget when sent; 0 = none (first frame).
    timeout_us: int = 0
    #: Payload bytes following in this stream message.
    data_len: int = 0
    #: A /dev/shm file holding the buffers (first frame; then no stream data).
    shm_path: str = ""
    #: The extension fields, msgpack-packed (first frame; empty: none).
    meta: bytes = b""


#: Each field's exact type on the wire, in order (a ``bool`` is no ``int`` here).
_TYPES = (int, int, bool, bool, str, bytes, tuple, int, int, str, bytes)
_new_tuple = tuple.__new__
#: Each thread's msgpack packer for envelopes (made once: ``packb`` makes one a call).
_packers = threading.local()
#: A continuation frame's empty fields.
_NO_SIZES: tuple[int, ...] = ()


@dataclass(eq=False)
class OutMessage:
    """A message waiting to be sent (possibly in several chunks)."""

    kind: int
    method: str
    header: bytes
    buffers: list[memoryview]
    id: int = 0
    deadline: float | None = None
    #: Named extension fields (``None``: none).
    meta: Meta | None = None
    #: What fault injection matches a call by (default: its method).
    label: str = ""
    #: A call that keeps its order among this agent's calls (user calls);
    #: idempotent control messages need not, so they never hold others back.
    ordered: bool = True
    #: Called once the last byte has been copied into a stream message, after
    #: which the caller may reuse its buffers.
    on_packed: Callable[[], None] | None = None
    #: Called if the message will never be sent (a closed link, an injected
    #: drop): undoes what encoding it did (for example, RRef forks).
    undo: Callable[[], None] | None = None
    #: Set when the buffers travel in a /dev/shm file instead of the stream.
    shm_path: str = ""
    # Send cursor: index of the current buffer and offset into it.
    _buf: int = 0
    _off: int = 0
    _started: bool = False

    def __post_init__(self) -> None:
        if self.buffers:  # (most calls have none: no new list for them)
            self.buffers = [
                b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in self.buffers
            ]

    @property
    def payload_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def dropped(self) -> None:
        """The message will never be sent: run its ``undo`` (once)."""
        undo, self.undo = self.undo, None
        if undo is not None:
            undo()


def fault_label(msg: OutMessage) -> str:
    """The kind fault injection matches ``msg`` by: its label (or method) for
    calls, ``"reply:"`` or ``"error:"`` and the request's for replies, ``"p2p"``
    (``"heartbeat"`` for the failure detector's)."""
    if msg.kind == P2P:
        return "heartbeat" if msg.method == HEARTBEAT else "p2p"
    label = msg.label or msg.method
    if msg.kind == REPLY:
        return "reply:" + label
    if msg.kind == ERROR_REPLY:
        return "error:" + label
    return label


def pack_batch_parts(
    queue: deque[OutMessage], batch_bytes: int, chunk_bytes: int, max_parts: int = 512
) -> tuple[bytes, list[memoryview], list[Callable[[], None]]]:
    """Take frames from the head of ``queue`` into one stream message, unjoined.

    Returns the head (``[u32 envelope length][Batch]``), the payload parts
    that follow it (views of the senders' buffers: nothing is copied) and the
    ``on_packed`` callbacks to run once those parts have been copied out.

    Whole small messages are coalesced; a large message contributes one chunk
    of at most ``chunk_bytes`` and stays at the head with its cursor advanced.
    Messages completely packed are removed from ``queue``.
    """
    frames: list[tuple[object, ...]] = []
    parts: list[memoryview] = []
    packed: list[Callable[[], None]] = []
    budget = batch_bytes
    now = time.monotonic()
    while queue and budget > 0 and len(frames) < MAX_FRAMES_PER_BATCH and len(parts) < max_parts:
        m = queue[0]
        first = not m._started
        if first:
            m._started = True
            method, header, shm_path = m.method, m.header, m.shm_path
            sizes = tuple(b.nbytes for b in m.buffers) if m.buffers else _NO_SIZES
            timeout_us = 0 if m.deadline is None else max(1, int((m.deadline - now) * 1e6))
            meta = msgpack.packb(m.meta) if m.meta else b""
            if shm_path:
                m._buf = len(m.buffers)  # nothing goes through the stream
            budget -= len(header) + 32
        else:
            method, header, sizes, timeout_us, shm_path, meta = "", b"", _NO_SIZES, 0, "", b""
        take = min(chunk_bytes, max(budget, 0))
        taken = 0
        while m._buf < len(m.buffers) and taken < take and len(parts) < max_parts:
            b = m.buffers[m._buf]
            n = min(b.nbytes - m._off, take - taken)
            if n:
                parts.append(b[m._off : m._off + n])
                taken += n
                m._off += n
            if m._off == b.nbytes:
                m._buf += 1
                m._off = 0
        budget -= taken
        last = m._buf >= len(m.buffers)
        frames.append(
            (m.id, m.kind, first, last, method, header, sizes, timeout_us, taken, shm_path, meta)
        )
        if last:
            queue.popleft()
            if m.on_packed is not None:
                packed.append(m.on_packed)
    return pack_envelope(frames), parts, packed


def pack_envelope(frames: list[tuple[object, ...]] | list[Frame]) -> bytes:
    """``[u32 length][envelope]`` for ``frames`` (each a :class:`Frame` or a tuple of its fields)."""
    try:
        env = _packers.packer.pack(frames)
    except AttributeError:
        _packers.packer = msgpack.Packer()
        env = _packers.packer.pack(frames)
    return _LEN.pack(len(env)) + env  # type: ignore[no-any-return]


def pack_batch(queue: deque[OutMessage], batch_bytes: int, chunk_bytes: int) -> bytes:
    """:func:`pack_batch_parts` joined into one ``bytes`` (copying each payload byte once)."""
    head, parts, packed = pack_batch_parts(queue, batch_bytes, chunk_bytes)
    data = b"".join([head, *parts])
    for cb in packed:  # only now are the senders' buffers copied out
        cb()
    return data


def parse_envelope(data: memoryview) -> list[Frame]:
    """Decode an envelope into its frames, each field checked.

    Raises:
        ProtocolError: it is malformed: not msgpack, not an array of frames,
            a frame of the wrong length, a field of the wrong type, a
            negative id, length, budget or buffer size.
    """
    try:
        raw = msgpack.unpackb(data, use_list=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ProtocolError(f"malformed frame envelope: {e}") from e
    if type(raw) is not tuple:
        raise ProtocolError(f"malformed frame envelope: a {type(raw).__name__}, not an array")
    frames = []
    for i, t in enumerate(raw):
        if type(t) is not tuple or tuple(map(type, t)) != _TYPES:
            got = [type(v).__name__ for v in t] if type(t) is tuple else type(t).__name__
            raise ProtocolError(
                f"malformed frame {i} of the envelope: its fields are {got}, not "
                f"{[k.__name__ for k in _TYPES]} ({', '.join(Frame._fields)})"
            )
        f = _new_tuple(Frame, t)  # (``Frame(*t)`` but for the arguments' parsing: checked above)
        if min(f.id, f.kind, f.timeout_us, f.data_len) < 0:
            raise ProtocolError(f"malformed frame {i} of the envelope: a negative field in {f}")
        if f.buffer_sizes and not all(type(n) is int and n >= 0 for n in f.buffer_sizes):
            raise ProtocolError(
                f"malformed frame {i} of the envelope: buffer sizes {f.buffer_sizes!r} are not "
                "all non-negative integers"
            )
        frames.append(f)
    return frames


@dataclass(eq=False)
class InMessage:
    """A fully reassembled incoming message."""

    id: int
    kind: int
    method: str
    header: bytes
    buffers: list[memoryview]
    timeout_us: int
    received_at: float = field(default_factory=time.monotonic)
    #: A /dev/shm file holding the buffers (``buffers`` is then empty until
    #: the receiver maps it); ``sizes`` describe them.
    shm_path: str = ""
    sizes: list[int] = field(default_factory=list)
    #: Named extension fields (``None``: none).
    meta: Meta | None = None

    @property
    def deadline(self) -> float | None:
        return self.received_at + self.timeout_us / 1e6 if self.timeout_us else None


def _meta(f: Frame) -> Meta | None:
    """A first frame's extension fields.

    Raises:
        ProtocolError: they are not a msgpack map with string keys.
    """
    if not f.meta:
        return None
    try:
        meta = msgpack.unpackb(f.meta)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"malformed metadata on message {(f.kind, f.id)}: {e}") from e
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise ProtocolError(f"metadata on message {(f.kind, f.id)} is not a map of names")
    return meta


#: ``alloc(kind, method, total_bytes) -> writable buffer of total_bytes or None``.
Allocator = Callable[[int, str, int], "memoryview | None"]


@dataclass(eq=False)
class _Partial:
    msg: InMessage
    dest: memoryview
    total: int
    filled: int = 0


class Reassembler:
    """Turns stream messages back into whole :class:`InMessage` objects.

    ``alloc`` may supply the destination buffer for a message (a receive
    posted in advance, so chunks land straight in the caller's array);
    otherwise a ``bytearray`` is allocated. Arrays decoded from it are
    writable.

    Memory is bounded: a message whose buffers add up to more than
    ``max_message_bytes`` is refused before anything is allocated, and so is
    one that would take the messages being received at once past twice that,
    or past :data:`MAX_PARTIAL` of them.

    Raises:
        ProtocolError: from :meth:`feed`, on a malformed or inconsistent
            stream message; the stream should then be closed.
    """

    def __init__(self, alloc: Allocator | None = None, max_message_bytes: int = 2 << 30) -> None:
        self._partial: dict[tuple[int, int], _Partial] = {}
        self._alloc = alloc
        self._max = max_message_bytes
        self._held = 0  # payload bytes of the messages in _partial

    def pending(self) -> int:
        return len(self._partial)

    def feed(self, data: bytes) -> list[InMessage]:
        """Reassemble one whole stream message (head and payload area)."""
        mv = memoryview(data)
        if len(mv) < 4:
            raise ProtocolError(
                f"stream message of {len(mv)} bytes is shorter than its length prefix"
            )
        (n,) = _LEN.unpack_from(mv, 0)
        if 4 + n > len(mv):
            raise ProtocolError(f"envelope length {n} exceeds the {len(mv) - 4} bytes received")
        frames = parse_envelope(mv[4 : 4 + n])
        pos = 4 + n
        done: list[InMessage] = []
        for f in frames:
            if m := self.whole(f, mv[pos:]):  # a small message: no bookkeeping
                pos += f.data_len
                done.append(m)
                continue
            dest = self.start_frame(f)
            if f.data_len:
                end = pos + f.data_len
                if end > len(mv):
                    raise ProtocolError(
                        f"frame of message {(f.kind, f.id)} carries {f.data_len} bytes "
                        f"but only {len(mv) - pos} follow"
                    )
                dest[:] = mv[pos:end]
                pos = end
            got = self.finish_frame(f)
            if got is not None:
                done.append(got)
        if pos != len(mv):
            raise ProtocolError(f"{len(mv) - pos} stray bytes after the last frame")
        return done

    def whole(self, f: Frame, staged: memoryview | None = None) -> InMessage | None:
        """``f`` as a message if it is a whole one with no buffers, or one
        whose buffers all arrived with it at the start of ``staged`` (most
        small calls and replies, arrays or not), skipping the bookkeeping;
        else ``None``. Its buffers are copied out of ``staged`` at once.

        Raises:
            ProtocolError: a message with its id is already being received,
                or a posted receive buffer does not fit it.
        """
        if not (f.first and f.last) or f.shm_path:
            return None
        total = f.data_len
        if total:
            sizes = f.buffer_sizes
            if staged is None or staged.nbytes < total or total > self._max or sum(sizes) != total:
                return None  # (the frame-by-frame path, which names what is wrong)
        elif f.buffer_sizes:
            return None
        if self._partial and (f.kind, f.id) in self._partial:
            raise ProtocolError(f"message {(f.kind, f.id)} started twice")
        bufs: list[memoryview] = []
        if total:
            dest = self._alloc(f.kind, f.method, total) if self._alloc else None
            if dest is None:
                dest = memoryview(bytearray(staged[:total]))  # type: ignore[index]
            elif dest.nbytes != total:
                raise ProtocolError(
                    f"posted receive buffer has {dest.nbytes} bytes, message has {total}"
                )
            else:
                dest[:] = staged[:total]  # type: ignore[index]
            off = 0
            for n in sizes:
                bufs.append(dest[off : off + n])
                off += n
        return InMessage(f.id, f.kind, f.method, f.header, bufs, f.timeout_us, meta=_meta(f))

    def start_frame(self, f: Frame) -> memoryview:
        """Account for frame ``f``; return where its ``data_len`` payload bytes go.

        Raises:
            ProtocolError: the frame is inconsistent with what came before.
        """
        key = (f.kind, f.id)
        if f.first:
            if key in self._partial:
                raise ProtocolError(f"message {key} started twice")
            sizes = list(f.buffer_sizes)
            if f.shm_path:
                if not f.last or f.data_len:
                    raise ProtocolError(f"shared-memory message {key} carries stream data")
                msg = InMessage(
                    f.id,
                    f.kind,
                    f.method,
                    f.header,
                    [],
                    f.timeout_us,
                    shm_path=f.shm_path,
                    sizes=sizes,
                    meta=_meta(f),
                )
                self._partial[key] = _Partial(msg, memoryview(b""), 0)
                return memoryview(b"")
            total = sum(sizes)
            if total > self._max:
                raise ProtocolError(
                    f"message {key} announces {total} bytes, more than the limit of "
                    f"{self._max} (RpcOptions.max_message_bytes)"
                )
            if self._held + total > 2 * self._max or len(self._partial) >= MAX_PARTIAL:
                raise ProtocolError(
                    f"message {key} of {total} bytes would take the messages being received "
                    f"at once to {len(self._partial) + 1} and {self._held + total} bytes "
                    f"(limits {MAX_PARTIAL} and {2 * self._max})"
                )
            dest = self._alloc(f.kind, f.method, total) if (self._alloc and total) else None
            if dest is None:
                try:
                    dest = _fresh(total)
                except MemoryError as e:
                    raise ProtocolError(
                        f"no memory for message {key} of {total} bytes: {e}"
                    ) from None
            elif dest.nbytes != total:
                raise ProtocolError(
                    f"posted receive buffer has {dest.nbytes} bytes, message has {total}"
                )
            bufs, off = [], 0
            for s in sizes:
                bufs.append(dest[off : off + s])
                off += s
            msg = InMessage(f.id, f.kind, f.method, f.header, bufs, f.timeout_us, meta=_meta(f))
            p = _Partial(msg, dest, total)
            self._partial[key] = p
            self._held += total
        else:
            got = self._partial.get(key)
            if got is None:
                raise ProtocolError(f"continuation frame for unknown message {key}")
            p = got
        if p.filled + f.data_len > p.total:
            raise ProtocolError(
                f"frame of message {key} carries {f.data_len} bytes beyond its payload"
            )
        start = p.filled
        p.filled += f.data_len
        return p.dest[start : p.filled]

    def finish_frame(self, f: Frame) -> InMessage | None:
        """After ``f``'s payload arrived: the whole message if ``f`` was its last frame."""
        if not f.last:
            return None
        key = (f.kind, f.id)
        p = self._partial.pop(key)
        self._held -= p.total
        if p.filled != p.total:
            raise ProtocolError(f"message {key} ended with {p.filled} of {p.total} payload bytes")
        return p.msg


def _fresh(n: int) -> memoryview:
    """A writable buffer for ``n`` received bytes.

    NumPy's allocator asks the kernel for huge pages on large blocks, so
    touching a fresh large buffer takes far fewer page faults than a
    ``bytearray``'s 4 KiB pages (docs/design.md).
    """
    if n < (1 << 20):
        return memoryview(bytearray(n))
    return memoryview(np.empty(n, dtype=np.uint8))  # type: ignore[arg-type]
