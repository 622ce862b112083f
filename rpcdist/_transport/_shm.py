"""Same-host shortcut for large payloads: buffers handed over in reused /dev/shm segments.

Each link to a worker on this host has a pool of segments (:class:`SegmentPool`,
sender side). To send a large message the sender picks a free segment big
enough (or makes one), marks it busy, copies the buffers into it (the one
copy: stores through its mapping, or ``pwritev`` for the largest) and sends
only its name. The receiver (:class:`SegmentReader`) maps a
segment the first time it is named and unlinks the file at once, so nothing
is left in /dev/shm once both sides hold it; later messages through the same
segment reuse both mappings. Arrays are decoded straight from the mapping
(no copy); when the last of them is gone the receiver marks the segment free
again in its first byte (the shared state: free, busy, retired), and the
sender may reuse it.

The sender keeps a few free segments (:data:`KEEP_FREE`); it retires the
others (marks them retired and drops its mapping; the receiver drops its own
when it next sees one). Files are 0600, created by this process's user.
Files a receiver never mapped (it died, or the message was dropped) are
unlinked by the sender when its transport stops; files of a sender killed
before it could (SIGKILL) are unlinked by the receivers it named them to,
when theirs stop.
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
import secrets
import weakref

import numpy as np

__all__ = ["SHM_DIR", "SegmentPool", "SegmentReader", "SegmentWriter", "shm_available"]

_log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
_PREFIX = "rpcdist-msg-"
#: Map every page at once instead of taking a fault per 4 KiB page on first
#: touch (Linux; measured faster for multi-megabyte payloads).
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
#: Bytes in front of the payload: byte 0 is the segment's state.
HEADER = 64
FREE, BUSY, RETIRED = 0, 1, 2
#: Free segments a pool keeps for reuse; more are retired.
KEEP_FREE = 4
#: Segment sizes are rounded up to a multiple of this (so a slightly larger
#: message still fits a segment made for an earlier one).
_GRAIN = 1 << 20
_IOV_MAX = 1024
#: Payloads up to this size are stored through the sender's mapping; larger
#: ones are written by ``pwritev`` (the kernel copies into the file's pages
#: through its own mapping). On the 2-core VM, interleaved: 16 MB 9.1 GB/s
#: stored against 5.1 written, 64 MB 5.5 against 3.0, 256 MB 2.4 against 3.5.
_STORE_MAX = 64 << 20


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class _Segment:
    __slots__ = ("__weakref__", "close_fd", "fd", "mm", "path", "size")

    def __init__(self, path: str, fd: int, mm: mmap.mmap, size: int) -> None:
        self.path, self.fd, self.mm, self.size = path, fd, mm, size
        #: Closes ``fd`` once: when the segment is retired, or when it is
        #: dropped unretired (its link's pool went away with the link).
        self.close_fd = weakref.finalize(self, os.close, fd)


class SegmentPool:
    """The segments one link sends through (see the module docstring); loop thread only."""

    def __init__(self, writer: SegmentWriter) -> None:
        self._writer = writer
        self._segments: list[_Segment] = []
        self.closed = False

    def write(self, buffers: list[memoryview]) -> tuple[str, _Segment]:
        """Copy ``buffers`` into a free segment; return its path and the segment.

        Raises:
            OSError: no segment could be made (e.g. /dev/shm full), or the pool is closed.
        """
        if self.closed:
            raise OSError("segment pool closed")
        total = sum(b.nbytes for b in buffers)
        seg = self._take(total) or self._make(total)
        seg.mm[0] = BUSY
        try:
            if total <= _STORE_MAX:  # stores through our mapping
                off = HEADER
                for b in buffers:
                    seg.mm[off : off + b.nbytes] = b
                    off += b.nbytes
            else:
                _write_all(seg.fd, [b for b in buffers if b.nbytes], HEADER)
        except BaseException:
            seg.mm[0] = FREE
            raise
        self._writer.segments_written += 1
        return seg.path, seg

    @staticmethod
    def release(seg: _Segment) -> None:
        """Mark ``seg`` free again (a message through it was dropped before it left)."""
        if not seg.mm.closed and seg.mm[0] == BUSY:
            seg.mm[0] = FREE

    def _take(self, total: int) -> _Segment | None:
        free = [s for s in self._segments if s.mm[0] == FREE]
        fits = [s for s in free if s.size >= total]
        best = min(fits, key=lambda s: s.size) if fits else None
        spare = [s for s in free if s is not best]
        for s in sorted(spare, key=lambda s: s.size)[: max(0, len(spare) - KEEP_FREE + 1)]:
            self._retire(s)
        return best

    def _make(self, total: int) -> _Segment:
        size = -(-total // _GRAIN) * _GRAIN
        path = os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, HEADER + size)
            mm = mmap.mmap(fd, HEADER + size, flags=_FLAGS)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        seg = _Segment(path, fd, mm, size)
        self._segments.append(seg)
        self._writer.note(path)
        return seg

    def _retire(self, seg: _Segment) -> None:
        self._segments.remove(seg)
        seg.mm[0] = RETIRED
        _unlink(seg.path)  # (the receiver unlinked it already if it mapped it)
        seg.mm.close()
        seg.close_fd()
        self._writer.forget(seg.path)

    def close(self) -> None:
        """Retire every segment (arrays the receiver still holds stay valid)."""
        self.closed = True
        for seg in list(self._segments):
            self._retire(seg)

    def __len__(self) -> int:
        return len(self._segments)


class SegmentWriter:
    """A transport's segment pools, one per same-host link; unlinks leftovers on cleanup."""

    def __init__(self) -> None:
        self._pools: weakref.WeakSet[SegmentPool] = weakref.WeakSet()
        self._paths: set[str] = set()
        self.segments_written = 0
        self.segments_made = 0

    def pool(self) -> SegmentPool:
        """A new pool for one link."""
        p = SegmentPool(self)
        self._pools.add(p)
        return p

    def note(self, path: str) -> None:
        """A segment file was made (unlinked on cleanup if still there)."""
        self._paths.add(path)
        self.segments_made += 1

    def forget(self, path: str) -> None:
        """A segment was retired (its file unlinked already)."""
        self._paths.discard(path)

    def cleanup(self) -> None:
        """Close every pool, unlink files that were never picked up, and those
        a peer that died (SIGKILL) left behind for us."""
        for p in list(self._pools):
            p.close()
        while self._paths:
            _unlink(self._paths.pop())
        sweep()


