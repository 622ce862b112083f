"""Same-host shortcut for large payloads: buffers handed over in /dev/shm files.

The sender copies a message's buffers into a fresh file under /dev/shm (one
copy) and sends only its name; the receiver maps the file, unlinks it at once
(so nothing is left behind once it is mapped) and decodes arrays straight
from the mapping (no copy). The memory is freed when the last array using it
goes away. Files a receiver never mapped (it died, or the message was
dropped) are unlinked by the sender when its agent closes.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from collections import deque

__all__ = ["SHM_DIR", "SegmentWriter", "map_segment", "shm_available"]

_log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
_PREFIX = "rpcdist-msg-"
#: Map every page at once instead of taking a fault per 4 KiB page on first
#: touch (Linux; measured faster for multi-megabyte payloads).
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class SegmentWriter:
    """Writes payloads into /dev/shm files; remembers recent ones for cleanup."""

    def __init__(self, remember: int = 4096) -> None:
        self._recent: deque[str] = deque(maxlen=remember)
        self.segments_written = 0

    def write(self, buffers: list[memoryview]) -> str:
        """Copy ``buffers`` into a new file and return its path.

        Raises:
            OSError: the file could not be created or filled (e.g. /dev/shm full).
        """
        total = sum(b.nbytes for b in buffers)
        path = os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, total)
            with mmap.mmap(fd, total, flags=_FLAGS) as mm:
                off = 0
                for b in buffers:
                    mm[off : off + b.nbytes] = b
                    off += b.nbytes
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        self._recent.append(path)
        self.segments_written += 1
        return path

    def cleanup(self) -> None:
        """Unlink files that were never picked up."""
        while self._recent:
            _unlink(self._recent.popleft())


def map_segment(path: str, sizes: list[int]) -> list[memoryview]:
    """Map and unlink the file at ``path``; return writable views of its buffers.

    Raises:
        OSError: the file is missing or shorter than ``sizes`` say.
        ValueError: ``path`` is not a payload file of ours.
    """
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(_PREFIX):
        raise ValueError(f"refusing to map {path!r}: not an rpcdist payload file")
    total = sum(sizes)
    fd = os.open(path, os.O_RDWR)
    try:
        _unlink(path)
        if os.fstat(fd).st_size < total:
            raise OSError(f"payload file {path} is shorter than the {total} bytes announced")
        mm = mmap.mmap(fd, total, flags=_FLAGS)
    finally:
        os.close(fd)
    view = memoryview(mm)
    out, off = [], 0
    for s in sizes:
        out.append(view[off : off + s])
        off += s
    return out


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        _log.debug("could not unlink %s: %s", path, e)
