"""Shared types at the bottom of the package: what one module needs to know of another's object.

The helpers that report a reducer's errors and save an FSDP model's state
take these protocols instead of importing the classes, so the class's
module depends on its helpers and never the reverse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .. import collectives as dist
    from ..tensor import Tensor
    from ._fsdp_unit import Shared

__all__ = ["ReducerView", "ShardedModel"]


class ReducerView(Protocol):
    """What :func:`._unused.raise_unused` reads of a DDP reducer."""

    world: int
    rank: int
    group: dist.ProcessGroup | None
    names: list[str]
    active: list[int] | None
    expected: int


class ShardedModel(Protocol):
    """What :mod:`._fsdp_state` reads of a ``FullyShardedDataParallel``."""

    _shared: Shared
    _param_names: list[str]
    _orig_buffers: list[tuple[str, Tensor]]