#: Process ids of the senders this process was named segments by (a
#: transport's cleanup unlinks what those that died left behind).
_SENDERS: set[int] = set()


class SegmentReader:
    """The receiving side of one link: the segments it has mapped, by path."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def buffers(self, path: str, sizes: list[int]) -> list[memoryview]:
        """Views of a message's buffers in segment ``path`` (mapped and unlinked on first use).

        The segment is marked free once every view (and array decoded from
        one) is gone.

        Raises:
            OSError: the file is missing or shorter than ``sizes`` say.
            ValueError: ``path`` is not a payload file of ours.
        """
        for p in [p for p, mm in self._maps.items() if mm[0] == RETIRED]:
            del self._maps[p]
        mm = self._maps.get(path)
        if mm is None:
            _SENDERS.add(_sender(path))
            mm = self._maps[path] = _map(path)
        total = sum(sizes)
        if HEADER + total > len(mm):
            raise OSError(f"payload segment {path} is shorter than the {total} bytes announced")
        lease = np.frombuffer(mm, np.uint8, total, HEADER)
        weakref.finalize(lease, _release, mm)
        view = lease.data
        out, off = [], 0
        for s in sizes:
            out.append(view[off : off + s])
            off += s
        return out

    def close(self) -> None:
        """Forget the mappings (each lasts until the arrays in it are gone)."""
        self._maps.clear()


def sweep() -> None:
    """Unlink the files of senders that are gone (killed before they could)."""
    for pid in list(_SENDERS):
        if pid == os.getpid() or _alive(pid):
            continue
        _SENDERS.discard(pid)
        for path in glob.glob(os.path.join(SHM_DIR, f"{_PREFIX}{pid}-*")):
            try:
                if os.stat(path, follow_symlinks=False).st_uid == os.getuid():
                    _unlink(path)
            except OSError:
                pass


def _sender(path: str) -> int:
    """The process id in a segment's name (``rpcdist-msg-<pid>-<random>``).

    Raises:
        ValueError: ``path`` is not a payload file of ours.
    """
    name = os.path.basename(path)
    pid = name[len(_PREFIX) :].split("-")[0]
    if os.path.dirname(path) != SHM_DIR or not name.startswith(_PREFIX) or not pid.isdigit():
        raise ValueError(f"refusing to map {path!r}: not an rpcdist payload file")
    return int(pid)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process: not ours to judge
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def _write_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Write ``buffers`` into file ``fd`` from ``offset`` on, in as few calls as it takes."""
    while buffers:
        n = os.pwritev(fd, buffers[:_IOV_MAX], offset)
        offset += n
        while buffers and n >= buffers[0].nbytes:
            n -= buffers[0].nbytes
            buffers = buffers[1:]
        if n:
            buffers = [buffers[0][n:], *buffers[1:]]


def _release(mm: mmap.mmap) -> None:
    if not mm.closed and mm[0] == BUSY:
        mm[0] = FREE


def _map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    try:
        _unlink(path)
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise ValueError(f"refusing to map {path!r}: owned by uid {st.st_uid}")
        if st.st_size <= HEADER:
            raise OSError(f"payload segment {path} is too short")
        return mmap.mmap(fd, st.st_size, flags=_FLAGS)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        _log.debug("could not unlink %s: %s", path, e)
