"""Same-host shared memory: segments, doorbells and the round protocol.

Each rank of a group maps one segment per member: its own, which only it
writes, and its peers', which it reads. A segment is a control block (a
sync counter and two metadata slots) and ``SLOTS`` data slots of
``slot_bytes``. Segments are ``/dev/shm`` files created with ``O_EXCL``,
reserved with ``posix_fallocate`` (so a full ``/dev/shm`` is an error at
setup, never a ``SIGBUS`` later), named with a job-unique prefix, and
unlinked as soon as every member has mapped them: nothing is left behind,
even when a process is killed. No ``multiprocessing.shared_memory``, so no
resource tracker is involved.

Synchronisation: a rank finishes a phase, stores its counter in its control
block and rings every peer's doorbell (one byte on an abstract Unix datagram
socket, skipped when the peer's queue is full since one pending byte is
enough); a waiting rank sleeps in ``poll`` on its doorbell, then re-reads
the counters. Nobody spins, which matters with more ranks than cores.
Counters are aligned 8-byte stores, published after the data (x86-64 keeps
stores in order; the doorbell's system call orders them too).

The protocol is synchronous: it runs on the thread that executes the
collective (the caller's, or the group's worker thread), never on the event
loop, so a barrier costs two system calls and one wake-up instead of
several hand-offs between threads. While waiting it calls ``check`` every
``CHECK_PERIOD`` seconds (and when woken without progress), which raises on
a timeout, a dead peer or an abort.

Data moves in *rounds*; round ``g`` uses slot ``g % SLOTS`` of every
segment. Each round needs one sync: a slot is rewritten only after every
peer passed a sync that follows its last read of it. Four slots let a rank
signal a sync before it copies the previous round's results out (peers
move on while it copies); three would do without that overlap.
The collectives built on this are in :mod:`._shm_algos`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import mmap
import os
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from .._errors import CollectiveError
from ._ops import validate

__all__ = ["SLOTS", "Segments", "setup_segments"]

SLOTS = 4
#: Bytes of one data slot, per rank.
SLOT_BYTES = int(os.environ.get("RPCDIST_SHM_SLOT_BYTES", 4 << 20))
#: Bytes a round moves when every rank has a core: small rounds stay in cache.
#: With more ranks than cores each sync costs context switches, so rounds then
#: use the whole slot (the figures: docs/benchmarks.md, "Figures behind the
#: code's choices").
ROUND_BYTES = 1 << 20
_CTRL = 16384
#: Bytes of the control block holding its owner's setup nonce (the probe's).
_NONCE = slice(8, 16)
_META = 4096  # two metadata slots at 4096 and 8192
_SHM_DIR = "/dev/shm"
#: Seconds between ``check`` calls while waiting for peers.
CHECK_PERIOD = 0.2

#: Segment files created but not yet unlinked (removed at exit if still there).
_LIVE_FILES: set[str] = set()


@atexit.register
def _unlink_leftovers() -> None:
    for path in list(_LIVE_FILES):
        with contextlib.suppress(OSError):
            os.unlink(path)
    _LIVE_FILES.clear()


def _address(name: str) -> bytes:
    return b"\0" + name.encode()


class Segments:
    """The mapped segments and doorbells of one group on one rank."""

    def __init__(
        self,
        rank: int,
        maps: list[mmap.mmap],
        sock: socket.socket,
        names: list[str],
        slot_bytes: int,
    ) -> None:
        self.rank = rank
        self.size = len(maps)
        self.slot_bytes = slot_bytes
        #: Bytes per round; the same on every member (same host, same rule).
        self.round_bytes = (
            slot_bytes if self.size > (os.cpu_count() or 1) else min(slot_bytes, ROUND_BYTES)
        )
        self._maps = maps
        self._sock = sock
        self._peers = [(q, _address(names[q])) for q in range(self.size) if q != rank]
        self._own = _address(names[rank])
        self._ctrl = [memoryview(m)[:_CTRL].cast("q") for m in maps]
        self._peer_ctrl = [self._ctrl[q] for q, _ in self._peers]
        self._meta = [memoryview(m)[_META : 3 * _META] for m in maps]
        self._data = [np.frombuffer(m, np.uint8, SLOTS * slot_bytes, _CTRL) for m in maps]
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self._count = 0
        #: Rounds run so far; round ``g`` uses slot ``g % SLOTS``.
        self.round = 0
        #: Called while waiting; raises to end the wait (set by the group).
        self.check: Callable[[bool], None] = lambda full: None
        self._closed = False
        self._xp: Any = None  # the device adapter that page-locked the data regions
        self._pinned: list[np.ndarray] = []

    # --------------------------------------------------------------- access

    def slot(self, q: int, g: int) -> np.ndarray:
        """Rank ``q``'s data slot for round ``g`` (bytes)."""
        s = (g % SLOTS) * self.slot_bytes
        return self._data[q][s : s + self.slot_bytes]

    # -------------------------------------------------------- device copies

    @property
    def pinned(self) -> bool:
        """Whether the data regions are page-locked for device copies."""
        return bool(self._pinned)

    def pin(self, xp: Any) -> bool:
        """Page-lock every mapped data region for ``xp``'s device copies (once).

        Copies between GPU buffers and page-locked slots run at the bus's
        speed instead of through the driver's bounce buffers; a copy from
        such a slot may still be reading after the call that issued it, so
        the algorithms call ``xp.fence`` before each sync that lets a slot's
        owner rewrite it. Returns whether the regions are pinned; if any
        region is refused, none stays pinned (plain copies still work).
        """
        if xp.host or self._xp is not None or self._closed:
            return self.pinned  # host buffers never need it; a device tries once
        self._xp = xp
        for region in self._data:
            if not xp.pin(region):
                for done in self._pinned:
                    xp.unpin(done)
                self._pinned = []
                return False
            self._pinned.append(region)
        return True

    def _unpin(self) -> None:
        if self._pinned:
            for region in self._pinned:
                self._xp.unpin(region)
            self._pinned = []

    # ------------------------------------------------------------- the sync

    def _drain(self) -> None:
        try:
            while self._sock.recv(64):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _ready(self, n: int) -> bool:
        return all(c[0] >= n for c in self._peer_ctrl)

    def interrupt(self) -> None:
        """Wake a waiting :meth:`sync` so it calls ``check`` (any thread)."""
        with contextlib.suppress(OSError):
            self._sock.sendto(b"\x00", self._own)

    def sync(self) -> None:
        """Publish that this rank finished the phase; wait until every peer has.

        Raises:
            CollectiveError: a peer left the group.
            RpcdistError: whatever ``check`` raises (timeout, abort, ...).
        """
        self.wait(self.signal())

    def signal(self) -> int:
        """Publish the next counter value and ring every peer; return it.

        Raises:
            CollectiveError: a peer's doorbell is gone while it still owes this sync.
        """
        self._count += 1
        n = self._count
        self._ctrl[self.rank][0] = n
        for q, addr in self._peers:
            try:
                self._sock.sendto(b"\x01", addr)
            except (BlockingIOError, InterruptedError):
                pass  # its queue is full: a wake-up is pending already
            except OSError as e:
                # Its doorbell is closed: fine if it already passed this sync
                # (it saw our counter and left); otherwise it left too early.
                if self._ctrl[q][0] < n:
                    raise CollectiveError(
                        f"shared-memory peer rank {q} left the group during the collective "
                        f"(its doorbell: {e})"
                    ) from e
        return n

    def wait(self, n: int) -> None:
        """Sleep until every peer's counter reaches ``n``.

        Raises:
            RpcdistError: whatever ``check`` raises (timeout, abort, ...).
        """
        period = int(CHECK_PERIOD * 1000)
        last = time.monotonic()
        while not self._ready(n):
            self._poll.poll(period)
            self._drain()
            if not self._ready(n):
                now = time.monotonic()
                full = now - last >= CHECK_PERIOD  # liveness and timeout, now and then
                if full:
                    last = now
                self.check(full)

    # ------------------------------------------------------------- metadata

    def put_meta(self, seq: int, full: bytes) -> None:
        """Store this rank's metadata for collective ``seq`` (before its first sync)."""
        if len(full) > _META - 4:
            full = b"#" + hashlib.blake2b(full, digest_size=16).digest()
        slot = self._meta[self.rank][(seq % 2) * _META :]
        slot[4 : 4 + len(full)] = full
        slot[:4] = len(full).to_bytes(4, "little")

    def check_meta(self, seq: int, where: str) -> list[Any] | None:
        """Compare every rank's metadata for ``seq`` (after its first sync).

        Returns every rank's decoded ``[common, ins, outs]``, or ``None`` when
        the metadata was too long to store and only digests were compared.

        Raises:
            CollectiveError: the ranks' calls differ (every rank raises).
        """
        fulls = []
        for q in range(self.size):
            slot = self._meta[q][(seq % 2) * _META :]
            n = int.from_bytes(slot[:4], "little")
            fulls.append(bytes(slot[4 : 4 + n]))
        if fulls.count(fulls[0]) == len(fulls) and fulls[0][:1] != b"#":
            one = msgpack.unpackb(fulls[0])
            if one[0][0] not in ("gather", "scatter", "all_to_all"):
                return [one] * len(fulls)
        if any(f[:1] == b"#" for f in fulls):
            if len(set(fulls)) > 1:
                raise CollectiveError(f"{where}: the ranks' calls differ (shapes or dtypes)")
            return None
        validate(fulls, where)
        return [msgpack.unpackb(f) for f in fulls]

    # ------------------------------------------------------------- teardown

    def close(self) -> None:
        """Stop listening and unmap (views still held elsewhere keep their pages)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # a failed device must not keep the pages mapped
            self._unpin()
        self._pinned = []
        self._sock.close()
        self._ctrl = self._peer_ctrl = self._meta = []
        self._data = []
        for m in self._maps:
            with contextlib.suppress(BufferError, ValueError):
                m.close()
        self._maps = []


def _create(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    _LIVE_FILES.add(path)
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except BaseException:
        _unlink(path)
        raise
    finally:
        os.close(fd)


def _attach(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} has {os.fstat(fd).st_size} bytes, expected {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    _LIVE_FILES.discard(path)


async def _exchange(
    store: Any, key: str, rank: int, ranks: Sequence[int], value: Any, timeout: float
) -> list[Any]:
    await store.set(f"{key}/{rank}", msgpack.packb(value))
    got = await asyncio.gather(*(store.get(f"{key}/{r}", timeout) for r in ranks))
    return [msgpack.unpackb(g) for g in got]


def _ring_bell(sock: socket.socket, address: bytes, payload: bytes) -> None:
    """Send one datagram to a doorbell (how the setup probe reaches a peer)."""
    sock.sendto(payload, address)


async def _probe(
    store: Any,
    key: str,
    sock: socket.socket,
    names: Sequence[str],
    nonces: Sequence[bytes],
    ranks: Sequence[int],
    rank: int,
    timeout: float,
) -> str:
    """Prove that every member's doorbell is reachable from here (collective).

    A shared ``/dev/shm`` says nothing about the doorbells: ranks in
    different network namespaces of one host map each other's segments but
    cannot reach each other's abstract sockets. So each member rings every
    peer's doorbell with the nonce its own segment holds; the peer checks
    that what came matches the nonce in the segment it mapped. The results
    go through the store, so every member returns the same reason ("" when
    every doorbell answered).
    """
    loop = asyncio.get_running_loop()
    me, n = ranks[rank], len(names)
    heard: dict[int, bytes] = {}

    def drain() -> None:
        while True:
            try:
                data = sock.recv(64)
            except OSError:  # BlockingIOError: nothing (more) queued
                return
            if len(data) == 13 and data[:1] == b"P":
                heard[int.from_bytes(data[1:5], "little")] = data[5:]

    payload = b"P" + rank.to_bytes(4, "little") + nonces[rank]
    pending, failed = [q for q in range(n) if q != rank], []
    deadline = loop.time() + timeout
    # Peers' probes can fill our queue while we probe: drain it meanwhile.
    loop.add_reader(sock.fileno(), drain)
    try:
        while pending:
            full = []
            for q in pending:
                try:
                    _ring_bell(sock, _address(names[q]), payload)
                except (BlockingIOError, InterruptedError):
                    full.append(q)  # its queue is full: it drains it as it probes
                except OSError as e:
                    failed.append(f"rank {ranks[q]} ({e})")
            pending = full
            if pending and loop.time() > deadline:
                failed += [f"rank {ranks[q]} (its queue stayed full)" for q in pending]
                break
            if pending:
                await asyncio.sleep(0.001)
        reason = (
            f"rank {me} cannot reach the shared-memory doorbell of {', '.join(failed)}: "
            "another network namespace or container"
            if failed
            else ""
        )
        statuses = await _exchange(store, f"{key}/rang", me, ranks, reason, timeout)
        reason = next((s for s in statuses if s), "")
    finally:
        loop.remove_reader(sock.fileno())
    if reason:
        return reason
    drain()  # every probe was sent before its sender passed the exchange
    wrong = [ranks[q] for q in range(n) if q != rank and heard.get(q) != nonces[q]]
    if wrong:
        reason = (
            f"rank {me}: the doorbell probe of rank(s) {wrong} did not come, or did not "
            "match the nonce in their shared-memory segment"
        )
    statuses = await _exchange(store, f"{key}/heard", me, ranks, reason, timeout)
    return next((s for s in statuses if s), "")


async def setup_segments(
    store: Any,
    key: str,
    name: str,
    ranks: Sequence[int],
    rank: int,
    timeout: float,
    slot_bytes: int = SLOT_BYTES,
) -> Segments | str:
    """Create, exchange and map the segments of one group (collective, on the loop).

    ``ranks`` are the members' global ranks (store keys), ``rank`` this
    member's group rank; ``name`` is a job-unique prefix. Returns the
    segments, or the reason shared memory cannot be used (the same on every
    member, which then all fall back or fail alike): a segment that cannot be
    made or mapped, or a peer's doorbell that the probe (:func:`_probe`)
    cannot reach.

    Raises:
        RpcTimeoutError: a member did not take part within ``timeout``.
    """
    size = _CTRL + SLOTS * slot_bytes
    names = [f"{name}-{q}" for q in range(len(ranks))]
    paths = [os.path.join(_SHM_DIR, n) for n in names]
    me = ranks[rank]
    maps: list[mmap.mmap | None] = [None] * len(ranks)
    sock: socket.socket | None = None
    reason = ""
    created = False
    try:
        maps[rank] = own = _create(paths[rank], size)
        created = True
        own[_NONCE] = os.urandom(8)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(_address(names[rank]))
    except OSError as e:
        reason = f"rank {me}: cannot create {paths[rank]} ({size} bytes) or its doorbell: {e}"
    statuses = await _exchange(store, f"{key}/made", me, ranks, reason, timeout)
    reason = next((s for s in statuses if s), "")
    if not reason:
        try:
            for q, path in enumerate(paths):
                if q != rank:
                    maps[q] = _attach(path, size)
        except OSError as e:
            reason = f"rank {me}: cannot map a peer's segment: {e}"
        statuses = await _exchange(store, f"{key}/mapped", me, ranks, reason, timeout)
        reason = next((s for s in statuses if s), "")
    if created:
        _unlink(paths[rank])  # every member mapped it (or gave up): drop the name
    if not reason and sock is not None:
        nonces = [bytes(m[_NONCE]) for m in maps if m is not None]
        reason = await _probe(store, key, sock, names, nonces, ranks, rank, timeout)
    if reason or sock is None:
        if sock is not None:
            sock.close()
        for m in maps:
            if m is not None:
                m.close()
        return reason
    return Segments(rank, [m for m in maps if m is not None], sock, names, slot_bytes)
