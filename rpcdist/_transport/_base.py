"""The transport interface: what the agent needs from a way of moving frames.

A :class:`Transport` serves one agent: it listens (:meth:`Transport.serve`),
opens a :class:`Link` to a peer (:meth:`Transport.link`) and stops. A link is
one end of a peer connection: it queues outgoing :class:`OutMessage` objects
and hands reassembled incoming :class:`InMessage` objects to ``on_message``.
Implementations: plain sockets (:mod:`._tcp`, the default), gRPC streams
(:mod:`._grpc`) and an in-memory transport for tests (:mod:`._inproc`);
fault injection (:mod:`._faulty`) wraps any of them. Everything runs on the
agent's loop unless a method says otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import RpcdistError
from .._options import RpcOptions
from ._frames import Allocator, InMessage, OutMessage, Reassembler
from ._shm import SegmentPool, SegmentReader, SegmentWriter, shm_available

__all__ = [
    "Accept",
    "Hooks",
    "Link",
    "LinkFactory",
    "OnMessage",
    "Peer",
    "Transport",
    "TransportBase",
    "Validate",
    "segment_writer",
]

_log = logging.getLogger(__name__)

OnMessage = Callable[["Link", InMessage], None]


@dataclass(frozen=True, slots=True)
class Hooks:
    """What a link calls back into.

    Attributes:
        on_message: Called with each whole incoming message (on the loop, or
            on the thread driving a threaded link).
        alloc: Where an incoming message's payload lands (a posted receive),
            else ``None`` for a fresh buffer.
        after_read: Called at the end of each read callback, after the
            messages read in it were delivered (transports that batch reads).
    """

    on_message: OnMessage
    alloc: Allocator | None = None
    after_read: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class Peer:
    """A peer as the transport dials it.

    Attributes:
        rank: Its rank.
        label: How messages name it (``worker 'w1' at host:port``).
        info: What its transport published at rendezvous (address, ...).
        same_host: Whether it runs on this host (same hostname, boot id, /dev/shm and pid namespace).
    """

    rank: int
    label: str
    info: Mapping[str, Any]
    same_host: bool


class Link:
    """One end of a peer connection: an outgoing queue and an incoming reassembler."""

    #: Whether this transport calls ``after_read`` at the end of each read
    #: callback (else callers must not wait for it: it stays ``None``).
    CALLS_AFTER_READ = False

    def __init__(
        self,
        *,
        peer_rank: int,
        label: str,
        hooks: Hooks,
        options: RpcOptions,
        segments: SegmentWriter | None = None,
    ) -> None:
        self.peer_rank = peer_rank
        self.label = label
        self.after_read = hooks.after_read if self.CALLS_AFTER_READ else None
        #: Set for a peer on this host: large payloads then go through /dev/shm
        #: segments of this link's pool (see :mod:`._shm`).
        self._segments: SegmentPool | None = segments.pool() if segments is not None else None
        self._shm_reader: SegmentReader | None = None
        self._shm_threshold = options.payload_shm_threshold or 0
        self._on_message = hooks.on_message
        self._batch_bytes = options.batch_bytes
        self._chunk_bytes = options.chunk_bytes
        self._queue: deque[OutMessage] = deque()
        self._reasm = Reassembler(hooks.alloc, options.max_message_bytes)
        #: Why the link ended (set once; later sends raise it).
        self.closed: RpcdistError | None = None
        self.received_any = False
        self.messages_out = 0
        self.messages_in = 0
        #: Receives into large payloads (progress the failure detector sees
        #: while one long message arrives, between envelopes).
        self.bulk_reads = 0

    def rebind(self, hooks: Hooks) -> None:
        """Deliver to other callbacks from now on (a link changing hands)."""
        self._on_message = hooks.on_message
        self.after_read = hooks.after_read if self.CALLS_AFTER_READ else None

    def send(self, msg: OutMessage) -> None:
        """Queue ``msg``; call on the loop thread.

        Raises:
            RpcdistError: the link is already closed (the reason).
        """
        if self.closed is not None:
            raise self.closed
        self.to_segment(msg)
        self._queue.append(msg)
        self._kick()

    def wants_shm(self, msg: OutMessage) -> bool:
        """Whether ``msg``'s payload should travel in a /dev/shm segment."""
        if self._segments is None or not msg.buffers or msg.shm_path:
            return False  # (most calls: no out-of-band buffers, nothing to add up)
        return msg.payload_bytes >= self._shm_threshold

    def to_segment(self, msg: OutMessage) -> None:
        """Copy ``msg``'s payload into a /dev/shm segment if it should travel
        in one (any thread: the copy is done by whoever sends)."""
        if not self.wants_shm(msg):
            return
        assert self._segments is not None
        try:
            msg.shm_path, seg = self._segments.write(msg.buffers)
        except OSError as e:  # /dev/shm full or unavailable: use the stream
            _log.debug("shared-memory payload for %s failed, using the stream: %s", self.label, e)
        else:
            msg.undo = _also_release(msg.undo, seg)

    def _kick(self) -> None:
        """Start moving queued messages (the subclass's writer)."""
        raise NotImplementedError

    def try_send_now(self, msg: OutMessage, before: Callable[[], None] | None = None) -> bool:
        """Send ``msg`` at once from any thread, if the transport can; False if not.

        ``before`` runs just before the message leaves, only if it will.
        This base cannot: everything goes through the loop.
        """
        return False

    def close_write(self) -> None:
        """Half-close: the peer sees the end once everything queued is out."""

    def abort(self, exc: RpcdistError) -> None:
        """End the link at once with ``exc`` (on the loop): :meth:`run` raises it
        and queued messages are dropped (the peer was declared lost)."""
        raise NotImplementedError

    async def aclose_write(self) -> None:
        """:meth:`close_write`, returning once the transport has done it."""
        self.close_write()

    async def run(self) -> None:
        """Move bytes until the link ends.

        Raises:
            RpcdistError: why it ended, unless the peer closed it cleanly.
        """
        raise NotImplementedError

    def queued(self) -> int:
        return len(self._queue)

    def _deliver(self, m: InMessage) -> None:
        if m.shm_path:
            if self._shm_reader is None:
                self._shm_reader = SegmentReader()
            try:
                m.buffers = self._shm_reader.buffers(m.shm_path, m.sizes)
            except (OSError, ValueError) as e:
                _log.warning("dropping message %d from %s: %s", m.id, self.label, e)
                return
        self._on_message(self, m)


