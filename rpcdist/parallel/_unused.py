"""The error for parameters that got no gradient, raised on every rank at once.

Every rank sees the same summed flags, so every rank decides the same way
to come here; one all-gather of the per-rank flags then lets each rank name
the ranks that differ, and nobody waits on a collective the others skipped.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np

from .. import collectives as dist
from .._errors import AutogradError
from ._arrays import global_rank
from ._types import ReducerView

__all__ = ["raise_unused"]

_SHOW = 8  # names listed per rank before "..."


def _names(names: list[str]) -> str:
    if len(names) <= _SHOW:
        return repr(names)
    return repr(names[:_SHOW])[:-1] + f", ... ({len(names)} in all)]"


def raise_unused(
    reducer: ReducerView, bad: list[int], counts: list[int], used: list[int], shadow: bool
) -> NoReturn:
    """Gather every rank's flags and raise the error that names parameters and ranks.

    Args:
        reducer: The reducer of the failed iteration.
        bad: Parameters whose count differs from the ranks expected.
        counts: Per parameter, on how many ranks it got a gradient.
        used: This rank's flags.
        shadow: This rank has joined (Join) and only shadowed the iteration.

    Raises:
        AutogradError: always (after the all-gather).
    """
    n, world, group = len(used), reducer.world, reducer.group
    mine = np.asarray(used, dtype=np.uint8)
    everyone = [np.empty(n, np.uint8) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    names = reducer.names
    here = [names[i] for i in bad if not used[i]]
    per_rank = []
    for r in range(world):
        missing = [names[i] for i in bad if not everyone[r][i]]
        joined = reducer.active is not None and r not in reducer.active
        who = f"rank {global_rank(group, r)}" + (" (joined)" if joined else "")
        per_rank.append(f"{who}: " + (f"no gradient for {_names(missing)}" if missing else "all"))
    me = global_rank(group, reducer.rank)
    where = (
        "this rank has joined and only shadowed the iteration"
        if shadow
        else f"on this rank ({me}) no gradient reached {_names(here)}"
        if here
        else f"this rank ({me}) got every gradient, other ranks did not"
    )
    raise AutogradError(
        f"DistributedDataParallel: expected every parameter to get a gradient on each of the "
        f"{reducer.expected} ranks taking part in this iteration, but {len(bad)} did not "
        f"({where}). Per rank: {'; '.join(per_rank)}. Counts of ranks with a gradient: "
        f"{ {names[i]: counts[i] for i in bad[:_SHOW]} }. If some parameters do not take part "
        "in the loss in some iterations, pass find_unused_parameters=True (or static_graph=True "
        "when the set never changes); otherwise make every rank run the same computation."
    )
