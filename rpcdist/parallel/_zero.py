"""``ZeroRedundancyOptimizer``: optimizer state sharded across ranks (ZeRO stage 1).

The parameters of each dtype and device are laid end to end, padded to a
multiple of ``p`` and cut into ``p`` equal slices, one per rank: the
scheme FSDP's units use too (:mod:`._flat`). A rank owns its slice, which may start and end
inside parameters: for each parameter it overlaps, a *piece* (a flat view
of that part of the parameter's data) is handed to an ordinary optimizer,
so the rank holds optimizer state for ``1/p`` of the elements, whatever the
sizes of the individual parameters. (PyTorch's implementation assigns
whole parameters, which leaves one rank with most of the state when a few
parameters dominate.) Pieces are views: the optimizer updates the
parameters in place, and each piece's gradient is a view of the
parameter's ``.grad``; a parameter without a gradient is skipped as the
unsharded optimizer skips it. This needs an elementwise optimizer (SGD,
Adam, AdamW are).

``step()`` updates the owned pieces from their (already averaged, e.g. by
DDP) gradients, then one all-gather per dtype and device hands every rank
everyone's slices. ``consolidate_state_dict(to)`` joins the pieces' states
into the unsharded optimizer's ``state_dict()`` on one rank: a checkpoint
that loads into the plain optimizer, or into a ``ZeroRedundancyOptimizer``
at any world size.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .. import collectives as dist
from .._errors import ConfigError
from ..optim import Optimizer
from ..tensor import Tensor, enable_grad
from ._arrays import global_rank, group_size, host, xp_of
from ._flat import FlatLayout, Range, shard_ranges
from ._ft import FaultTolerance
from ._join import Join, Joinable, JoinHook
from ._zero_ft import ZeroFaultTolerance

__all__ = ["ZeroRedundancyOptimizer", "shard_ranges"]

_WHAT = "ZeroRedundancyOptimizer"


def _owns(r: Range, size: int, rank: int) -> bool:
    return r[1] > r[0] or (size == 0 and rank == 0)


class ZeroRedundancyOptimizer(Joinable):
    """Wrap ``optimizer_class`` so each rank keeps the state of its slice of the elements only.

    Args:
        params: Tensors or parameter groups (dicts), as for the optimizer;
            the same on every rank.
        optimizer_class: An elementwise optimizer (``rpcdist.optim.SGD``,
            ``Adam``, ``AdamW``).
        process_group: The group (None: the default group).
        parameters_as_bucket_view: Make the parameters views into one flat
            buffer per dtype and device, so the all-gather writes them in
            place instead of copying out.
        fault_tolerance: A :class:`FaultTolerance`: no process group; the
            slices are re-sharded over each step's members, each rank also
            keeping its successor's (``docs/fault-tolerance.md``); the
            update runs inside ``fault_tolerance.commit()`` (before the
            vote, undone if the step does not commit) and ``step()`` then
            adds nothing.
        **defaults: Options for ``optimizer_class``.

    Attributes:
        param_groups: The groups over *all* parameters, as the unsharded
            optimizer has them; change options (``lr``) here.
        optim: This rank's local optimizer over its pieces (None if it owns
            no element).

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
        fault_tolerance: FaultTolerance | None = None,
        **defaults: Any,
    ) -> None:
        items = list(params)
        if not items:
            raise ConfigError(f"{_WHAT}: got an empty parameter list")
        self.process_group = process_group
        self.fault_tolerance = fault_tolerance
        if fault_tolerance is None:
            self.rank, self.world = group_size(process_group, _WHAT)
        else:  # the members of each step: see _zero_ft.py
            self.rank, self.world = 0, 1
        self.optimizer_class = optimizer_class
        # The unsharded optimizer, never stepped: it fills in and checks every
        # group's options, and fixes the parameter order of state_dict().
        self._full = optimizer_class(items, **defaults)
        self.param_groups = self._full.param_groups
        self.defaults = self._full.defaults
        self._params = self._full.parameters()
        for p in self._params:
            if not p.data.flags.c_contiguous:
                p.data = xp_of(p.data).ascontiguousarray(p.data)
        sizes = [p.data.size for p in self._params]
        kinds = [(str(p.dtype), p.device) for p in self._params]
        self.ranges = shard_ranges(sizes, kinds, self.world)
        self._as_views = parameters_as_bucket_view
        self._kinds = self._plan_gather(kinds)
        if parameters_as_bucket_view:
            self._bind_views()
        self._pieces: list[tuple[int, Tensor]] = []
        self.optim: Optimizer | None = self._local_optimizer(defaults)
        self._consolidated: dict[str, Any] | None = None
        self._ft = None if fault_tolerance is None else ZeroFaultTolerance(self, fault_tolerance)

    def _local_optimizer(self, defaults: Mapping[str, Any]) -> Optimizer | None:
        position = {id(p): i for i, p in enumerate(self._params)}
        mine = self.ranges[self.rank]
        groups = []
        for g in self.param_groups:
            pieces = []
            for p in g["params"]:
                i = position[id(p)]
                if _owns(mine[i], p.data.size, self.rank):
                    lo, hi = mine[i]
                    piece = Tensor(p.data.reshape(-1)[lo:hi])
                    self._pieces.append((i, piece))
                    pieces.append(piece)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": pieces})
        if not self._pieces:
            return None
        return self.optimizer_class(groups, **defaults)

    # ------------------------------------------------------------ gathering

    def _plan_gather(self, kinds: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Per dtype and device: its padded flat vector, and each rank's slice as parts.

        A part is ``(parameter, lo, hi, offset in the rank's slice)``.
        """
        members: dict[tuple[str, str], list[int]] = {}
        for i, k in enumerate(kinds):
            members.setdefault(k, []).append(i)
        plans = []
        for idx in members.values():
            layout = FlatLayout(sum(self._params[i].data.size for i in idx), self.world)
            parts: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.world)]
            starts, off = {}, 0
            for i in idx:
                starts[i] = off
                for q in range(self.world):
                    lo, hi = self.ranges[q][i]
                    if hi > lo:
                        parts[q].append((i, lo, hi, off + lo - layout.bounds(q)[0]))
                off += self._params[i].data.size
            first = self._params[idx[0]].data
            whole = xp_of(first).zeros(layout.padded, first.dtype)
            slices = [whole[slice(*layout.bounds(q))] for q in range(self.world)]
            plans.append(
                {
                    "members": idx,
                    "starts": starts,
                    "layout": layout,
                    "parts": parts,
                    "whole": whole,
                    "slices": slices,
                }
            )
        return plans

    def _bind_views(self) -> None:
        """Make each parameter a view into its kind's flat buffer (values kept)."""
        for plan in self._kinds:
            off = 0
            for i in plan["members"]:
                p = self._params[i]
                n = p.data.size
                plan["whole"][off : off + n] = p.data.reshape(-1)
                p.data = plan["whole"][off : off + n].reshape(p.shape)
                off += n

    def _all_gather(self) -> None:
        for plan in self._kinds:
            slices, parts = plan["slices"], plan["parts"]
            if self._as_views:  # the parameters live in ``slices``: gather straight there
                dist.all_gather(slices, slices[self.rank].copy(), group=self.process_group)
                continue
            mine = slices[self.rank]
            for i, lo, hi, off in parts[self.rank]:
                mine[off : off + hi - lo] = self._params[i].data.reshape(-1)[lo:hi]
            dist.all_gather(slices, mine, group=self.process_group)
            for q in range(self.world):
                if q == self.rank:
                    continue
                for i, lo, hi, off in parts[q]:
                    self._params[i].data.reshape(-1)[lo:hi] = slices[q][off : off + hi - lo]

    # ----------------------------------------------------------------- step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update this rank's slice from ``.grad``, then share every slice with every rank.

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
        if self._ft is None:  # with fault tolerance the step ran in commit() (_zero_ft.py)
            self._local_step()
        return loss

    def _local_step(self) -> None:
        if self.optim is not None:
            for g, local in zip(self.param_groups, self.optim.param_groups):
                for k, v in g.items():
                    if k != "params":
                        local[k] = v
            mine = self.ranges[self.rank]
            for i, piece in self._pieces:
                grad = self._params[i].grad
                lo, hi = mine[i]
                piece.grad = None if grad is None else Tensor(grad.data.reshape(-1)[lo:hi])
            self.optim.step()
        self._all_gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the ``.grad`` of every parameter (not only this rank's slice)."""
        self._full.zero_grad(set_to_none)

    # ------------------------------------------------------------ checkpoints

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every slice's state on rank ``to`` (collective: call it on every rank).

        With ``fault_tolerance``, every member of the step calls it at the same
        step, and ``to`` is an index among the members (``ft.rank``).

        Args:
            to: The rank (in the group) that will hold the full state dict.

        Raises:
            ConfigError: ``to`` is not a rank of the group, or the optimizer
                keeps state that is not elementwise.
            CollectiveError: the gather failed.
            WorkerLostError: with ``fault_tolerance``, a member failed during
                it; the step is redone (call it again after the next commit).
        """
        if self._ft is not None:  # over this step's members (_zero_ft.py)
            self._consolidated = self._ft.consolidate(to)
            return
        if not 0 <= to < self.world:
            raise ConfigError(f"consolidate_state_dict: to={to} is not in [0, {self.world})")
        metas = _all_gather_json(self._state_meta(), self.process_group, self.world)
        bad = sorted(
            {(i, k) for m in metas for i, st in m.items() for k, t in st.items() if t[0] == "x"}
        )
        if bad:
            i, k = bad[0]
            raise ConfigError(
                f"{_WHAT}: state {k!r} of parameter {i} is neither a scalar nor one value per "
                f"element; {self.optimizer_class.__name__} is not elementwise"
            )
        dst = global_rank(self.process_group, to)
        full: dict[int, dict[str, Any]] = {}
        for m in metas:  # the scalars (e.g. Adam's step): the same on every piece
            for i, st in m.items():
                for k, (kind, value) in st.items():
                    if kind == "s":
                        full.setdefault(int(i), {})[k] = value
        for plan in self._kinds:
            for key, dtype in self._elementwise_keys(plan, metas):
                whole = self._gather_state(plan, key, dtype, to, dst)
                if whole is None:
                    continue
                for i in plan["members"]:
                    if any(key in m.get(str(i), {}) for m in metas):
                        at, p = plan["starts"][i], self._params[i]
                        full.setdefault(i, {})[key] = whole[at : at + p.data.size].reshape(p.shape)
        self._consolidated = None
        if self.rank != to:
            return
        sd = self._full.state_dict()  # groups with global indices; no state
        sd["state"] = {i: full[i] for i in sorted(full)}
        self._consolidated = sd

    def _state_meta(self) -> dict[str, dict[str, tuple[str, Any]]]:
        """Per held parameter and state key: ``("e", dtype)`` elementwise, ``("s", value)``
        scalar, or ``("x", shape)`` neither."""
        out: dict[str, dict[str, tuple[str, Any]]] = {}
        if self.optim is None:
            return out
        mine = self.ranges[self.rank]
        for i, piece in self._pieces:
            st = self.optim.state.get(piece) or {}
            lo, hi = mine[i]
            for k, v in st.items():
                if getattr(v, "ndim", 0) == 1 and v.size == hi - lo:
                    out.setdefault(str(i), {})[k] = ("e", str(v.dtype))
                elif getattr(v, "ndim", 0) == 0:
                    value = v.item() if hasattr(v, "item") else v
                    out.setdefault(str(i), {})[k] = ("s", value)
                else:
                    out.setdefault(str(i), {})[k] = ("x", list(v.shape))
        return out

    @staticmethod
    def _elementwise_keys(plan: dict[str, Any], metas: list[dict[str, Any]]) -> list[Any]:
        keys = set()
        for m in metas:
            for i in plan["members"]:
                for k, (kind, dtype) in m.get(str(i), {}).items():
                    if kind == "e":
                        keys.add((k, dtype))
        return sorted(keys)

    def _gather_state(
        self, plan: dict[str, Any], key: str, dtype: str, to: int, dst: int
    ) -> np.ndarray[Any, Any] | None:
        """One elementwise state laid out as the kind's padded vector, gathered on ``to``."""
        layout = plan["layout"]
        mine = np.zeros(layout.shard, dtype)
        pieces = dict(self._pieces)
        for i, lo, hi, off in plan["parts"][self.rank]:
            st = self.optim.state.get(pieces[i]) if self.optim is not None else None
            if st and key in st:
                mine[off : off + hi - lo] = host(st[key])
        parts = (
            [np.empty(layout.shard, dtype) for _ in range(self.world)] if self.rank == to else None
        )
        dist.gather(mine, parts, dst=dst, group=self.process_group)
        return None if parts is None else np.concatenate(parts)

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
        for saved, g in zip(sd["param_groups"], self.param_groups):
            saved.update({k: v for k, v in g.items() if k != "params"})
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full (unsharded) state dict; every rank keeps its own slice.

        Raises:
            ConfigError: the groups do not match this optimizer's.
        """
        # Checks the groups and sets their options; the state is taken below.
        self._full.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        if self.optim is None:
            return
        full = {int(k): v for k, v in state_dict["state"].items()}
        mine = self.ranges[self.rank]
        local: dict[int, Any] = {}
        for pos, (i, _piece) in enumerate(self._pieces):
            st = full.get(i)
            if st is None:
                continue
            lo, hi = mine[i]
            size = self._params[i].data.size
            local[pos] = {
                k: v.reshape(-1)[lo:hi] if getattr(v, "ndim", 0) and v.size == size else v
                for k, v in st.items()
            }
        groups = self.optim.state_dict()["param_groups"]
        for lg, g in zip(groups, self.param_groups):
            lg.update({k: v for k, v in g.items() if k != "params"})
        self.optim.load_state_dict({"state": local, "param_groups": groups})

    # ------------------------------------------------------------------ Join

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Shadow ``step()`` on a rank that ran out of inputs.

        The joined rank steps its slice with the ``.grad`` that DDP's join
        hook left there (the average of the ranks still training), then
        takes part in the all-gather, so every slice stays current. Put the
        DDP model before this optimizer in ``Join``.
        """
        return _ZeroJoinHook(self)

    @property
    def join_process_group(self) -> dist.ProcessGroup | None:
        """The group the parameters are gathered over."""
        return self.process_group

    def statistics(self) -> dict[str, Any]:
        """Elements owned here against all, and the optimizer-state bytes held here."""
        held = 0
        if self.optim is not None:
            for st in self.optim.state.values():
                held += sum(getattr(v, "nbytes", 0) for v in st.values())
        mine = self.ranges[self.rank]
        return {
            "zero_elements_owned": sum(hi - lo for lo, hi in mine),
            "zero_elements_total": sum(p.data.size for p in self._params),
            "zero_state_bytes": held,
        }


class _ZeroJoinHook(JoinHook):
    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero._local_step()


def _all_gather_json(obj: Any, group: dist.ProcessGroup | None, world: int) -> list[Any]:
    """Every rank's small JSON-able ``obj`` (two all-gathers: lengths, then bytes)."""
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = [np.zeros(1, np.int64) for _ in range(world)]
    dist.all_gather(sizes, np.array([raw.size], np.int64), group=group)
    n = max(int(s[0]) for s in sizes)
    outs = [np.zeros(n, np.uint8) for _ in range(world)]
    mine = np.zeros(n, np.uint8)
    mine[: raw.size] = raw
    dist.all_gather(outs, mine, group=group)
    return [json.loads(o[: int(s[0])].tobytes()) for o, s in zip(outs, sizes)]
