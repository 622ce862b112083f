"""Rank-prefixed output: the children's pipes, copied line by line to the launcher's.

One thread per worker group reads every child's stdout and stderr pipe (a
selector over all of them) and writes each complete line, prefixed, with one
write to the launcher's own stdout or stderr. Lines of different children
therefore never interleave inside a line. A partial line is held until its
newline arrives, until the child's pipe closes (a child that prints without
a newline and dies still has its text shown, with a newline added) or until
it grows past :data:`MAX_PARTIAL` bytes (then it is shown in pieces).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

__all__ = ["MAX_PARTIAL", "LineBuffer", "OutputPump", "prefix_for"]

logger = logging.getLogger(__name__)

#: A partial line longer than this is written out without waiting for its newline.
MAX_PARTIAL = 64 * 1024
_READ_SIZE = 64 * 1024


def prefix_for(rank: int) -> bytes:
    """The prefix of rank ``rank``'s lines: ``b"[rank 3] "``."""
    return f"[rank {rank}] ".encode()


class LineBuffer:
    """Splits a byte stream into lines; holds the trailing partial line."""

    def __init__(self, max_partial: int = MAX_PARTIAL) -> None:
        self._partial = bytearray()
        self._max = max_partial

    def feed(self, data: bytes) -> list[bytes]:
        """The lines completed by ``data``, each ending in ``b"\\n"``."""
        self._partial += data
        lines: list[bytes] = []
        start = 0
        while (end := self._partial.find(b"\n", start)) >= 0:
            lines.append(bytes(self._partial[start : end + 1]))
            start = end + 1
        while len(self._partial) - start > self._max:
            lines.append(bytes(self._partial[start : start + self._max]) + b"\n")
            start += self._max
        del self._partial[:start]
        return lines

    def flush(self) -> bytes | None:
        """The held partial line with a newline added, or ``None`` when there is none."""
        if not self._partial:
            return None
        line = bytes(self._partial) + b"\n"
        self._partial.clear()
        return line


def _binary_writer(stream: Any) -> Callable[[bytes], None]:
    """A function writing bytes to ``stream`` (a text stream, with or without ``.buffer``)."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:

        def write_binary(data: bytes) -> None:
            buffer.write(data)
            buffer.flush()

        return write_binary

    def write_text(data: bytes) -> None:
        stream.write(data.decode(errors="replace"))
        stream.flush()

    return write_text


class OutputPump:
    """Copies the children's pipes to the launcher's stdout/stderr, prefixed, in one thread.

    Call :meth:`add` for every pipe, then :meth:`start`; :meth:`finish` once
    the children are reaped.
    """

    def __init__(self, stdout: Any = None, stderr: Any = None) -> None:
        self._sinks = {
            "stdout": _binary_writer(sys.stdout if stdout is None else stdout),
            "stderr": _binary_writer(sys.stderr if stderr is None else stderr),
        }
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._open: dict[int, tuple[IO[bytes], bytes, LineBuffer, Callable[[bytes], None]]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rpcdist-launch-output", daemon=True)

    def add(self, pipe: IO[bytes], prefix: bytes, sink: str) -> None:
        """Copy ``pipe`` to ``sink`` (``"stdout"`` or ``"stderr"``) with ``prefix`` on each line."""
        fd = pipe.fileno()
        self._open[fd] = (pipe, prefix, LineBuffer(), self._sinks[sink])
        self._selector.register(fd, selectors.EVENT_READ, None)

    def start(self) -> None:
        """Start the copying thread."""
        self._thread.start()

    @property
    def finished(self) -> bool:
        """Whether every pipe reached its end (or :meth:`finish` gave up on it)."""
        return not self._thread.is_alive()

    def finish(self, timeout: float = 0.0) -> None:
        """Wait up to ``timeout`` s for the pipes' ends, then stop copying; idempotent.

        A pipe still open then (a grandchild holding it) is closed unread.
        """
        if self._thread.ident is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._stop = True
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")
                self._thread.join()
        else:  # never started
            self._close_all()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._selector.close()

    # -- the thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._open and not self._stop:
                for key, _ in self._selector.select():
                    fd = int(key.fd)
                    if fd == self._wake_r or self._stop:
                        continue
                    self._read(fd)
        except Exception:  # never let a copying failure pass silently
            logger.exception("copying the workers' output failed")
        finally:
            self._close_all()

    def _read(self, fd: int) -> None:
        _, prefix, lines, write = self._open[fd]
        try:
            data = os.read(fd, _READ_SIZE)
        except OSError:
            data = b""
        if not data:
            self._close(fd)
            return
        for line in lines.feed(data):
            self._write(write, prefix + line)

    def _write(self, write: Callable[[bytes], None], data: bytes) -> None:
        try:
            write(data)
        except (OSError, ValueError):  # our own stdout is gone: keep draining the pipes
            pass

    def _close(self, fd: int) -> None:
        pipe, prefix, lines, write = self._open.pop(fd)
        rest = lines.flush()
        if rest is not None:
            self._write(write, prefix + rest)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)
        pipe.close()

    def _close_all(self) -> None:
        for fd in list(self._open):
            self._close(fd)
