"""``ZeroRedundancyOptimizer``: optimizer state sharded across ranks (ZeRO stage 1).

Every parameter is owned by one rank (sorted greedy: largest first, to the
rank with the fewest elements so far). Each rank runs an ordinary optimizer
over the parameters it owns only, so it holds about ``1/p`` of the
optimizer state. ``step()`` updates the owned parameters from their
(already averaged, e.g. by DDP) gradients, then one all-gather per dtype
gives every rank everyone's updated parameters.

``consolidate_state_dict(to)`` gathers the shards into the unsharded
optimizer's ``state_dict()`` on one rank: a checkpoint that loads into the
plain optimizer, or into a ``ZeroRedundancyOptimizer`` at any world size.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .. import collectives as dist
from .._errors import ConfigError
from .._save import load, save
from ..optim import Optimizer
from ..tensor import enable_grad
from ._arrays import global_rank, group_size, xp_of
from ._join import Join, Joinable, JoinHook

__all__ = ["ZeroRedundancyOptimizer", "partition"]

_WHAT = "ZeroRedundancyOptimizer"


def partition(sizes: list[int], world: int) -> list[int]:
    """Owner rank of each parameter: sorted greedy over element counts (pure)."""
    load_ = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load_[r], r))
        owner[i] = r
        load_[r] += sizes[i]
    return owner


class ZeroRedundancyOptimizer(Joinable):
    """Wrap ``optimizer_class`` so each rank keeps the state of its own shard only.

    Args:
        params: Tensors or parameter groups (dicts), as for the optimizer;
            the same on every rank.
        optimizer_class: The optimizer (``rpcdist.optim.SGD``, ``Adam``, ...).
        process_group: The group (None: the default group).
        parameters_as_bucket_view: Keep parameters as views into one flat
            buffer per rank and dtype, so the all-gather writes them in place.
        **defaults: Options for ``optimizer_class``.

    Attributes:
        param_groups: The groups over *all* parameters, as the unsharded
            optimizer has them; change options (``lr``) here.
        optim: This rank's local optimizer (None if it owns nothing).

    Raises:
        ConfigError: no parameters, bad options, or not a member of the group.
    """

    __module__ = "rpcdist.parallel"

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        **defaults: Any,
    ) -> None:
        items = list(params)
        if not items:
            raise ConfigError(f"{_WHAT}: got an empty parameter list")
        self.process_group = process_group
        self.rank, self.world = group_size(process_group, _WHAT)
        self.optimizer_class = optimizer_class
        # The unsharded optimizer, never stepped: it fills every group's
        # options and checks them, and fixes the order of state_dict().
        self._full = optimizer_class(items, **defaults)
        self.param_groups = self._full.param_groups
        self.defaults = self._full.defaults
        self._params = self._full.parameters()
        position = {id(p): i for i, p in enumerate(self._params)}
        self.owner = partition([p.data.size for p in self._params], self.world)
        mine = {i for i, r in enumerate(self.owner) if r == self.rank}
        self._local_index = sorted(mine)  # local position -> global index, in group order
        groups = []
        for g in self.param_groups:
            owned = [p for p in g["params"] if position[id(p)] in mine]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": owned})
        self.optim: Optimizer | None = optimizer_class(groups, **defaults) if mine else None
        self._kinds = self._plan_gather()
        self._consolidated: dict[str, Any] | None = None
        if parameters_as_bucket_view:
            self._bind_views()
        self._as_views = parameters_as_bucket_view

    # ------------------------------------------------------------ gathering

    def _plan_gather(self) -> list[dict[str, Any]]:
        """Per (dtype, device): each rank's parameter indices and flat sizes."""
        kinds: dict[tuple[str, str], list[int]] = {}
        for i, p in enumerate(self._params):
            kinds.setdefault((str(p.dtype), p.device), []).append(i)
        plans = []
        for members in kinds.values():
            per_rank = [[i for i in members if self.owner[i] == r] for r in range(self.world)]
            sizes = [sum(self._params[i].data.size for i in idx) for idx in per_rank]
            first = self._params[members[0]].data
            xp = xp_of(first)
            flats = [xp.empty(s, first.dtype) for s in sizes]
            plans.append({"per_rank": per_rank, "flats": flats})
        return plans

    def _bind_views(self) -> None:
        for plan in self._kinds:
            for idx, flat in zip(plan["per_rank"], plan["flats"]):
                off = 0
                for i in idx:
                    p = self._params[i]
                    n = p.data.size
                    flat[off : off + n] = p.data.reshape(-1)
                    p.data = flat[off : off + n].reshape(p.shape)
                    off += n

    def _all_gather(self) -> None:
        for plan in self._kinds:
            flats, per_rank = plan["flats"], plan["per_rank"]
            mine = flats[self.rank]
            if not self._as_views:
                off = 0
                for i in per_rank[self.rank]:
                    p = self._params[i]
                    mine[off : off + p.data.size] = p.data.reshape(-1)
                    off += p.data.size
            dist.all_gather(
                flats, mine.copy() if self._as_views else mine, group=self.process_group
            )
            if self._as_views:
                continue
            for r, idx in enumerate(per_rank):
                if r == self.rank:
                    continue
                off = 0
                for i in idx:
                    p = self._params[i]
                    p.data[...] = flats[r][off : off + p.data.size].reshape(p.shape)
                    off += p.data.size

    # ----------------------------------------------------------------- step

    def _sync_options(self) -> None:
        if self.optim is None:
            return
        for g, local in zip(self.param_groups, self.optim.param_groups):
            for k, v in g.items():
                if k != "params":
                    local[k] = v

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update this rank's shard from ``.grad``, then share every shard with every rank.

        Gradients must already be averaged across the group (DDP does it).

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.

        Raises:
            CollectiveError: the all-gather failed.
        """
        Join.notify_join_context(self)
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        self._local_step()
        return loss

    def _local_step(self) -> None:
        self._sync_options()
        if self.optim is not None:
            self.optim.step()
        self._all_gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the ``.grad`` of every parameter (not only this rank's shard)."""
        self._full.zero_grad(set_to_none)

    # ------------------------------------------------------------ checkpoints

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every shard's state on rank ``to`` (collective: call it on every rank).

        Args:
            to: The rank (in the group) that will hold the full state dict.

        Raises:
            ConfigError: ``to`` is not a rank of the group.
            CollectiveError: the gather failed.
        """
        if not 0 <= to < self.world:
            raise ConfigError(f"consolidate_state_dict: to={to} is not in [0, {self.world})")
        state: dict[int, Any] = {}
        if self.optim is not None:
            local = self.optim.state_dict()["state"]
            state = {self._local_index[int(k)]: v for k, v in local.items()}
        raw = io.BytesIO()
        save({"state": state}, raw)
        mine = np.frombuffer(raw.getvalue(), np.uint8)
        sizes = [np.zeros(1, np.int64) for _ in range(self.world)]
        dist.all_gather(sizes, np.array([mine.size], np.int64), group=self.process_group)
        dst = global_rank(self.process_group, to)
        parts = [np.empty(int(s[0]), np.uint8) for s in sizes] if self.rank == to else None
        dist.gather(mine, parts, dst=dst, group=self.process_group)
        self._consolidated = None
        if parts is None:
            return
        merged: dict[int, Any] = {}
        for part in parts:
            merged.update(load(io.BytesIO(part.tobytes()))["state"])
        full = self._full.state_dict()  # groups, with global indices; no state
        full["state"] = {int(k): merged[k] for k in sorted(merged)}
        self._consolidated = full

    def state_dict(self) -> dict[str, Any]:
        """The unsharded optimizer's state dict, on the rank ``consolidate_state_dict`` chose.

        Raises:
            ConfigError: ``consolidate_state_dict`` was not called, or chose
                another rank.
        """
        if self._consolidated is None:
            raise ConfigError(
                f"{_WHAT}.state_dict(): call consolidate_state_dict(to=rank) on every rank "
                "first; the state dict is then available on that rank only "
                f"(this is rank {self.rank} of the group)"
            )
        sd = self._consolidated
        groups = [{**g} for g in self.param_groups]
        for saved, g in zip(sd["param_groups"], groups):
            saved.update({k: v for k, v in g.items() if k != "params"})
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full (unsharded) state dict; every rank keeps its own shard.

        Raises:
            ConfigError: the groups do not match this optimizer's.
        """
        # Checks the groups and sets their options; the state is taken below.
        self._full.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        if self.optim is None:
            return
        index = {int(k): v for k, v in state_dict["state"].items()}
        local_state = {pos: index[g] for pos, g in enumerate(self._local_index) if g in index}
        local_groups = self.optim.state_dict()["param_groups"]
        for lg, g in zip(local_groups, self.param_groups):
            lg.update({k: v for k, v in g.items() if k != "params"})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})

    # ------------------------------------------------------------------ Join

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Shadow ``step()`` on a rank that ran out of inputs.

        The joined rank steps its shard with the ``.grad`` that DDP's join
        hook left there (the average of the ranks still training), then
        takes part in the all-gather, so every shard stays up to date. Put
        the DDP model before this optimizer in ``Join``.
        """
        return _ZeroJoinHook(self)

    @property
    def join_process_group(self) -> dist.ProcessGroup | None:
        """The group the parameters are gathered over."""
        return self.process_group

    def statistics(self) -> dict[str, Any]:
        """Parameters and optimizer-state bytes held here, against all of them."""
        held = 0
        if self.optim is not None:
            for st in self.optim.state.values():
                held += sum(getattr(v, "nbytes", 0) for v in st.values())
        return {
            "zero_params_owned": len(self._local_index),
            "zero_params_total": len(self._params),
            "zero_state_bytes": held,
        }


class _ZeroJoinHook(JoinHook):
    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero._local_step()
