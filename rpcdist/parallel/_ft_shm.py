"""The fault-tolerant mode's same-host path: the all-reduce and the step's vote in shared memory.

When every member of a quorum is on one host, :func:`setup` (collective,
over the quorum's TCP mesh) maps one ``/dev/shm`` segment per member: a
control block (a counter, a nonce, this step's *header*) and two data
slots. A sync publishes the member's counter and rings each peer's
doorbell (an abstract Unix datagram socket, as the shared-memory
collectives do); a waiting member sleeps in ``poll`` on its doorbell *and*
on its peers' TCP mesh connections, so a peer that dies (``kill -9``: the
kernel closes them) or gives up (it closes its mesh) wakes it at once.

Liveness rule: a wait fails only when a peer that has *not* reached the
counter is gone, which is final (a dead process writes nothing more, and a
member that gave up never signals in this group again), or at ``timeout``.

The all-reduce (:meth:`ShmGroup.all_reduce`), per round of at most one slot:
every member copies its vector into its slot; sync; member ``r`` sums part
``r`` over the members *in member order* (``0 + g_0 + g_1 + ...``, then
divides), the same arithmetic as the TCP path, so every member gets the
same bits; sync; everyone copies the parts out. Slots alternate, so a
slot is rewritten only after every peer passed the sync that follows its
last read of it.

The last round's second sync is the step's vote: passing it means every
member has reduced its part, so every member gets the whole average (a
peer that dies after it leaves its reduced part in its segment, which the
others still map), and the step commits without the coordinator, unless a
member's header asked for it (a rank waits to join, ...). See
``docs/fault-tolerance.md``.

A segment's file is named ``rpcdist-ft-<pid namespace>-<pid>-<random>``
and unlinked once every member mapped it (or gave up). A member killed
between creating its file and the exchange that tells the others its name
leaves a file nobody knows of: every member's :func:`setup` first unlinks
the files of its pid namespace whose process is gone (:func:`sweep`), so
the survivors' next quorum removes it, and so does every member's
``FaultTolerance.close()`` (a lone survivor sets up no other quorum).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import WorkerLostError
from ..collectives._shm import _attach, _create, _unlink

__all__ = ["HEAD_WORDS", "MAX_SAMPLES", "ShmGroup", "StalledError", "setup", "sweep"]

_DIR = "/dev/shm"
_CTRL = 16384
_SLOTS = 2
#: Largest data slot (bytes): a larger vector is reduced in rounds.
SLOT_MAX = 4 << 20
HEAD_WORDS = 3  # header words: [flags, epoch, count], then ``count`` sample indices
_HEADER = (_CTRL // 8 - 2) // 2  # words of each of the two alternating headers
#: Sample indices a member's header can carry (a larger batch votes through the coordinator).
MAX_SAMPLES = _HEADER - HEAD_WORDS
#: Up to this many bytes in all (vector times members), each member sums every
#: member's vector itself, after one sync; larger vectors take two syncs a round.
LOCAL_BYTES = 4 << 20
_GONE = select.POLLHUP | select.POLLERR | select.POLLRDHUP | select.POLLNVAL
_PREFIX = "rpcdist-ft-"


class StalledError(WorkerLostError):
    """The vote's sync timed out: a peer has not voted (it may yet)."""

    finish: Callable[[], None]  # completes the all-reduce once the others passed the vote


