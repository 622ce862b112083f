"""What every peer connection shares, whichever transport carries its bytes.

A connection queues outgoing messages (moving large same-host payloads into
/dev/shm first), counts traffic, and hands reassembled incoming messages to
the agent. Subclasses move the bytes: :mod:`._grpc` over a gRPC stream,
:mod:`._tcp` over a plain socket. All of it runs on the agent's loop.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from .._errors import RpcdistError
from .._options import RpcOptions
from ._frames import P2P, Allocator, InMessage, OutMessage, Reassembler
from ._shm import SegmentWriter, map_segment

__all__ = ["BaseConnection", "OnMessage"]

_log = logging.getLogger(__name__)

OnMessage = Callable[["BaseConnection", InMessage], None]


class BaseConnection:
    """One end of a peer link: an outgoing queue and an incoming reassembler."""

    def __init__(
        self,
        *,
        peer_rank: int,
        label: str,
        on_message: OnMessage,
        options: RpcOptions,
        alloc: Allocator | None = None,
        segments: SegmentWriter | None = None,
        after_read: Callable[[], None] | None = None,
    ) -> None:
        self.peer_rank = peer_rank
        #: Called at the end of each read callback, after the messages read in
        #: it were delivered (``None``: this transport does not call it).
        self.after_read = after_read
        self.label = label
        #: Set for a peer on this host: large payloads then go through /dev/shm.
        self._segments = segments
        self._shm_threshold = options.payload_shm_threshold or 0
        self._on_message = on_message
        self._batch_bytes = options.batch_bytes
        self._chunk_bytes = options.chunk_bytes
        self._queue: deque[OutMessage] = deque()
        self._reasm = Reassembler(alloc)
        #: Why the connection ended (set once; later sends raise it).
        self.closed: RpcdistError | None = None
        self.received_any = False
        self.messages_out = 0
        self.messages_in = 0

    def send(self, msg: OutMessage) -> None:
        """Queue ``msg``; call on the loop thread.

        Raises:
            RpcdistError: the connection is already closed (the reason).
        """
        if self.closed is not None:
            raise self.closed
        if (
            self._segments is not None
            and msg.kind != P2P
            and not msg.shm_path
            and msg.payload_bytes >= self._shm_threshold
        ):
            try:
                msg.shm_path = self._segments.write(msg.buffers)
            except OSError as e:  # /dev/shm full or unavailable: use the stream
                _log.debug(
                    "shared-memory payload for %s failed, using the stream: %s", self.label, e
                )
        self._queue.append(msg)
        self._kick()

    def _kick(self) -> None:
        """Start moving queued messages (the subclass's writer)."""
        raise NotImplementedError

    def try_send_now(self, msg: OutMessage, before: Callable[[], None] | None = None) -> bool:
        """Send ``msg`` at once from any thread, if the transport can; False if not.

        This transport cannot: everything goes through the loop.
        """
        return False

    def queued(self) -> int:
        return len(self._queue)

    def _deliver(self, m: InMessage) -> None:
        if m.shm_path:
            try:
                m.buffers = map_segment(m.shm_path, m.sizes)
            except (OSError, ValueError) as e:
                _log.warning("dropping message %d from %s: %s", m.id, self.label, e)
                return
        self._on_message(self, m)
