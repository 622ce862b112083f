"""The RRef ownership state machine: ids, the owner's table and the user's tables.

Pure bookkeeping with no I/O and no event loop (see ``docs/rref.md``);
:mod:`._rref_context` drives it from messages. Every method is thread-safe
(one lock per table) and calls nothing out while holding its lock: values
and RRefs that stop being referenced are handed back to the caller, so that
their finalisers (which may queue RRef deletes) run after the lock is let go.

Ids in a dynamic group start at a random point per process (:class:`Ids`):
a process that takes a lost worker's rank would otherwise make the ids its
predecessor made, and survivors keep records, forks and tombstones keyed by
them (a new value with an old id was taken for the old one). Dropping those
at the loss is not sound (survivors may still hold values the lost worker
created, by those ids); an incarnation beside the id would change every
message; a random start keeps the wire and ``str(rref)``'s form.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

from .._errors import RRefCreationError
from .._futures import Future

__all__ = [
    "ABSENT",
    "CREATING",
    "FAILED",
    "FRESH_START",
    "READY",
    "ForkId",
    "Ids",
    "OwnerTable",
    "RRefId",
    "Record",
    "UserTable",
]

RRefId = tuple[int, int]
"""``(creating worker id, counter)``: names one value."""
ForkId = tuple[int, int]
"""``(creating worker id, counter)``: names one user RRef instance."""

#: A dynamic group's counters start below this (2**62: each may make 2**62
#: ids more, within torch's int64 ``local_id``).
FRESH_START: Final = 1 << 62

ABSENT: Final = 0  # referenced before its remote() reached the owner
CREATING: Final = 1  # remote() is running the function
READY: Final = 2
FAILED: Final = 3  # the function raised; the error is kept


class Ids:
    """Makes this worker's RRefIds and ForkIds: one counter, unique per
    worker, from 0 as torch's; with ``fresh`` (a dynamic group) from a random
    point below ``FRESH_START``, so that a process taking a lost one's rank
    does not make the ids its predecessor made (``docs/rref.md``)."""

    def __init__(self, rank: int, *, fresh: bool = False) -> None:
        self.rank = rank
        start = secrets.randbelow(FRESH_START) if fresh else 0
        self._next = itertools.count(start).__next__

    def new(self) -> tuple[int, int]:
        return (self.rank, self._next())


class Record:
    """The owner's slot for one value: state, value or error, and live forks.

    ``forks`` maps each ForkId the owner knows to be alive to the worker
    holding it. ``ready`` completes (with ``None``) once the state is
    ``READY`` or ``FAILED``.
    """

    __slots__ = ("__weakref__", "error", "forks", "ready", "rid", "state", "traceback", "value")

    def __init__(self, rid: RRefId, state: int = ABSENT, value: Any = None) -> None:
        self.rid = rid
        self.state = state
        self.value = value
        self.error: BaseException | None = None
        self.traceback: TracebackType | None = None
        self.forks: dict[ForkId, int] = {}
        self.ready: Future[None] = Future()
        if state == READY:
            self.ready.set_result(None)

    def get(self) -> Any:
        """The value, or the creation error raised again (a finished record only)."""
        if self.error is not None:
            try:
                raise self.error.with_traceback(self.traceback)
            finally:
                # The error's traceback keeps this frame: it must not keep
                # the record, which keeps the error (a cycle).
                self = None  # type: ignore[assignment]
        return self.value


class OwnerTable:
    """Values owned here: which forks keep each alive, and creation state.

    A record is *live* (held by the table) while any fork of it is known;
    local owner RRefs hold their record themselves, so a value lives while
    either holds it. Every record alive anywhere here is also *known*
    (weakly), so the same RRefId always finds the same record.

    *Tombstones* remember abandon-deletes (the creator's ``remote()`` timed
    out) that arrived before the creation itself; they expire after
    ``tombstone_ttl`` seconds in case the creation never arrives. A value
    whose creation was abandoned before it arrived fails with
    :class:`RRefCreationError` (its ``remote()`` expired on the way).
    """

    def __init__(
        self, tombstone_ttl: float = 300.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._lock = threading.Lock()
        self._live: dict[RRefId, Record] = {}
        self._known: weakref.WeakValueDictionary[RRefId, Record] = weakref.WeakValueDictionary()
        self._tombstones: dict[RRefId, tuple[ForkId, float]] = {}
        self._ttl = tombstone_ttl
        self._clock = clock

    def record(self, rid: RRefId) -> Record:
        """The record of ``rid``, made ``ABSENT`` if nothing here knows it yet."""
        with self._lock:
            rec = self._known.get(rid)
            if rec is None:
                rec = self._known[rid] = Record(rid)
                if rid in self._tombstones:
                    self._abandoned(rec)
            return rec

    def find(self, rid: RRefId) -> Record | None:
        with self._lock:
            return self._known.get(rid)

    def local(self, rid: RRefId, value: Any) -> Record:
        """A new ready record for ``RRef(value)`` (held by the caller, not the table)."""
        rec = Record(rid, READY, value)
        with self._lock:
            self._known[rid] = rec
        return rec

    def add_fork(self, rec: Record, fid: ForkId, holder: int) -> None:
        """The owner learns that ``holder`` has fork ``fid`` of ``rec``."""
        with self._lock:
            rec.forks[fid] = holder
            self._live[rec.rid] = rec

    def remove_fork(self, rid: RRefId, fid: ForkId, *, abandon: bool = False) -> Record | None:
        """Forget fork ``fid`` (idempotent); return the record if it is no longer live.

        ``abandon`` marks the creator's fork of a ``remote()`` that timed out:
        if the creation has not been seen yet, a tombstone keeps it from
        registering the fork when it arrives.
        """
        with self._lock:
            rec = self._known.get(rid)
            if rec is not None and rec.forks.pop(fid, None) is not None:
                if not rec.forks:
                    return self._live.pop(rid, None)
                return None
            if abandon and (rec is None or rec.state == ABSENT):
                now = self._clock()
                self._purge(now)
                self._tombstones[rid] = (fid, now)
                if rec is not None:
                    self._abandoned(rec)
            return None

    @staticmethod
    def _abandoned(rec: Record) -> None:
        rec.state = FAILED
        rec.error = RRefCreationError(
            f"RRef {rec.rid}: its remote() timed out before it reached the owner, "
            "so the value was never created"
        )
        rec.ready.set_result(None)  # (its callbacks take no lock of ours)

    def begin_creation(self, rid: RRefId, fid: ForkId | None, holder: int) -> Record:
        """``remote()`` reached the owner: mark ``CREATING``, register the creator's fork."""
        with self._lock:
            rec = self._known.get(rid)
            if rec is None:
                rec = self._known[rid] = Record(rid)
            if rec.state == ABSENT:
                rec.state = CREATING
            stone = self._tombstones.pop(rid, None)
            if fid is not None and (stone is None or stone[0] != fid):
                rec.forks[fid] = holder
                self._live[rid] = rec
            return rec

    def finish_creation(
        self, rec: Record, value: Any = None, error: BaseException | None = None
    ) -> Record | None:
        """Store the outcome of the creation (first outcome wins); wake waiters.

        Returns the record if it is no longer live (nobody but the caller holds it).
        """
        with self._lock:
            if rec.state in (READY, FAILED):
                return None
            if error is not None:
                rec.state, rec.error, rec.traceback = FAILED, error, error.__traceback__
            else:
                rec.state, rec.value = READY, value
            dropped = None if rec.forks else self._live.pop(rec.rid, None)
        rec.ready.set_result(None)
        return dropped

    def forget_holder(self, holder: int) -> list[Record]:
        """Drop every fork held by ``holder`` (a worker known to be gone)."""
        dropped = []
        with self._lock:
            for rid, rec in list(self._live.items()):
                for fid in [f for f, h in rec.forks.items() if h == holder]:
                    del rec.forks[fid]
                if not rec.forks:
                    dropped.append(self._live.pop(rid))
        return dropped

    def leftovers(self) -> list[tuple[RRefId, list[int]]]:
        """Live records and the workers holding their forks (for leak reports)."""
        with self._lock:
            return [(rid, sorted(set(rec.forks.values()))) for rid, rec in self._live.items()]

    def _purge(self, now: float) -> None:
        old = [k for k, (_, t) in self._tombstones.items() if now - t > self._ttl]
        for k in old:
            del self._tombstones[k]

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {
                "rref_owners": len(self._live),
                "rref_forks": sum(len(r.forks) for r in self._live.values()),
                "rref_tombstones": len(self._tombstones),
            }


