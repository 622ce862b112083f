"""Plain-socket transport: the default data path between workers.

Same framing as the gRPC stream (``[u32 length][envelope][payload]``, see
:mod:`._frames`), carried on one TCP connection per
ordered pair of workers, driven by the loop's reader/writer callbacks:

- writes go out with ``sendmsg`` straight from the senders' buffers (no join,
  no copy into a transport buffer); a full socket parks the rest until the
  loop reports it writable;
- reads land in a small staging buffer, except the bulk of a large payload,
  which is received straight into its destination (a fresh array, or a
  buffer a collective posted in advance).

Against grpc.aio this removes grpc's per-message cost in loop time and two
of its three payload copies (docs/benchmarks.md has the figures). The job token is checked in a hello exchanged before
any frame. With TLS the socket is a :class:`~._tls.TlsStream` (the record
layer, which moves ciphertext) and the link reads and writes through it with
TLS's differences (:meth:`TcpLink._read_tls`, ``TlsStream.send_queued``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .._errors import ProtocolError, RpcdistError, WorkerLostError
from .._options import RpcOptions
from ._base import Hooks, Link
from ._frames import Frame, OutMessage, pack_batch_parts, parse_envelope
from ._shm import SegmentWriter

__all__ = ["DIRECT_BYTES", "MAGIC", "TcpLink"]

_log = logging.getLogger(__name__)

MAGIC = b"RPCDIST1"
_LEN = struct.Struct("<I")
#: Staging buffer for headers and small payloads.
_STAGE_BYTES = 256 << 10
#: Payload remainders at least this large are received straight into place.
DIRECT_BYTES = 64 << 10
#: Payload parts smaller than this in total are joined into one write.
_JOIN_BYTES = 64 << 10
#: Most buffers handed to one ``sendmsg`` (Linux IOV_MAX is 1024).
_MAX_IOV = 512
#: Largest envelope accepted: headers are coalesced up to ``batch_bytes``,
#: but one header (inline non-array data) may be large on its own.
_MAX_ENVELOPE = (1 << 31) - 1
_HELLO_MAX = 64 << 10
_HANDSHAKE_TIMEOUT = 30.0
#: Receive calls per readiness callback before yielding to other work.
_READS_PER_WAKEUP = 16
#: TLS receive calls per readiness callback (one record, 16 KiB, each at most).
_TLS_READS_PER_WAKEUP = 256
_TLS_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)

#: ``poll`` takes a C int of milliseconds.
_POLL_MAX_MS = (1 << 31) - 1


#: Send buffer asked for on Unix sockets (the kernel caps it at
#: ``net.core.wmem_max``); the default ~208 KiB makes a bulk transfer take
#: many more loop wake-ups than loopback TCP's auto-tuned buffers.
_UNIX_SNDBUF = 4 << 20


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _UNIX_SNDBUF)
        return
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # A peer whose host vanished (no FIN, no RST) is noticed in ~20 s, like
    # the gRPC keepalive settings.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2)):
        opt = getattr(socket, name, None)
        if opt is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)


class TcpLink(Link):
    """One end of a peer socket. Create it before the socket exists (calls
    queue up), then :meth:`attach` the socket and :meth:`run` it."""

    CALLS_AFTER_READ = True

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        peer_rank: int,
        label: str,
        hooks: Hooks,
        options: RpcOptions,
        segments: SegmentWriter | None = None,
    ) -> None:
        super().__init__(
            peer_rank=peer_rank, label=label, hooks=hooks, options=options, segments=segments
        )
        self._loop = loop
        #: The socket, or a ``_tls.TlsStream`` over it (the same interface).
        self._sock: Any = None
        self._fd = -1
        self._ended: asyncio.Future[None] = loop.create_future()
        # Writer: bytes of the current batch still to send, and what to call
        # once they are all out.
        self._flush_scheduled = False
        self._parked = False
        self._unsent: deque[memoryview] = deque()
        self._after_sent: list[Callable[[], None]] = []
        self._write_shut = False
        #: Guards the socket's write side and the writer state above: the
        #: loop writes, and so may a pool thread (:meth:`try_send_now`).
        self._wlock = threading.Lock()
        # Reader: staging buffer [lo, hi), the envelope being worked through,
        # and the payload bytes still owed to the current frame.
        self._stage = bytearray(_STAGE_BYTES)
        self._view = memoryview(self._stage)
        self._lo = self._hi = 0
        self._frames: list[Frame] = []
        self._frame_index = self._need = 0
        self._dest = memoryview(b"")
        #: Largest envelope accepted (headers count towards a message's size).
        self._max_envelope = min(_MAX_ENVELOPE, options.max_message_bytes + (1 << 20))
        self._tls = False
        #: Driven by the thread making a blocking call (:meth:`send_blocking`,
        #: :meth:`read_blocking`) instead of by the loop.
        self._threaded = False
        self._poll: Any = None

    # ------------------------------------------------------------ lifecycle

    def attach(self, sock: socket.socket, *, threaded: bool = False) -> None:
        """Take over a connected, handshaken socket and start moving bytes.

        With ``threaded``, the loop never touches it: one thread at a time
        drives it with :meth:`send_blocking` and :meth:`read_blocking`, until
        :meth:`hand_to_loop` (on the loop) gives it to the loop.
        """
        _tune(sock)
        self._sock = sock
        self._fd = sock.fileno()
        self._threaded = threaded
        if not isinstance(sock, socket.socket):  # a _tls.TlsStream
            self._tls = True
            self._read = self._read_tls  # type: ignore[method-assign]
            self._send_unsent = self._send_unsent_tls  # type: ignore[method-assign]
            self._write_out = self._write_out_tls  # type: ignore[method-assign]
        if threaded:
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)
            return
        self._loop.add_reader(self._fd, self._on_readable)
        if self._queue or self._unsent:
            self._kick()

    def hand_to_loop(self) -> None:
        """On the loop: the loop drives a threaded connection from now on."""
        self._threaded = False
        if self._sock is None or self.closed is not None:
            self._end(self.closed)
            return
        self._loop.add_reader(self._fd, self._on_readable)

    async def run(self) -> None:
        """Serve the socket until the peer closes it or it fails.

        Raises:
            RpcdistError: why it ended, unless the peer closed it cleanly.
        """
        try:
            await asyncio.shield(self._ended)
        finally:
            self._detach()

    def close_write(self) -> None:
        """Half-close our side once everything queued is out (the peer sees EOF)."""
        self._write_shut = True
        if self._sock is not None and not self._queue and not self._unsent:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)

    def abort(self, exc: RpcdistError) -> None:
        """End the link now with ``exc`` (on the loop); threaded: wake its thread."""
        if self._threaded:
            if self.closed is None:
                self.closed = exc
            self.interrupt()
            return
        for msg in self._queue:
            msg.dropped()
        self._queue.clear()
        self._end(exc)

    def _end(self, exc: RpcdistError | None) -> None:
        if self._threaded:  # its thread sees ``closed`` and lets the socket go
            if self.closed is None:
                self.closed = exc or WorkerLostError(f"{self.label} closed the connection")
            return
        if not self._ended.done():
            if exc is None:
                self._ended.set_result(None)
            else:
                self._ended.set_exception(exc)
                # Retrieved by run(); do not log "never retrieved" if cancelled.
                self._ended.exception()
        if self.closed is None:
            self.closed = exc or WorkerLostError(f"{self.label} closed the connection")
        self._detach()

    def _detach(self) -> None:
        with self._wlock:
            sock, self._sock = self._sock, None
        if sock is None:
            return
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
        if self._parked:
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self._fd)
            self._parked = False
        with self._wlock:
            sock.close()
            self._unsent.clear()
            self._after_sent.clear()

    # --------------------------------------------------------------- writing

    def _kick(self) -> None:
        # Deferred by one loop turn so that everything queued in this turn
        # goes out in one write.
        with self._wlock:
            if self._flush_scheduled or self._parked or self._sock is None:
                return
            self._flush_scheduled = True
        self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        with self._wlock:
            self._flush_scheduled = False
            if self._sock is None:
                return
            try:
                self._write_out()
            except (BlockingIOError, InterruptedError):
                if not self._parked:
                    self._parked = True
                    self._loop.add_writer(self._fd, self._on_writable)
                return
            except OSError as e:
                error: OSError | None = e
            else:
                error = None
        if error is not None:
            self._end(WorkerLostError(f"lost the connection to {self.label}: {error}"))
        elif self._write_shut:
            self.close_write()

    def _write_out(self) -> None:
        """Send queued batches until done or the socket is full (holding ``_wlock``).

        Raises:
            BlockingIOError: the socket is full; the rest waits in ``_unsent``.
            OSError: the socket failed.
        """
        assert self._sock is not None
        while True:
            if not self._unsent:
                if not self._queue:
                    return
                head, parts, packed = pack_batch_parts(
                    self._queue, self._batch_bytes, self._chunk_bytes, _MAX_IOV - 1
                )
                self._add_unsent(head, parts)
                self._after_sent = packed
            self._send_unsent()
            done, self._after_sent = self._after_sent, []
            for cb in done:  # the senders' bytes are in the kernel now
                cb()

    def _send_unsent(self) -> None:
        """Write ``_unsent`` until it is empty (holding ``_wlock``).

        Raises:
            BlockingIOError: the socket is full; the rest stays in ``_unsent``.
            OSError: the socket failed.
        """
        assert self._sock is not None
        while self._unsent:
            n = self._sock.sendmsg(list(self._unsent))
            while n:
                first = self._unsent[0]
                if n >= first.nbytes:
                    n -= first.nbytes
                    self._unsent.popleft()
                else:
                    self._unsent[0] = first[n:]
                    n = 0

    def try_send_now(self, msg: OutMessage, before: Callable[[], None] | None = None) -> bool:
        """Send ``msg`` from any thread, at once, if nothing is queued before it.

        Saves the hop to the loop for a call a user thread made or a reply a
        pool thread produced (``msg`` must have no ``on_packed`` callback).
        A payload for /dev/shm is copied into its segment here, on the
        sending thread, either way. Returns False, having sent nothing, when
        the link is busy, not up or closed: the caller then queues ``msg`` on
        the loop as usual. Once
        True, the message is the connection's: whatever the socket did not
        take at once is finished by the loop. ``before`` runs just before the
        first byte is written, only if it will be.
        """
        self.to_segment(msg)
        with self._wlock:
            if (
                self._sock is None
                or self.closed is not None
                or self._parked
                or self._flush_scheduled
                or self._unsent
                or self._queue
            ):
                return False
            self._stage_whole(msg)
            if before is not None:
                before()
            try:
                self._send_unsent()
                return True
            except OSError:  # full (or failed): the loop parks the rest (or reports it)
                self._flush_scheduled = True
        self._loop.call_soon_threadsafe(self._flush)
        return True

    def _stage_whole(self, msg: OutMessage) -> None:
        """Pack all of ``msg`` into ``_unsent`` (holding ``_wlock``; for the
        messages written straight from a thread)."""
        queue = deque([msg])
        while queue:
            head, parts, _ = pack_batch_parts(queue, self._batch_bytes, 1 << 62, _MAX_IOV - 1)
            self._add_unsent(head, parts)

    def _add_unsent(self, head: bytes, parts: list[memoryview]) -> None:
        """One stream message into ``_unsent``: small, joined; large, as views."""
        self.messages_out += 1
        if sum(p.nbytes for p in parts) < _JOIN_BYTES:
            self._unsent.append(memoryview(b"".join([head, *parts])))
        else:
            self._unsent.append(memoryview(head))
            self._unsent.extend(parts)

    def _on_writable(self) -> None:
        with self._wlock:
            self._parked = False
        self._loop.remove_writer(self._fd)
        self._flush()

    # ------------------------------------------------- driven by one thread

    def send_blocking(self, msg: OutMessage, deadline: float | None) -> bool:
        """Threaded mode: write all of ``msg`` (no ``on_packed``; a large
        payload to a peer on this host goes into a /dev/shm segment first),
        waiting for room until ``deadline`` (``time.monotonic()``).

        Returns False if the deadline passed first; the stream then ends
        mid-message and must be closed.

        Raises:
            OSError: the socket failed.
        """
        self.to_segment(msg)
        with self._wlock:
            self._stage_whole(msg)
            while True:
                if self._sock is None:
                    raise OSError(f"the connection to {self.label} was closed")
                try:
                    self._send_unsent()
                    return True
                except (BlockingIOError, InterruptedError):
                    pass
                p = select.poll()
                p.register(self._fd, select.POLLOUT)
                ms = _poll_ms(deadline)
                if ms == 0 or not p.poll(ms):
                    self._unsent.clear()
                    return False

    def read_blocking(self, deadline: float | None) -> bool:
        """Threaded mode: wait until bytes arrive (or ``deadline`` passes),
        then read and deliver what is there; ``closed`` is set if it ended.

        Returns False if the deadline passed first.
        """
        if self._tls and self._sock is not None and self._sock.pending():  # type: ignore[attr-defined]
            self._read()  # decrypted bytes wait inside TLS, not in the socket
            return True
        ms = _poll_ms(deadline)
        if ms == 0 or not self._poll.poll(ms):
            return False
        self._read()
        return True

    def readable(self) -> bool:
        """Threaded mode: whether bytes (or the end) wait to be read; never blocks."""
        pending = self._tls and self._sock is not None and self._sock.pending()  # type: ignore[attr-defined]
        return bool(pending) or bool(self._poll.poll(0))

    def idle_ok(self) -> bool:
        """Threaded mode, between calls: open, and nothing (EOF) waiting in it."""
        return self._sock is not None and self.closed is None and not self._poll.poll(0)

    def interrupt(self) -> None:
        """From any thread: wake a thread blocked in :meth:`read_blocking` (it sees EOF)."""
        with self._wlock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def close_threaded(self) -> None:
        """Threaded mode: close the socket (its thread is done with it).

        If the loop is writing to it (a reply too large for one ``sendmsg``),
        the loop closes it, after letting go of its writer registration.
        """
        if self.closed is None:
            self.closed = WorkerLostError(f"the connection to {self.label} was closed")
        with self._wlock:
            if self._parked or self._flush_scheduled:
                try:
                    self._loop.call_soon_threadsafe(self._detach)
                    return
                except RuntimeError:  # the loop is gone, and its registrations
                    pass
            sock, self._sock = self._sock, None
            self._unsent.clear()
        if sock is not None:
            sock.close()

    # --------------------------------------------------------------- reading

    def _on_readable(self) -> None:
        try:
            self._read()
        finally:
            if self.after_read is not None:
                self.after_read()

    def _read(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            for _ in range(_READS_PER_WAKEUP):
                if self._need >= DIRECT_BYTES and self._lo == self._hi:
                    want = self._need
                    n = sock.recv_into(self._dest, want)
                    if n == 0:
                        return self._eof()
                    self._received_direct(n)
                    if n < want:
                        return  # drained: the next bytes wake us again
                    continue
                if self._lo == self._hi:
                    self._lo = self._hi = 0
                elif self._hi == len(self._stage):
                    self._compact()
                want = len(self._stage) - self._hi
                n = sock.recv_into(self._view[self._hi :])
                if n == 0:
                    return self._eof()
                self._hi += n
                self.received_any = True
                self._process()
                if n < want:
                    # Drained: skip the read that would only say EAGAIN (the
                    # socket is level-triggered, so new bytes wake us again).
                    return
        except (BlockingIOError, InterruptedError):
            return
        except BaseException as e:
            self._read_failed(e)

    # ----------------------------------------------------------- TLS

    def _send_unsent_tls(self) -> None:
        """:meth:`_send_unsent` on TLS (``TlsStream.send_queued``)."""
        self._sock.send_queued(self._unsent)

    def _write_out_tls(self) -> None:
        """:meth:`_write_out` on TLS: also while the stream holds ciphertext."""
        sock: Any = self._sock
        if not self._unsent and not self._queue and sock is not None and sock.out_pending():
            sock.flush()
        TcpLink._write_out(self)

    def _read_tls(self) -> None:
        """:meth:`_read` on a TLS socket (same staging, TLS's exceptions).

        A receive returns at most one TLS record, so a short one does not
        mean the socket is drained; bytes TLS has already decrypted do not
        make the socket readable, so they are read before returning; and
        each TLS call is made under the write lock, since one TLS connection
        must not be driven by two threads at once (the loop reads while a
        pool thread may write a reply).
        """
        sock: Any = self._sock
        if sock is None:
            return
        lock = self._wlock
        try:
            for _ in range(_TLS_READS_PER_WAKEUP):
                direct = self._need >= DIRECT_BYTES and self._lo == self._hi
                if not direct:
                    if self._lo == self._hi:
                        self._lo = self._hi = 0
                    elif self._hi == len(self._stage):
                        self._compact()
                with lock:
                    if direct:
                        n = sock.recv_into(self._dest, self._need)
                    else:
                        n = sock.recv_into(self._view[self._hi :])
                if n == 0:
                    return self._eof()
                if direct:
                    self._received_direct(n)
                else:
                    self._hi += n
                    self.received_any = True
                    self._process()
                if self._sock is None:
                    return
            if not self._threaded and sock.pending():
                self._loop.call_soon(self._on_readable)  # more is decrypted: go on soon
        except _TLS_WOULD_BLOCK:
            return
        except ssl.SSLError as e:
            self._end(WorkerLostError(f"TLS failed on the connection to {self.label}: {e}"))
        except BaseException as e:
            self._read_failed(e)

    def _received_direct(self, n: int) -> None:
        """``n`` bytes of the current payload landed in its destination."""
        self.bulk_reads += 1
        self._dest = self._dest[n:]
        self._need -= n
        if not self._need:
            self._end_frame()
            self._process()

    def _read_failed(self, e: BaseException) -> None:
        if isinstance(e, RpcdistError):
            _log.warning("closing connection from %s: %s", self.label, e)
            self._end(e)
        elif isinstance(e, OSError):
            self._end(WorkerLostError(f"lost the connection to {self.label}: {e}"))
        elif isinstance(e, MemoryError):
            _log.warning("closing connection from %s: out of memory: %s", self.label, e)
            self._end(ProtocolError(f"out of memory reading from {self.label}: {e}"))
        elif isinstance(e, Exception):  # a bug in a message handler: fail this link, loudly
            _log.exception("error handling a message from %s", self.label)
            self._end(ProtocolError(f"error handling a message from {self.label}: {e!r}"))
        else:
            raise e

    def _eof(self) -> None:
        if self._lo != self._hi or self._need or self._frame_index < len(self._frames):
            self._end(WorkerLostError(f"{self.label} closed the connection mid-message"))
        else:
            self._end(None)

    def _compact(self) -> None:
        n = self._hi - self._lo
        self._stage[0:n] = self._view[self._lo : self._hi]
        self._lo, self._hi = 0, n

    def _process(self) -> None:
        """Work through whatever the staging buffer holds."""
        while True:
            if self._need:
                k = min(self._hi - self._lo, self._need)
                if k == 0:
                    return
                self._dest[:k] = self._view[self._lo : self._lo + k]
                self._dest = self._dest[k:]
                self._lo += k
                self._need -= k
                if self._need:
                    return
                self._end_frame()
                continue
            if self._frame_index < len(self._frames):
                f = self._frames[self._frame_index]
                staged = self._view[self._lo : self._hi]
                if m := self._reasm.whole(f, staged):  # a small message: no bookkeeping
                    self._lo += f.data_len
                    self._frame_index += 1
                    if self._frame_index == len(self._frames):
                        self._frames, self._frame_index = [], 0
                    self._deliver(m)
                    continue
                self._dest = self._reasm.start_frame(f)
                self._need = f.data_len
                if not self._need:
                    self._end_frame()
                continue
            avail = self._hi - self._lo
            if avail < 4:
                return
            (n,) = _LEN.unpack_from(self._stage, self._lo)
            if n > self._max_envelope:
                raise ProtocolError(
                    f"envelope of {n} bytes from {self.label} is larger than the limit of "
                    f"{self._max_envelope} (RpcOptions.max_message_bytes)"
                )
            if avail < 4 + n:
                # One large header: grow towards it as its bytes arrive (so a
                # bogus length costs nothing until the bytes are really sent).
                if 4 + n > len(self._stage) and 2 * avail >= len(self._stage):
                    stage = bytearray(min(4 + n, 2 * len(self._stage)))
                    stage[:avail] = self._view[self._lo : self._hi]
                    self._stage, self._view = stage, memoryview(stage)
                    self._lo, self._hi = 0, avail
                return
            frames = parse_envelope(self._view[self._lo + 4 : self._lo + 4 + n])
            self._lo += 4 + n
            self.messages_in += 1
            if len(self._stage) > _STAGE_BYTES and self._lo == self._hi:
                self._stage = bytearray(_STAGE_BYTES)
                self._view = memoryview(self._stage)
                self._lo = self._hi = 0
            staged = self._view[self._lo : self._hi]  # (a whole message's buffers are copied)
            if len(frames) == 1 and (m := self._reasm.whole(frames[0], staged)):
                self._lo += frames[0].data_len
                self._deliver(m)  # one small message: the common case at low load
                continue
            self._frames = frames
            self._frame_index = 0

    def _end_frame(self) -> None:
        f = self._frames[self._frame_index]
        self._frame_index += 1
        if self._frame_index == len(self._frames):
            self._frames, self._frame_index = [], 0
        m = self._reasm.finish_frame(f)
        if m is not None:
            self._deliver(m)


def _poll_ms(deadline: float | None) -> int | None:
    """``poll``'s timeout until ``deadline`` (``None``: no limit; 0: passed)."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    return min(math.ceil(left * 1000), _POLL_MAX_MS) if left > 0 else 0
