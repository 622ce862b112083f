"""Same-host shortcut for large payloads: buffers handed over in reused /dev/shm segments.

Each link to a worker on this host has a pool of segments (:class:`SegmentPool`,
sender side). To send a large message the sender picks a free segment big
enough (or makes one), marks it busy, copies the buffers into it (the one
copy, stores through its mapping; any thread may send) and sends only its
name. The segment starts with a small table of where each buffer lies: a
large buffer is placed at the same offset within a 4 KiB page as its
source, since memcpy of a large block runs at a third of its speed when
the destination sits a few cache lines past the source's page offset
(glibc's copy on this kind of machine, measured in docs/benchmarks.md).
The receiver (:class:`SegmentReader`) maps a segment the first time it is
named and unlinks the file at once, so nothing is left in /dev/shm once
both sides hold it; later messages through the same segment reuse both
mappings. Arrays are decoded straight from the mapping (no copy); when the
last of them is gone the receiver marks the segment free again in its
first byte (the shared state: free, busy, retired), and the sender may
reuse it.

The sender keeps a few free segments (:data:`KEEP_FREE`); it retires the
others (marks them retired and drops its mapping; the receiver drops its own
when it next sees one; a pool dropped with its link lets go of its mappings
but leaves the states and files, as a message sent through one may still be
read). Files are 0600, created by this process's user. Files a receiver
never mapped (it died, or the message was dropped) are unlinked by the
sender when its transport stops; files of a sender killed before it could
(SIGKILL) are unlinked by the receivers it named them to, when theirs stop.

Taking a large segment down (unmapping it, unlinking or closing the last
hold on its file, which frees its pages) takes long: a tenth of a
second for 256 MB (docs/benchmarks.md). Segments of :data:`REAP_MIN` or
more, and the large mappings a receiver or a dropped pool lets go of, are
therefore taken down by a reaper thread (``rpcdist-shm-reaper``, started when there is work,
gone after a second idle), never by the thread that lets go
of them, which may be an event loop's; a retired segment's state is set
first, by that thread.

The copy itself lets go of the GIL from :data:`_UNLOCKED_COPY` up, so the
worker's loop runs meanwhile. From :data:`_SHARED_COPY` up, where a core
is idle (:func:`rpcdist._cores.spare_core`), the sending thread shares it
with a copier thread (``rpcdist-shm-copier``, started and gone like the
reaper): one core's stores do not fill the memory bus on this kind of
machine (docs/benchmarks.md). A transport's :meth:`SegmentWriter.aclean`
waits for both threads, so its files are gone and the threads have ended
once it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import mmap
import os
import secrets
import threading
import weakref

import numpy as np

from .._cores import spare_core
from ._lingering import LingeringThread

__all__ = [
    "REAP_MIN",
    "SHM_DIR",
    "SegmentPool",
    "SegmentReader",
    "SegmentWriter",
    "layout",
    "shm_available",
]

_log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
_PREFIX = "rpcdist-msg-"
#: Map every page at once instead of taking a fault per 4 KiB page on first
#: touch (Linux; measured faster for multi-megabyte payloads).
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
#: Byte 0 of a segment is its state; bytes 8-15 the number of buffers, then
#: each buffer's offset (8 bytes apiece, little-endian).
_STATE, _COUNT, _TABLE = 0, 8, 16
FREE, BUSY, RETIRED = 0, 1, 2
#: Free segments a pool keeps for reuse; more are retired.
KEEP_FREE = 4
#: Segment sizes are rounded up to a multiple of this (so a slightly larger
#: message still fits a segment made for an earlier one).
_GRAIN = 1 << 20
#: Buffers this large keep their source's offset within a page; smaller
#: ones start on a cache line.
_PAGE_ALIGN_MIN = 1 << 20
_PAGE, _LINE = 4096, 64
#: Segments (and receivers' mappings) this large are taken down by the
#: reaper thread; smaller ones (1 MiB) at once (docs/benchmarks.md).
REAP_MIN = 2 << 20
#: Buffers this large are copied into a segment with the GIL released, so the
#: worker's other threads (its loop) run meanwhile.
_UNLOCKED_COPY = 256 << 10
#: Buffers this large are copied by two threads at once when a core is
#: idle, in pieces this large (docs/benchmarks.md, "Figures behind the
#: code's choices").
_SHARED_COPY = 4 << 20
_PIECE = 2 << 20


def layout(buffers: list[memoryview]) -> tuple[list[int], int]:
    """Where each of ``buffers`` goes in a segment, and the bytes it takes in all."""
    at = _TABLE + 8 * len(buffers)
    offsets = []
    for b in buffers:
        if b.nbytes >= _PAGE_ALIGN_MIN:
            src = np.frombuffer(b, np.uint8).__array_interface__["data"][0] % _PAGE
            at += (src - at) % _PAGE
        else:
            at = -(-at // _LINE) * _LINE
        offsets.append(at)
        at += b.nbytes
    return offsets, at


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
    """The segments one link sends through (see the module docstring); any thread."""

    def __init__(self, writer: SegmentWriter) -> None:
        self._writer = writer
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()
        self.closed = False
        #: Dropped unclosed (its link went away): let go of its mappings.
        weakref.finalize(self, _drop_all, self._segments).atexit = False

    def write(self, buffers: list[memoryview]) -> tuple[str, _Segment]:
        """Copy ``buffers`` into a free segment; return its path and the segment.

        Raises:
            OSError: no segment could be made (e.g. /dev/shm full), or the pool is closed.
        """
        offsets, total = layout(buffers)
        with self._lock:
            if self.closed:
                raise OSError("segment pool closed")
            seg = self._take(total) or self._make(total)
            seg.mm[_STATE] = BUSY
        mm = seg.mm
        try:
            mm[_COUNT:_TABLE] = len(buffers).to_bytes(8, "little")
            table = np.frombuffer(mm, "<u8", len(buffers), _TABLE)
            table[:] = offsets
            del table
            for off, b in zip(offsets, buffers):
                if b.nbytes < _UNLOCKED_COPY:
                    mm[off : off + b.nbytes] = b
                else:  # (NumPy lets go of the GIL for the copy; mmap's slice store keeps it)
                    dst = np.frombuffer(mm, np.uint8, b.nbytes, off)
                    _copy(dst, np.frombuffer(b, np.uint8))
                    del dst
        except BaseException:
            mm[_STATE] = FREE
            raise
        self._writer.wrote()
        return seg.path, seg

    @staticmethod
    def release(seg: _Segment) -> None:
        """Mark ``seg`` free again (a message through it was dropped before it left)."""
        _release(seg.mm)

    def _take(self, total: int) -> _Segment | None:
        free = [s for s in self._segments if s.mm[_STATE] == FREE]
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
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=_FLAGS)
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
        _retire(seg, self._writer)

    def close(self) -> None:
        """Retire every segment (arrays the receiver still holds stay valid);
        the large ones are taken down by the reaper."""
        with self._lock:
            self.closed = True
            _retire_all(self._segments, self._writer)

    def __len__(self) -> int:
        return len(self._segments)


class SegmentWriter:
    """A transport's segment pools, one per same-host link; unlinks leftovers on cleanup."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: weakref.WeakSet[SegmentPool] = weakref.WeakSet()
        self._paths: set[str] = set()
        self.segments_written = 0
        self.segments_made = 0

    def pool(self) -> SegmentPool:
        """A new pool for one link."""
        p = SegmentPool(self)
        with self._lock:
            self._pools.add(p)
        return p

    def wrote(self) -> None:
        with self._lock:
            self.segments_written += 1

    def note(self, path: str) -> None:
        """A segment file was made (unlinked on cleanup if still there)."""
        with self._lock:
            self._paths.add(path)
            self.segments_made += 1

    def forget(self, path: str) -> None:
        """A segment was retired (its file unlinked already)."""
        with self._lock:
            self._paths.discard(path)

    def cleanup(self) -> None:
        """Close every pool, wait for the reaper, unlink files that were never
        picked up, and those a peer that died (SIGKILL) left behind for us
        (blocks: see :meth:`aclean` for the loop)."""
        with self._lock:
            pools = list(self._pools)
        for p in pools:
            p.close()
        _COPIER.drain()
        _REAPER.drain()
        while self._paths:
            _unlink(self._paths.pop())
        sweep()

    async def aclean(self) -> None:
        """:meth:`cleanup` on the reaper thread, without holding up the loop."""
        await asyncio.wrap_future(_REAPER.put(self.cleanup))
        _REAPER.drain()  # (ends the thread: it has nothing left to do)


