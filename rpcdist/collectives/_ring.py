"""Pure schedules for the collective algorithms: no I/O, no event loop.

Everything here is arithmetic on ranks and lengths, tested alone:

* :func:`split` cuts ``n`` items into ``parts`` contiguous segments whose
  sizes differ by at most one (the larger ones first).
* :func:`rs_step` and :func:`ag_step` are the ring schedule: which segment
  rank ``r`` of ``p`` sends to its right neighbour and which it receives from
  its left one at each step of reduce-scatter and of all-gather. After the
  ``p - 1`` reduce-scatter steps rank ``r`` holds the full reduction of
  segment ``r``; after the ``p - 1`` all-gather steps everyone holds all.
* :func:`lane_count` and :func:`lanes` cut every segment into the same
  number of chunks ("lanes"): lane ``k`` is chunk ``k`` of each segment, an
  independent small ring, so several lanes in flight pipeline sending,
  receiving and reducing.
* Trees, chains and the dissemination barrier for the rooted collectives.
* :func:`simulate_ring_allreduce` runs the schedule on in-memory lists, an
  executable statement of the algorithm for property tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = [
    "ag_step",
    "chain_neighbours",
    "dissemination_peers",
    "lane_count",
    "lanes",
    "offsets",
    "rs_step",
    "simulate_ring_allreduce",
    "split",
    "tree_children",
    "tree_parent",
]

T = TypeVar("T")


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` ranges covering ``range(n)``.

    Sizes differ by at most one; the first ``n % parts`` ranges are the
    longer ones. Empty ranges appear when ``n < parts``.

    Raises:
        ValueError: ``parts < 1`` or ``n < 0``.
    """
    if parts < 1 or n < 0:
        raise ValueError(f"cannot split {n} items into {parts} parts")
    base, extra = divmod(n, parts)
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def offsets(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ``(start, stop)`` ranges of the given sizes, from 0."""
    out: list[tuple[int, int]] = []
    start = 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def rs_step(rank: int, p: int, step: int) -> tuple[int, int]:
    """Reduce-scatter step ``step`` (``0 <= step < p - 1``) of ``rank``.

    Returns ``(send_segment, recv_segment)``: send the partial sum of
    ``send_segment`` to ``rank + 1``, receive ``recv_segment`` from
    ``rank - 1`` and combine it with the local contribution. Rank ``r``
    receives its own segment ``r`` at the last step.
    """
    return (rank - step - 1) % p, (rank - step - 2) % p


def ag_step(rank: int, p: int, step: int) -> tuple[int, int]:
    """All-gather step ``step`` of ``rank``: ``(send_segment, recv_segment)``.

    Rank ``r`` starts with segment ``r`` complete and forwards, at each step,
    the segment it received at the previous one.
    """
    return (rank - step) % p, (rank - step - 1) % p


def lane_count(sizes: Sequence[int], chunk: int) -> int:
    """How many lanes cut the largest segment into chunks of at most ``chunk``."""
    largest = max(sizes, default=0)
    return max(1, -(-largest // max(1, chunk)))


def lanes(size: int, count: int) -> list[tuple[int, int]]:
    """The ``count`` lane ranges of one segment of ``size`` items."""
    return split(size, count)


def tree_parent(rel: int) -> int:
    """Parent of ``rel`` (rank relative to the root) in the binomial tree; -1 for the root."""
    if rel == 0:
        return -1
    return rel & (rel - 1)  # clear the lowest set bit


def tree_children(rel: int, p: int) -> list[int]:
    """Children of ``rel`` in the binomial tree over ``p`` ranks, farthest first.

    Sending to the farthest child first lets the biggest subtree start early.
    """
    out: list[int] = []
    bit = 1
    while bit < p:
        if rel & bit:
            break
        child = rel | bit
        if child < p:
            out.append(child)
        bit <<= 1
    out.reverse()
    return out


def chain_neighbours(rel: int, p: int) -> tuple[int, int]:
    """``(prev, next)`` of ``rel`` in the chain ``0 -> 1 -> ... -> p-1``; -1 at the ends."""
    return (rel - 1 if rel > 0 else -1, rel + 1 if rel + 1 < p else -1)


def dissemination_peers(rank: int, p: int) -> list[tuple[int, int]]:
    """Rounds of the dissemination barrier: ``(send_to, recv_from)`` per round.

    After ``ceil(log2 p)`` rounds every rank has heard, directly or
    transitively, from every other rank.
    """
    out: list[tuple[int, int]] = []
    dist = 1
    while dist < p:
        out.append(((rank + dist) % p, (rank - dist) % p))
        dist <<= 1
    return out


def simulate_ring_allreduce(
    inputs: Sequence[Sequence[T]], combine: Callable[[T, T], T], chunk: int = 1 << 30
) -> list[list[T]]:
    """Run the lane-pipelined ring schedule on lists; one result list per rank.

    Messages are delivered in the ring's step order with explicit per-rank
    mailboxes, so a wrong schedule shows up as a wrong value or a missing
    message (``KeyError``).

    Raises:
        ValueError: the inputs differ in length.
    """
    p = len(inputs)
    n = len(inputs[0]) if p else 0
    if any(len(x) != n for x in inputs):
        raise ValueError("every rank needs an input of the same length")
    segs = split(n, p)
    count = lane_count([b - a for a, b in segs], chunk)
    lane_ranges = [[(a + s, a + e) for s, e in lanes(b - a, count)] for a, b in segs]
    acc = [list(x) for x in inputs]
    for lane in range(count):
        for step in range(p - 1):
            wire: dict[int, list[T]] = {}
            for r in range(p):
                send, _ = rs_step(r, p, step)
                a, b = lane_ranges[send][lane]
                wire[(r + 1) % p] = acc[r][a:b]
            for r in range(p):
                _, recv = rs_step(r, p, step)
                a, b = lane_ranges[recv][lane]
                got = wire.pop(r)
                acc[r][a:b] = [combine(x, y) for x, y in zip(inputs[r][a:b], got)]
        for step in range(p - 1):
            wire = {}
            for r in range(p):
                send, _ = ag_step(r, p, step)
                a, b = lane_ranges[send][lane]
                wire[(r + 1) % p] = acc[r][a:b]
            for r in range(p):
                _, recv = ag_step(r, p, step)
                a, b = lane_ranges[recv][lane]
                acc[r][a:b] = wire.pop(r)
    return acc
