"""The one sharding scheme of ZeRO and FSDP: a flat vector padded to a multiple of the world.

Parameters (of one dtype and device) are laid end to end into one vector of
``numel`` elements, padded with zeros to ``padded`` = the next multiple of
the world size, and rank ``q`` owns ``[q * shard, (q + 1) * shard)`` of it,
``shard = padded / world``. Every rank's slice has the same length, so the
all-gather and the reduce-scatter move equal pieces; only the last ranks'
slices may end in padding. :class:`FlatLayout` is that arithmetic;
:func:`shard_ranges` maps it back onto the individual parameters, as ZeRO
needs (FSDP keeps the vector itself).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["FlatLayout", "Range", "shard_ranges"]

Range = tuple[int, int]


@dataclass(frozen=True)
class FlatLayout:
    """``numel`` elements cut into ``world`` equal slices of a padded vector."""

    numel: int
    world: int

    @property
    def shard(self) -> int:
        """Elements per rank (padding included)."""
        return -(-self.numel // self.world)

    @property
    def padded(self) -> int:
        """The padded vector's length: ``shard * world``."""
        return self.shard * self.world

    def bounds(self, rank: int) -> Range:
        """Rank ``rank``'s slice ``[lo, hi)`` of the padded vector."""
        return rank * self.shard, (rank + 1) * self.shard

    def owned(self, rank: int) -> Range:
        """Rank ``rank``'s slice clipped to the real elements (``lo == hi``: none)."""
        lo, hi = self.bounds(rank)
        return min(lo, self.numel), min(hi, self.numel)


def shard_ranges(sizes: Sequence[int], kinds: Sequence[Hashable], world: int) -> list[list[Range]]:
    """For each rank, for each parameter, the element range ``[lo, hi)`` it owns (pure).

    Parameters of one kind are laid end to end as one :class:`FlatLayout`;
    a parameter's range is its overlap with the rank's slice. An empty
    range is ``(0, 0)``, except that rank 0 owns empty parameters whole.
    """
    out: list[list[Range]] = [[(0, 0)] * len(sizes) for _ in range(world)]
    members: dict[Hashable, list[int]] = {}
    for i, k in enumerate(kinds):
        members.setdefault(k, []).append(i)
    for idx in members.values():
        layout = FlatLayout(sum(sizes[i] for i in idx), world)
        off = 0
        for i in idx:
            for q in range(world):
                a, b = layout.owned(q)
                lo, hi = max(off, a), min(off + sizes[i], b)
                if lo < hi:
                    out[q][i] = (lo - off, hi - off)
            off += sizes[i]
    return out