#: Process ids of the senders this process was named segments by (a
#: transport's cleanup unlinks what those that died left behind).
_SENDERS: set[int] = set()


class SegmentReader:
    """The receiving side: the segments mapped, by path (any thread)."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()
        #: Dropped with its link: the reaper unmaps the large mappings.
        weakref.finalize(self, _let_go, self._maps).atexit = False

    def buffers(self, path: str, sizes: list[int]) -> list[memoryview]:
        """Views of a message's buffers in segment ``path`` (mapped and unlinked on first use).

        The segment is marked free once every view (and array decoded from
        one) is gone.

        Raises:
            OSError: the file is missing or shorter than ``sizes`` say.
            ValueError: ``path`` is not a payload file of ours.
        """
        with self._lock:
            retired = {p: mm for p, mm in self._maps.items() if mm[_STATE] == RETIRED}
            for p in retired:
                del self._maps[p]
            _let_go(retired)
            mm = self._maps.get(path)
            if mm is None:
                _SENDERS.add(_sender(path))
                mm = self._maps[path] = _map(path)
        n = len(sizes)
        end = _TABLE + 8 * n
        if int.from_bytes(mm[_COUNT:_TABLE], "little") != n or end > len(mm):
            raise OSError(f"payload segment {path} does not hold the {n} buffers announced")
        offsets = np.frombuffer(mm, "<u8", n, _TABLE).tolist()
        lo = min(offsets, default=end)
        hi = max((o + s for o, s in zip(offsets, sizes)), default=end)
        if lo < end or hi > len(mm):
            raise OSError(f"payload segment {path} is shorter than the buffers announced")
        lease = np.frombuffer(mm, np.uint8, hi - lo, lo)
        weakref.finalize(lease, _release, mm)
        view = lease.data
        return [view[o - lo : o - lo + s] for o, s in zip(offsets, sizes)]

    def close(self) -> None:
        """Forget the mappings (each lasts until the arrays in it are gone)."""
        with self._lock:
            _let_go(self._maps)


_REAPER = LingeringThread("rpcdist-shm-reaper", "taking down shared-memory segments")
_COPIER = LingeringThread("rpcdist-shm-copier", "copying into a shared-memory segment")


class _SharedCopy:
    """One large copy cut into :data:`_PIECE` pieces, which the thread that
    sends and the copier thread take in turn until none is left. The
    sender never waits for the copier to start (it takes every piece if it
    must); it waits at most for the piece the copier is on, and always for
    that one (the segment may be reused once the sender returns)."""

    __slots__ = ("_dst", "_error", "_left", "_lock", "_next", "_pieces", "_src", "done")

    def __init__(self, dst: np.ndarray, src: np.ndarray) -> None:
        self._dst: np.ndarray | None = dst
        self._src: np.ndarray | None = src
        self._next = 0
        self._pieces = self._left = -(-src.nbytes // _PIECE)
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.done = threading.Event()

    def work(self) -> None:
        """Copy pieces until none is left to take (any thread)."""
        while True:
            with self._lock:
                dst, src, i = self._dst, self._src, self._next
                if dst is None or src is None or i >= self._pieces:
                    return
                self._next += 1
            piece = slice(i * _PIECE, (i + 1) * _PIECE)
            try:
                np.copyto(dst[piece], src[piece])
            except BaseException as e:
                self._error = e
            del dst, src
            self._finished(1)

    def _finished(self, pieces: int) -> None:
        with self._lock:
            self._left -= pieces
            if self._left == 0:
                self.done.set()

    def run(self) -> None:
        """Share the copy with the copier; return once every piece is in,
        or raise once no piece is under way."""
        _COPIER.put(self.work)
        try:
            self.work()
        finally:
            with self._lock:  # (interrupted: nothing more is taken)
                untaken, self._next = self._pieces - self._next, self._pieces
            self._finished(untaken)
            interrupted = None
            while not self.done.is_set():
                try:
                    self.done.wait()
                except BaseException as e:  # (e.g. KeyboardInterrupt: the piece ends first)
                    interrupted = e
            with self._lock:  # (a late copier takes nothing, and keeps no view of the segment)
                self._dst = self._src = None
            if interrupted is not None:
                raise interrupted
        if self._error is not None:
            raise self._error


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (byte arrays of one size) with the GIL let
    go: shared with the copier thread if large and a core is idle."""
    if src.nbytes >= _SHARED_COPY and spare_core():
        _SharedCopy(dst, src).run()
    else:
        np.copyto(dst, src)


