"""Small helpers over NumPy and CuPy arrays (CuPy imported only when seen)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .. import collectives as dist
from .._errors import ConfigError
from .._futures import Future

__all__ = ["future_of", "global_rank", "group_size", "host", "is_cupy", "xp_of"]


def is_cupy(arr: Any) -> bool:
    """Whether ``arr`` is a CuPy array."""
    return type(arr).__module__.startswith("cupy")


def xp_of(arr: Any) -> ModuleType:
    """NumPy or CuPy, whichever ``arr`` belongs to."""
    if is_cupy(arr):
        import cupy

        mod: ModuleType = cupy
        return mod
    return np


def host(arr: Any) -> np.ndarray[Any, Any]:
    """``arr`` as a NumPy array (a copy from the GPU, the array itself on the host)."""
    return arr.get() if is_cupy(arr) else np.asarray(arr)  # type: ignore[no-any-return]


def group_size(group: dist.ProcessGroup | None, what: str) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size.

    Raises:
        ConfigError: this process is not a member of ``group``.
    """
    rank = dist.get_rank(group)
    if rank < 0:
        me = dist.get_rank()
        ranks = list(group.ranks) if group is not None else []
        raise ConfigError(
            f"{what}: this process (global rank {me}) is not a member of the process group "
            f"(ranks {ranks}); create it only on the group's members"
        )
    return rank, dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    """The global rank of the member ``rank_in_group`` of ``group`` (None: the world)."""
    return rank_in_group if group is None else int(group.ranks[rank_in_group])


def future_of(work: Any) -> Future[Any]:
    """The :class:`rpcdist.Future` of an ``async_op=True`` collective's Work."""
    fut: Future[Any] = work.get_future()
    return fut