class UserTable:
    """User RRefs on this worker: pending (unconfirmed), confirmed, and held parents.

    *Pending users* are held strongly until the owner confirms their fork;
    *pending children* hold the parent RRef of each fork sent from here until
    the owner has confirmed the child (G2); confirmed users are tracked
    weakly, for shutdown. Entries are ``(rref, parent worker or None)``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[ForkId, tuple[Any, int | None]] = {}
        self._children: dict[ForkId, Any] = {}
        self._users: weakref.WeakValueDictionary[ForkId, Any] = weakref.WeakValueDictionary()

    def add_pending(self, fid: ForkId, rref: Any, parent: int | None) -> None:
        with self._lock:
            self._pending[fid] = (rref, parent)

    def add_confirmed(self, fid: ForkId, rref: Any) -> None:
        with self._lock:
            self._users[fid] = rref

    def settle(
        self, fid: ForkId, state: int, error: BaseException | None = None
    ) -> tuple[Any, int | None] | None:
        """End ``fid``'s pending state: set the RRef's ``_state``/``_error``, stop holding it.

        Returns ``(rref, parent)``, or ``None`` if ``fid`` was not pending.
        """
        with self._lock:
            entry = self._pending.pop(fid, None)
            if entry is not None:
                rref = entry[0]
                rref._error = error
                rref._state = state
                self._users[fid] = rref
            return entry

    def pending_of(self, owner: int) -> list[ForkId]:
        with self._lock:
            return [f for f, (r, _) in self._pending.items() if r._owner == owner]

    def add_child(self, fid: ForkId, parent: Any) -> None:
        with self._lock:
            self._children[fid] = parent

    def accept_child(self, fid: ForkId) -> Any:
        """The owner confirmed child ``fid``: return (and stop holding) its parent."""
        with self._lock:
            return self._children.pop(fid, None)

    def children_of(self, owner: int) -> list[ForkId]:
        with self._lock:
            return [f for f, r in self._children.items() if r._owner == owner]

    def live_users(self) -> list[Any]:
        """Strong references to every user RRef alive here."""
        with self._lock:
            return [r for r in self._users.values() if r is not None]

    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending or self._children)

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {
                "rref_pending_users": len(self._pending),
                "rref_pending_children": len(self._children),
                "rref_users": len(self._users),
            }
