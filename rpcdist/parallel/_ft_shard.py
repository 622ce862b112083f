"""Re-sharding flat vectors (ZeRO's, FSDP's) when the fault-tolerant membership changes.

In the fault-tolerant mode a rank holds two slices of each flat vector of
:class:`._flat.FlatLayout`: its own and its successor's (``rank + 1`` in
member order), both stepped every step from the same averaged gradient,
so they stay bit-identical to the owner's. When a rank dies its slice
survives on its predecessor. At each change of membership every member
sends what it holds (the parameters and the elementwise optimizer state of
its ranges, plus scalar state such as Adam's ``step``) to every other
member, and each rebuilds the slices the new world gives it from the union:
the values do not change, only where they live. Where two members hold
the same elements the one that has taken part in a step wins over a fresh
one (a replacement, or any rank before the first step), then the lower id,
as the first quorum heals everyone from the lowest id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import RpcdistError
from ._flat import FlatLayout, Range

if TYPE_CHECKING:
    from ._ft import FaultTolerance

__all__ = ["Entry", "ShardLostError", "Whole", "held_ranges", "regather"]


class ShardLostError(RpcdistError):
    """A slice and its only copy were lost together (two neighbouring ranks died at once)."""


@dataclass
class Entry:
    """One range ``[lo, hi)`` of a flat vector: its parameters and elementwise state."""

    lo: int
    hi: int
    params: np.ndarray[Any, Any]
    state: dict[str, np.ndarray[Any, Any]] = field(default_factory=dict)


@dataclass
class Whole:
    """One flat vector rebuilt from every member's entries (``numel`` long, unpadded)."""

    params: np.ndarray[Any, Any]
    covered: np.ndarray[Any, Any]
    state: dict[str, np.ndarray[Any, Any]] = field(default_factory=dict)
    state_covered: dict[str, np.ndarray[Any, Any]] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)

    def take(self, key: str, lo: int, hi: int) -> np.ndarray[Any, Any] | None:
        """The state ``key`` on ``[lo, hi)`` (a copy), None if nobody held it there.

        Raises:
            ShardLostError: part of the range is held and part is lost.
        """
        if key not in self.state:
            return None
        cov = self.state_covered[key][lo:hi]
        if cov.all():
            return np.array(self.state[key][lo:hi])
        if cov.any():
            raise ShardLostError(
                f"fault tolerance: the optimizer state {key!r} of elements [{lo}, {hi}) was "
                "lost with its only copy (two neighbouring ranks died in one step)"
            )
        return None


def held_ranges(numel: int, world: int, rank: int) -> list[Range]:
    """The ranges rank ``rank`` keeps of a ``numel``-element vector: its own, its successor's."""
    layout = FlatLayout(numel, world)
    ranks = [rank] if world == 1 else [rank, (rank + 1) % world]
    return [r for r in (layout.owned(q) for q in ranks) if r[1] > r[0]]


def regather(
    ft: FaultTolerance,
    held: list[list[Entry]],
    scalars: list[dict[str, Any]],
    numels: list[int],
    dtypes: list[Any],
    fresh: bool,
) -> list[Whole]:
    """Exchange every member's entries of each vector; each vector rebuilt (collective).

    Args:
        ft: The fault-tolerance object (its current members and mesh).
        held: Per vector, this rank's entries.
        scalars: Per vector, this rank's scalar state.
        numels: Per vector, its length.
        dtypes: Per vector, its parameters' dtype.
        fresh: This rank has not taken part in a step yet (its values lose).

    Raises:
        WorkerLostError, OSError: a member failed during the exchange.
    """
    header: dict[str, Any] = {"fresh": fresh, "vectors": [], "scalars": scalars}
    arrays: list[np.ndarray[Any, Any]] = []
    for entries in held:
        desc = []
        for e in entries:
            keys = sorted(e.state)
            desc.append([e.lo, e.hi, keys])
            arrays.append(e.params)
            arrays.extend(e.state[k] for k in keys)
        header["vectors"].append(desc)
    got = ft._all_gather_frames(header, arrays)
    order = sorted(got, key=lambda m: (not got[m][0]["fresh"], -m))  # the winner writes last
    out = [
        Whole(np.zeros(n, dtype), np.zeros(n, bool))
        for n, dtype in zip(numels, dtypes, strict=True)
    ]
    for m in order:
        head, arrs = got[m]
        it = iter(arrs)
        for v, desc in enumerate(head["vectors"]):
            whole = out[v]
            for lo, hi, keys in desc:
                whole.params[lo:hi] = next(it)
                whole.covered[lo:hi] = True
                for k in keys:
                    arr = next(it)
                    if k not in whole.state:
                        whole.state[k] = np.zeros(numels[v], arr.dtype)
                        whole.state_covered[k] = np.zeros(numels[v], bool)
                    whole.state[k][lo:hi] = arr
                    whole.state_covered[k][lo:hi] = True
            whole.scalars.update(head["scalars"][v])
    return out
