"""Shared types at the bottom of the package: what one module needs to know of another's object.

The helpers that report a reducer's errors, save an FSDP model's state or
re-shard a model or a ZeRO optimizer in the fault-tolerant mode take these
protocols instead of importing the classes, so the class's
module depends on its helpers and never the reverse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .. import collectives as dist
    from ..optim import Optimizer
    from ..tensor import Tensor
    from ._fsdp_unit import Shared

__all__ = ["ReducerView", "ShardedModel", "ZeroView"]


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


class ZeroView(Protocol):
    """What :mod:`._zero_ft` reads and sets of a ``ZeroRedundancyOptimizer``."""

    _params: list[Tensor]
    _pieces: list[tuple[int, Tensor]]
    _full: Optimizer
    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    optimizer_class: type[Optimizer]
    optim: Optimizer | None
    rank: int
    world: int
    ranges: list[list[tuple[int, int]]]