def _also_release(undo: Callable[[], None] | None, seg: Any) -> Callable[[], None]:
    """``undo`` that also frees the segment of a message that will never leave."""

    def both() -> None:
        SegmentPool.release(seg)
        if undo is not None:
            undo()

    return both


#: ``validate(rank, name) -> None`` or the reason a peer is refused.
Validate = Callable[[int, str], "str | None"]
#: ``make(hooks, *, threaded=False, same_host=False) -> Link`` for an accepted
#: connection (``threaded``: for one thread to drive, see ``TcpLink``;
#: ``same_host``: the peer runs on this host).
LinkFactory = Callable[..., Link]
#: ``accept(rank, name, sync, make)``: a peer connected and passed the
#: handshake; ``sync``: it will make one blocking call at a time on it.
Accept = Callable[[int, str, bool, LinkFactory], Awaitable[None]]


class Transport(Protocol):
    """How one agent moves frames (see the module docstring)."""

    #: ``"tcp"``, ``"grpc"`` or ``"inproc"``; every worker of a job needs the same.
    name: str

    async def serve(self, validate: Validate, accept: Accept) -> dict[str, Any]:
        """Start listening; return what peers need to dial us (published at rendezvous).

        Raises:
            ConnectError: the address cannot be bound.
        """

    def link(self, peer: Peer, hooks: Hooks) -> tuple[Link, Awaitable[None]]:
        """A link to ``peer`` that queues at once, and the coroutine that
        dials it and then runs it until it ends (run it as a task).

        The coroutine raises ``ConnectError`` if the peer cannot be reached
        or refuses us, and what :meth:`Link.run` raises after that.
        """

    async def stop(self, grace: float) -> None:
        """Stop listening and end what :meth:`serve` handed out."""

    def rename(self, name: str) -> None:
        """This worker's name changed (it is presented to every peer it dials)."""

    def set_token(self, token: str) -> None:
        """Present and require ``token`` from now on (the job secret)."""


class TransportBase:
    """What every transport keeps: its loop, options and this worker's identity."""

    name = ""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, options: RpcOptions, *, rank: int, name: str
    ) -> None:
        self._loop = loop
        self._options = options
        self._rank = rank
        self._name = name
        self._validate: Validate | None = None
        self._accept: Accept | None = None

    def rename(self, name: str) -> None:
        """This worker's name changed (it is presented to every peer it dials)."""
        self._name = name

    def set_token(self, token: str) -> None:
        """Present and require ``token`` from now on (the job secret made at
        rendezvous when the user set none)."""
        self._options = dataclasses.replace(self._options, token=token)


def segment_writer(options: RpcOptions) -> SegmentWriter | None:
    """The /dev/shm payload writer a transport uses for same-host peers, if any."""
    if options.payload_shm_threshold and shm_available():
        return SegmentWriter()
    return None
