"""The workers table: who is in the job, by rank and by name.

A static job's table is filled once, at rendezvous, and never changes (a
lost worker stays in it, marked lost by ``_liveness``). A dynamic group's
table changes as workers join and leave (:mod:`._members`): a worker that
left or was lost moves to the *departed*, where its name is still found
for messages and for the error a call to it raises, until a worker of the
same rank or name joins.

Written on the agent's loop; read from any thread: each change replaces the
dictionaries whole, so readers need no lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .._worker import WorkerInfo

__all__ = ["WorkerTable"]


class WorkerTable:
    """The present workers by rank and name, and the departed ones."""

    def __init__(self, workers: Iterable[WorkerInfo] = ()) -> None:
        self._present: dict[int, WorkerInfo] = {w.id: w for w in workers}
        self._names: dict[str, WorkerInfo] = {w.name: w for w in self._present.values()}
        #: Departed workers by rank: (who, why it departed).
        self._departed: dict[int, tuple[WorkerInfo, str]] = {}
        #: Workers a link came from before they were known (a joining worker).
        self._heard: dict[int, WorkerInfo] = {}
        self._sorted: tuple[WorkerInfo, ...] = tuple(sorted(self._present.values(), key=_rank))

    def __getitem__(self, rank: int) -> WorkerInfo:
        """The worker of ``rank``: present, else departed, else heard from.

        Raises:
            IndexError: no worker of that rank was ever known.
        """
        w = self._present.get(rank)
        if w is not None:
            return w
        gone = self._departed.get(rank)
        if gone is not None:
            return gone[0]
        w = self._heard.get(rank)
        if w is None:
            raise IndexError(f"no worker of rank {rank}")
        return w

    def __len__(self) -> int:
        return len(self._present)

    def __iter__(self) -> Iterator[WorkerInfo]:
        return iter(self._sorted)

    def knows(self, rank: int) -> bool:
        """Whether worker ``rank`` is present."""
        return rank in self._present

    def named(self, name: str) -> WorkerInfo | None:
        """The present worker called ``name``, if any."""
        return self._names.get(name)

    def departed(self, *, rank: int | None = None, name: str | None = None) -> str | None:
        """Why the departed worker of ``rank`` (or called ``name``) went, if it did."""
        for w, why in self._departed.values():
            if (rank is None or w.id == rank) and (name is None or w.name == name):
                return why
        return None

    def add(self, w: WorkerInfo) -> None:
        """``w`` joined (replacing any departed worker of its rank or name)."""
        present = {r: p for r, p in self._present.items() if p.name != w.name}
        present[w.id] = w
        self._departed = {
            r: d for r, d in self._departed.items() if r != w.id and d[0].name != w.name
        }
        self._heard = {r: h for r, h in self._heard.items() if r != w.id}
        self._set(present)

    def remove(self, rank: int, why: str) -> WorkerInfo | None:
        """Worker ``rank`` departed for ``why``; returns it (``None``: not present)."""
        w = self._present.get(rank)
        if w is None:
            return None
        self._departed = {**self._departed, rank: (w, why)}
        self._set({r: p for r, p in self._present.items() if r != rank})
        return w

    def hear(self, w: WorkerInfo) -> None:
        """A link came from ``w`` before it joined: name it in messages meanwhile."""
        if w.id not in self._present:
            self._heard = {**self._heard, w.id: w}

    def _set(self, present: dict[int, WorkerInfo]) -> None:
        self._present = present
        self._names = {w.name: w for w in present.values()}
        self._sorted = tuple(sorted(present.values(), key=_rank))


def _rank(w: WorkerInfo) -> int:
    return w.id
