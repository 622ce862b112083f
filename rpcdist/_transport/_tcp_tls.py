"""TLS reads and writes of a :class:`~._tcp.TcpLink` whose socket is a
:class:`~._tls.TlsStream`.

Same staging and direct receives as the plain path, with TLS's differences:
there is no ``sendmsg``, so buffers go out one ``send`` each (256 KiB of
plaintext at most per call); ciphertext the socket did not take stays in
the stream and keeps the writer going until it is out; a receive returns at
most one TLS record, so a short one does not mean the socket is drained;
bytes TLS holds already do not make the socket readable, so they are read
before returning; and each TLS call is made under the link's write lock,
since one TLS connection must not be driven by two threads at once (the
loop reads while a pool thread may write a reply).
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Any

from .._errors import WorkerLostError
from . import _tcp
from ._tcp import DIRECT_BYTES

if TYPE_CHECKING:
    from ._tcp import TcpLink

__all__ = ["read_tls", "send_unsent_tls"]

#: Receive calls per readiness callback (one record, 16 KiB, each at most).
_READS_PER_WAKEUP = 256
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def send_unsent_tls(self: TcpLink) -> None:
    """``_send_unsent`` on TLS: until every byte, ciphertext included, is out.

    Raises:
        BlockingIOError: the socket is full.
        OSError: the connection or TLS failed.
    """
    sock: Any = self._sock
    try:
        while self._unsent:
            first = self._unsent[0]
            n = sock.send(first)
            if n >= first.nbytes:
                self._unsent.popleft()
            else:
                self._unsent[0] = first[n:]
        sock.flush()
    except ssl.SSLError as e:
        raise OSError(f"TLS: {e}") from e


def write_out_tls(self: TcpLink) -> None:
    """``_write_out`` on TLS: also while the stream holds ciphertext."""
    sock: Any = self._sock
    if not self._unsent and not self._queue and sock is not None and sock.out_pending():
        sock.flush()
    _tcp.TcpLink._write_out(self)


def read_tls(self: TcpLink) -> None:
    """:meth:`_read` on a TLS socket (same staging, TLS's exceptions).

    A receive returns at most one TLS record, so a short one does not
    mean the socket is drained; and bytes TLS has already decrypted do
    not make the socket readable, so they are read before returning.
    """
    sock: Any = self._sock
    if sock is None:
        return
    lock = self._wlock
    try:
        for _ in range(_READS_PER_WAKEUP):
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
                self.bulk_reads += 1
                self._dest = self._dest[n:]
                self._need -= n
                if not self._need:
                    self._end_frame()
                    self._process()
            else:
                self._hi += n
                self.received_any = True
                self._process()
            if self._sock is None:
                return
        if not self._threaded and sock.pending():
            self._loop.call_soon(self._on_readable)  # more is decrypted: go on soon
    except _WOULD_BLOCK:
        return
    except ssl.SSLError as e:
        self._end(WorkerLostError(f"TLS failed on the connection to {self.label}: {e}"))
    except BaseException as e:
        self._read_failed(e)
