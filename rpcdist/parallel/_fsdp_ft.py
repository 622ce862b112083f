"""``FullyShardedDataParallel`` in the fault-tolerant mode (``fault_tolerance=ft``).

Each unit's shard parameter holds two padded slices of the unit's flat
vector (:mod:`._ft_shard`): this member's own and its successor's, so the
optimizer over ``model.parameters()`` steps both and keeps their state. A
forward all-gathers the members' own slices over the fault-tolerance mesh;
a backward keeps each unit's flat gradient local, and ``ft.commit()``
averages them with everything else it averages, then hands each unit the
two slices of the average it holds. A failed gather fills zeros and marks
the step failed (the vote is ``ok=False``; the step is redone). At each
change of membership the units are re-sharded for the new world from the
members' slices; before the first quorum every rank holds its whole model,
and the lowest id's values win, as DDP broadcasts rank 0's. Under
``no_shard`` a unit's shard is its whole vector (nothing to gather) and
stays so at every membership. Mixed precision rounds as a process group's
collectives would (:meth:`FlatUnit.ft_reduced`). The module's buffers (such
as running statistics) are no shards: a joiner takes them, bit for bit, with
the live state from the member that heals it (``_ft_heal.py``), so at the
first quorum every rank has the lowest id's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..tensor import Tensor
from ..tensor._device import move_to
from ._arrays import host
from ._flat import FlatLayout
from ._ft_shard import Entry, ShardLostError, regather

if TYPE_CHECKING:
    from ._fsdp_unit import FlatUnit
    from ._ft import FaultTolerance
    from ._types import ShardedModel

__all__ = ["FsdpFaultTolerance"]


class FsdpFaultTolerance:
    """The fault-tolerant side of one root ``FullyShardedDataParallel`` (registered with ``ft``)."""

    def __init__(self, model: ShardedModel, ft: FaultTolerance) -> None:
        self.model, self.ft = model, ft
        self.units: list[FlatUnit] = model._shared.units
        self.optimizers: list[Any] = []
        self.fresh = True
        ft._add_sharded(self)

    # -- what FaultTolerance calls ------------------------------------------------------

    def _ft_adopts(self, obj: Any) -> str | None:
        if obj is self.model:
            return "whole"
        shards = {id(u.shard) for u in self.units}
        groups = getattr(obj, "param_groups", None) or []
        if any(id(p) in shards for g in groups for p in g["params"]):
            if obj not in self.optimizers:
                self.optimizers.append(obj)
            return "options"
        return None

    def _trained(self) -> list[FlatUnit]:
        return [u for u in self.units if u.shard.requires_grad]

    def _ft_grads(self) -> np.ndarray[Any, Any]:
        parts = [
            np.zeros(u.numel) if u.ft_flat is None else np.asarray(host(u.ft_flat), np.float64)
            for u in self._trained()
        ]
        return np.concatenate(parts) if parts else np.zeros(0)

    def _ft_write(self, avg: np.ndarray[Any, Any]) -> None:
        at = 0
        for u in self._trained():
            g = u.ft_reduced(u.my_piece(avg[at : at + u.numel])).astype(u.dtype)
            u.shard.grad = Tensor._wrap(u.xp.asarray(g))
            u.ft_flat = None
            at += u.numel

    def _ft_prepare(self) -> None:
        pass  # the optimizer steps the shards after the commit; nothing to exchange

    def _ft_finish(self, committed: bool) -> None:
        pass

    def _ft_live(self) -> dict[str, Any]:
        """What goes to a joiner beside the shards: the module's buffers, by name."""
        return {name: np.array(host(b.data)) for name, b in self.model._orig_buffers}

    def _ft_take_live(self, live: dict[str, Any]) -> None:
        """A member's buffers (:meth:`_ft_live`), copied into this rank's, bit for bit."""
        for name, b in self.model._orig_buffers:
            if name in live:
                b.data[...] = move_to(live[name], b.device)

    def _ft_reshard(self) -> None:
        sh = self.model._shared
        held, scalars = [], []
        for u in self.units:
            entries, sc = self._held(u)
            held.append(entries)
            scalars.append(sc)
        numels = [u.numel for u in self.units]
        dtypes = [u.dtype for u in self.units]
        wholes = regather(self.ft, held, scalars, numels, dtypes, self.fresh)
        for u, whole in zip(self.units, wholes, strict=True):
            if not whole.covered.all():
                raise ShardLostError(
                    f"fault tolerance: a slice of FSDP unit {u.index} was lost with its only "
                    "copy (two neighbouring ranks died in one step)"
                )
        for u in self.units:
            u.free()
        sh.rank, sh.world = self.ft.rank, self.ft.world_size
        sh.kept = False
        for u, whole in zip(self.units, wholes, strict=True):
            u.layout = FlatLayout(u.numel, sh.world if sh.sharded else 1)
            u.padded, u.shard_size = u.layout.padded, u.layout.shard
            u._buf = u._mm = None  # made again at the new size
            u.acc = u.ft_flat = None
            u.shard.data = u.xp.asarray(u.my_piece(whole.params))
            if not sh.sharded:  # no_shard: the module computes on the shard itself
                u._buf = u.shard.data
            u.shard.grad = None
            for opt in self.optimizers:
                st: dict[str, Any] = {}
                for k in whole.state:
                    arr = whole.take(k, 0, u.numel)
                    if arr is not None:
                        st[k] = u.xp.asarray(u.my_piece(arr))
                if st:
                    st.update(whole.scalars)
                    opt.state[u.shard] = st
        self.fresh = False

    def _held(self, u: FlatUnit) -> tuple[list[Entry], dict[str, Any]]:
        data = host(u.shard.data)
        if self.fresh:  # the whole unit, as constructed
            return [Entry(0, u.numel, data[: u.numel])], {}
        state: dict[str, Any] = {}
        for opt in self.optimizers:
            state.update(opt.state.get(u.shard, {}))
        scalars = {k: v for k, v in state.items() if getattr(v, "shape", ()) != u.shard.shape}
        arrays = {k: host(v) for k, v in state.items() if k not in scalars}
        entries, at = [], 0
        for b0, b1 in u.ft_bounds():
            lo, hi = min(b0, u.numel), min(b1, u.numel)
            if hi > lo:
                n = hi - lo
                part = {k: v[at : at + n] for k, v in arrays.items()}
                entries.append(Entry(lo, hi, data[at : at + n], part))
            at += b1 - b0
        scalars = {k: v.item() if hasattr(v, "item") else v for k, v in scalars.items()}
        return entries, scalars