def _retire(seg: _Segment, writer: SegmentWriter) -> None:
    """Mark ``seg`` retired (the receiver never reuses it) and take it down,
    by the reaper if it is large."""
    seg.mm[_STATE] = RETIRED
    if seg.size < REAP_MIN or _REAPER.here():
        _teardown(seg, writer)
    else:
        _REAPER.put(_teardown, seg, writer)


def _retire_all(segments: list[_Segment], writer: SegmentWriter) -> None:
    while segments:
        _retire(segments.pop(), writer)


def _drop_all(segments: list[_Segment]) -> None:
    """A pool dropped unclosed: the reaper unmaps its large segments."""
    large = [s for s in segments if s.size >= REAP_MIN]
    segments.clear()
    if large and not _REAPER.here():
        _REAPER.put(_close_segments, large)


def _close_segments(segments: list[_Segment]) -> None:
    while segments:
        seg = segments.pop()
        seg.mm.close()
        seg.close_fd()


def _teardown(seg: _Segment, writer: SegmentWriter) -> None:
    """Unlink ``seg``'s file, unmap it and close its descriptor (frees its
    pages if the receiver holds it no more)."""
    _unlink(seg.path)  # (the receiver unlinked it already if it mapped it)
    seg.mm.close()
    seg.close_fd()
    writer.forget(seg.path)


def _let_go(maps: dict[str, mmap.mmap]) -> None:
    """Empty ``maps``, a receiver's mappings; the reaper unmaps the large ones."""
    large = [mm for mm in maps.values() if len(mm) >= REAP_MIN]
    maps.clear()
    if large and not _REAPER.here():
        _REAPER.put(_unmap, large)


def _unmap(maps: list[mmap.mmap]) -> None:
    while maps:
        mm = maps.pop()
        with contextlib.suppress(BufferError):  # arrays still use it: unmapped with them
            mm.close()


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


def _release(mm: mmap.mmap) -> None:
    try:
        if not mm.closed and mm[_STATE] == BUSY:
            mm[_STATE] = FREE
    except ValueError:  # retired and closed by another thread meanwhile
        pass


def _map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    try:
        _unlink(path)
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise ValueError(f"refusing to map {path!r}: owned by uid {st.st_uid}")
        if st.st_size <= _TABLE:
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
