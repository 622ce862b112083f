"""Model agreement across ranks: the same parameters everywhere, rank 0's values.

``check_same_model`` all-gathers a text description of every parameter and
buffer (name, shape, dtype) from every rank and compares them, so a
mismatch raises on every rank with the first difference named, instead of
a collective that hangs or reduces unrelated memory. ``broadcast_tensors``
copies one rank's values to all, one broadcast per dtype and device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import collectives as dist
from .._errors import ConfigError
from ..tensor import Tensor
from ._arrays import global_rank, xp_of

__all__ = ["broadcast_tensors", "check_same_model", "describe"]


def describe(named: Sequence[tuple[str, Tensor]], kind: str) -> list[str]:
    """One line per tensor: ``kind name shape dtype device requires_grad``."""
    return [
        f"{kind} {name} {t.shape} {t.dtype} {t.device} requires_grad={t.requires_grad}"
        for name, t in named
    ]


def check_same_model(lines: list[str], group: dist.ProcessGroup | None, what: str) -> None:
    """Raise on every rank unless every rank described the same model.

    Raises:
        ConfigError: the descriptions differ (the message names the first
            difference and the ranks).
        CollectiveError: a rank failed during the exchange.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return
    mine = np.frombuffer("\n".join(lines).encode(), dtype=np.uint8)
    sizes = [np.zeros(1, np.int64) for _ in range(world)]
    dist.all_gather(sizes, np.array([mine.size], np.int64), group=group)
    texts = [np.empty(int(s[0]), np.uint8) for s in sizes]
    dist.all_gather(texts, mine, group=group)
    ref = texts[0].tobytes().decode().split("\n")
    for r in range(1, world):
        other = texts[r].tobytes().decode().split("\n")
        if other == ref:
            continue
        r0, rr = global_rank(group, 0), global_rank(group, r)
        diff = next(
            (i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other))
        )
        a = ref[diff] if diff < len(ref) else "(nothing more)"
        b = other[diff] if diff < len(other) else "(nothing more)"
        me = "" if rank not in (0, r) else f" (this is rank {global_rank(group, rank)})"
        raise ConfigError(
            f"{what}: the model differs across ranks{me}: rank {r0} has {len(ref)} parameters "
            f"and buffers, rank {rr} has {len(other)}; the first difference is entry {diff}: "
            f"rank {r0} has {a!r}, rank {rr} has {b!r}. Build the same model on every rank."
        )


def broadcast_tensors(
    tensors: Sequence[Tensor], src_rank_in_group: int, group: dist.ProcessGroup | None
) -> None:
    """Copy the values of ``tensors`` on one rank into the same tensors on all ranks.

    Tensors are packed into one flat buffer per (dtype, device) so that a
    model costs a handful of broadcasts, not one per tensor.

    Raises:
        CollectiveError: a rank failed during the broadcast.
    """
    if dist.get_world_size(group) == 1 or not tensors:
        return
    src = global_rank(group, src_rank_in_group)
    is_src = dist.get_rank(group) == src_rank_in_group
    kinds: dict[tuple[str, str], list[Tensor]] = {}
    for t in tensors:
        kinds.setdefault((str(t.dtype), t.device), []).append(t)
    for members in kinds.values():
        xp = xp_of(members[0].data)
        if len(members) == 1 and members[0].data.flags.c_contiguous:
            dist.broadcast(members[0].data, src, group=group)
            continue
        if is_src:
            flat: Any = xp.concatenate([t.data.reshape(-1) for t in members])
        else:
            flat = xp.empty(sum(t.data.size for t in members), members[0].data.dtype)
        dist.broadcast(flat, src, group=group)
        if not is_src:
            off = 0
            for t in members:
                n = t.data.size
                t.data[...] = flat[off : off + n].reshape(t.data.shape)
                off += n