class ShmGroup:
    """One quorum's segments on this member (see the module doc).

    Args:
        rank: This member's index among the members.
        maps: Every member's segment, in member order.
        bell: This member's doorbell (bound, non-blocking).
        bells: The peers' doorbell addresses, by index.
        socks: The peers' TCP mesh connections, by index (watched for closing).
        slot_bytes: Bytes of one data slot.
        timeout: Seconds a wait may last.
    """

    def __init__(
        self,
        rank: int,
        maps: list[Any],
        bell: socket.socket,
        bells: dict[int, bytes],
        socks: dict[int, socket.socket],
        slot_bytes: int,
        timeout: float,
    ) -> None:
        self.rank, self.size, self.timeout = rank, len(maps), timeout
        self._maps, self._bell, self._bells = maps, bell, bells
        self._ctrl = [np.frombuffer(m, np.int64, _CTRL // 8) for m in maps]
        self._per = slot_bytes // 8
        self._data = [np.frombuffer(m, np.float64, _SLOTS * self._per, _CTRL) for m in maps]
        self._poll = select.poll()
        self._poll.register(bell.fileno(), select.POLLIN)
        self._fds = {s.fileno(): q for q, s in socks.items()}
        for fd in self._fds:
            self._poll.register(fd, select.POLLRDHUP)
        self._gone: set[int] = set()
        self._count = 0
        self._round = 0
        self._steps = 0

    def _slot(self, q: int, g: int) -> np.ndarray[Any, Any]:
        s = (g % _SLOTS) * self._per
        return self._data[q][s : s + self._per]

    # -- syncs -------------------------------------------------------------------------

    def sync(self, final: bool = False) -> None:
        """Publish the next counter and wait until every peer has reached it.

        Raises:
            WorkerLostError: a peer that had not reached it is gone, or ``timeout``
                passed (:class:`StalledError` for the ``final`` sync).
        """
        self._count += 1
        n = self._count
        self._ctrl[self.rank][0] = n  # after the data: x86-64 keeps stores in order
        for addr in self._bells.values():
            with contextlib.suppress(OSError):  # full queue: a wake-up is pending; closed: gone
                self._bell.sendto(b"\x01", addr)
        end = time.monotonic() + self.timeout
        while True:
            behind = [q for q in range(self.size) if q != self.rank and self._ctrl[q][0] < n]
            if not behind:
                return
            lost = [q for q in behind if q in self._gone]
            if lost:
                raise WorkerLostError(
                    f"fault tolerance: member {lost[0]} of this quorum left during the all-reduce"
                )
            left = end - time.monotonic()
            if left <= 0:
                kind = StalledError if final else WorkerLostError
                raise kind(f"fault tolerance: member(s) {behind} silent for {self.timeout} s")
            for fd, ev in self._poll.poll(min(left, 1.0) * 1000):
                if fd == self._bell.fileno():
                    self._drain()
                elif ev & _GONE:
                    self._gone.add(self._fds[fd])
                    self._poll.unregister(fd)

    def _drain(self) -> None:
        with contextlib.suppress(OSError):
            while self._bell.recv(64):
                pass

    # -- the step ----------------------------------------------------------------------

    def all_reduce(
        self, flat: np.ndarray[Any, Any], header: list[int], mid: Callable[[], None]
    ) -> list[list[int]]:
        """Average ``flat`` (float64) over the members in place; publish ``header`` with it.

        ``mid()`` runs between this rank's contribution and the vote's sync (see the
        module doc: passing that sync is the step's vote).

        Returns:
            Every member's header, in member order.

        Raises:
            StalledError: the vote's sync timed out; ``finish()`` completes the average
                if the coordinator says the others passed it.
            WorkerLostError: a member left, or a sync before the vote timed out.
        """
        at = 2 + (self._steps % 2) * _HEADER  # alternate: a peer writes the next one early
        self._steps += 1
        self._ctrl[self.rank][at : at + len(header)] = header
        if flat.nbytes * self.size <= LOCAL_BYTES and flat.size <= self._per:
            self._gather_reduce(flat, mid)
        else:
            self._scatter_reduce(flat, mid)
        heads = []
        for c in self._ctrl:
            count = int(c[at + HEAD_WORDS - 1])
            heads.append([int(x) for x in c[at : at + HEAD_WORDS + count]])
        return heads

    def _gather_reduce(self, flat: np.ndarray[Any, Any], mid: Callable[[], None]) -> None:
        """One sync: every member publishes its vector, then sums all of them itself."""
        g, size = self._round, flat.size
        self._round += 1
        self._slot(self.rank, g)[:size] = flat
        mid()

        def finish() -> None:
            np.add(self._slot(0, g)[:size], 0.0, out=flat)  # member order, as the TCP path
            for q in range(1, self.size):
                np.add(flat, self._slot(q, g)[:size], out=flat)
            np.divide(flat, self.size, out=flat)

        self._vote(finish)

    def _scatter_reduce(self, flat: np.ndarray[Any, Any], mid: Callable[[], None]) -> None:
        """Two syncs a round: member ``r`` sums part ``r``, then everyone copies the parts."""
        n, r = self.size, self.rank
        starts = range(0, flat.size, self._per)
        for a in starts:
            b = min(flat.size, a + self._per)
            g = self._round
            self._round += 1
            mine = self._slot(r, g)
            mine[: b - a] = flat[a:b]
            self.sync()
            cut = np.linspace(0, b - a, n + 1).astype(int)
            acc = mine[cut[r] : cut[r + 1]]
            np.add(self._slot(0, g)[cut[r] : cut[r + 1]], 0.0, out=acc)  # member order
            for q in range(1, n):
                np.add(acc, self._slot(q, g)[cut[r] : cut[r + 1]], out=acc)
            acc /= n
            if a == 0:
                mid()

            def copy_out(a: int = a, g: int = g, cut: Any = cut) -> None:
                for q in range(n):
                    flat[a + cut[q] : a + cut[q + 1]] = self._slot(q, g)[cut[q] : cut[q + 1]]

            if a == starts[-1]:
                self._vote(copy_out)
            else:
                self.sync()
                copy_out()

    def _vote(self, finish: Callable[[], None]) -> None:
        """The step's last sync, then ``finish()`` (the rest of the all-reduce, local)."""
        try:
            self.sync(final=True)
        except StalledError as e:
            e.finish = finish
            raise
        finish()

    def close(self) -> None:
        """Close the doorbell and unmap the segments."""
        self._bell.close()
        self._ctrl, self._data = [], []
        for m in self._maps:
            with contextlib.suppress(BufferError, ValueError):
                m.close()
        self._maps = []


def _slot_bytes(nbytes: int) -> int:
    return min(SLOT_MAX, max(4096, -(-nbytes // 4096) * 4096))


def setup(
    gather: Callable[[dict[str, Any]], list[dict[str, Any]]],
    rank: int,
    socks: dict[int, socket.socket],
    nbytes: int,
    timeout: float,
    point: Callable[[str], None] | None = None,
) -> ShmGroup | None:
    """Map every member's segment (collective over the mesh), or None on every member
    when one of them cannot (another host, another network namespace, no ``/dev/shm``,
    ``RPCDIST_FT_SHM=0`` in its environment).

    ``gather(info)`` returns every member's ``info`` in member order; ``socks`` are the
    peers' mesh connections by member index; ``point("shm_created")`` runs once this
    member's file exists, before the first exchange (tests place faults there).

    Raises:
        WorkerLostError, OSError: a member failed during the exchange.
    """
    slot = _slot_bytes(nbytes)
    size = _CTRL + _SLOTS * slot
    ns = _pid_namespace()
    sweep(ns)
    name = f"{_PREFIX}{ns}-{os.getpid()}-{secrets.token_hex(6)}"
    path = os.path.join(_DIR, name)
    nonce = secrets.token_bytes(8)
    maps: dict[int, Any] = {}
    bell: socket.socket | None = None
    ok = os.environ.get("RPCDIST_FT_SHM", "1") != "0"  # "0": the TCP mesh, as across hosts
    try:
        if not ok:
            raise OSError("RPCDIST_FT_SHM=0")
        maps[rank] = _create(path, size)
        maps[rank][8:16] = nonce
        bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        bell.setblocking(False)
        bell.bind(_address(name))
    except OSError:
        ok = False
    if point is not None and rank in maps:
        point("shm_created")
    try:
        infos = gather({"name": name, "nonce": nonce.hex(), "size": size, "ok": ok})
        peers = [(q, i) for q, i in enumerate(infos) if q != rank]
        ok = all(i["ok"] and i["size"] == size for i in infos)
        if ok:
            assert bell is not None
            ok = _attach_peers(peers, maps, bell, rank, nonce, size)
        ok = all(i["ok"] for i in gather({"ok": ok}))  # mapped everywhere: drop the names
        for info in infos:  # a member that died since leaves no file behind
            _unlink(os.path.join(_DIR, info["name"]))
        if ok:
            assert bell is not None
            heard = _heard(bell)
            ok = all(heard.get(q) == bytes.fromhex(i["nonce"]) for q, i in peers)
        ok = all(i["ok"] for i in gather({"ok": ok}))
    except BaseException:
        _release(path, maps, bell)
        raise
    if not ok or bell is None:
        _release(path, maps, bell)
        return None
    bells = {q: _address(i["name"]) for q, i in peers}
    return ShmGroup(rank, [maps[q] for q in range(len(infos))], bell, bells, socks, slot, timeout)


def _address(name: str) -> bytes:
    return b"\0" + name.encode()


def _pid_namespace() -> int:
    """This process's pid namespace (its inode; 0 if ``/proc`` cannot tell): a pid in
    a file's name means something only there."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _gone(pid: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) has ended: no such process, or
    a zombie (killed, its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return state in ([b"Z"], [b"X"])


def sweep(ns: int | None = None) -> list[str]:
    """Unlink the segment files of pid namespace ``ns`` (default: this process's) whose
    process has ended (see the module doc); the names removed. Nothing without a
    namespace to check (``ns`` 0)."""
    ns = _pid_namespace() if ns is None else ns
    if not ns:
        return []
    try:
        names = os.listdir(_DIR)
    except OSError:
        return []
    removed = []
    for name in names:
        parts = name.removeprefix(_PREFIX).split("-")
        if not name.startswith(_PREFIX) or len(parts) != 3 or parts[0] != str(ns):
            continue
        if parts[1].isdigit() and _gone(int(parts[1])):
            _unlink(os.path.join(_DIR, name))
            removed.append(name)
    return removed


def _attach_peers(
    peers: list[tuple[int, dict[str, Any]]],
    maps: dict[int, Any],
    bell: socket.socket,
    rank: int,
    nonce: bytes,
    size: int,
) -> bool:
    """Map the peers' segments (checking their nonces) and ring each one's doorbell
    with this member's nonce; whether all of it worked."""
    try:
        for q, info in peers:
            maps[q] = _attach(os.path.join(_DIR, info["name"]), size)
            if bytes(maps[q][8:16]) != bytes.fromhex(info["nonce"]):
                return False
            bell.sendto(b"P" + rank.to_bytes(4, "little") + nonce, _address(info["name"]))
    except OSError:
        return False
    return True


def _heard(bell: socket.socket) -> dict[int, bytes]:
    """The doorbell probes queued here: member index -> the nonce it sent."""
    heard = {}
    with contextlib.suppress(OSError):
        while True:
            data = bell.recv(64)
            if len(data) == 13 and data[:1] == b"P":
                heard[int.from_bytes(data[1:5], "little")] = data[5:]
    return heard


def _release(path: str, maps: dict[int, Any], bell: socket.socket | None) -> None:
    _unlink(path)
    for m in maps.values():
        with contextlib.suppress(BufferError, ValueError):
            m.close()
    if bell is not None:
        bell.close()
