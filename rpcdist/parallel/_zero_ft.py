"""``ZeroRedundancyOptimizer`` in the fault-tolerant mode (``fault_tolerance=ft``).

The slices are :class:`._flat.FlatLayout`'s over this step's members, in
member order. Each rank's local optimizer steps two slices per dtype and
device: its own and its successor's copy (:mod:`._ft_shard`). The step
runs inside ``ft.commit()``, between the gradients' average and the vote:
the local step, then every member sends its own slice to every other over
the fault-tolerance mesh; if the step does not commit everywhere, the
slices and their state are put back as they were (so a death during the
all-gather leaves no rank half-updated). ``step()`` afterwards does
nothing more. At each change of membership the optimizer state is
re-sharded from the members' slices and the parameters are refreshed from
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import ConfigError, WorkerLostError
from ..tensor import Tensor
from ._arrays import host
from ._flat import FlatLayout, shard_ranges
from ._ft_shard import Entry, held_ranges, regather

if TYPE_CHECKING:
    from ._ft import FaultTolerance
    from ._types import ZeroView

__all__ = ["ZeroFaultTolerance"]


def _copy(value: Any) -> Any:
    return value.copy() if hasattr(value, "copy") else value


class ZeroFaultTolerance:
    """The fault-tolerant side of one ``ZeroRedundancyOptimizer`` (registered with ``ft``)."""

    def __init__(self, zero: ZeroView, ft: FaultTolerance) -> None:
        self.zero, self.ft = zero, ft
        params = zero._params
        self.kinds: list[list[int]] = []
        by_kind: dict[tuple[str, str], list[int]] = {}
        for i, p in enumerate(params):
            by_kind.setdefault((str(p.dtype), p.device), []).append(i)
        self.kinds = list(by_kind.values())
        self.starts: dict[int, int] = {}
        for idx in self.kinds:
            off = 0
            for i in idx:
                self.starts[i] = off
                off += params[i].data.size
        self.numels = [sum(params[i].data.size for i in idx) for idx in self.kinds]
        #: ``(parameter, lo, hi, piece)`` of the slices this rank steps (own, then successor's).
        self.pieces: list[tuple[int, int, int, Tensor]] = []
        self.fresh = True
        self.saved: list[tuple[Tensor, Any, dict[str, Any] | None]] = []
        self.got: dict[int, np.ndarray[Any, Any]] = {}
        zero.optim, zero._pieces = None, []
        ft._add_sharded(self)

    # -- what FaultTolerance calls ------------------------------------------------------

    def _ft_adopts(self, obj: Any) -> str | None:
        return "whole" if obj is self.zero else None

    def _ft_grads(self) -> np.ndarray[Any, Any]:
        return np.zeros(0, np.float64)  # DDP's attached gradients are the ones averaged

    def _ft_write(self, avg: np.ndarray[Any, Any]) -> None:
        pass

    def _ft_live(self) -> None:
        return None  # its whole state is sharded (re-sharded, not sent)

    def _ft_take_live(self, live: None) -> None:
        pass

    def _ft_reshard(self) -> None:
        zero, params = self.zero, self.zero._params
        held, scalars = self._held()
        dtypes = [params[idx[0]].data.dtype for idx in self.kinds]
        wholes = regather(self.ft, held, scalars, self.numels, dtypes, self.fresh)
        for idx, whole in zip(self.kinds, wholes, strict=True):
            for i in idx:  # refresh the parameters from the slices (their newest values)
                a, n = self.starts[i], params[i].data.size
                cov = whole.covered[a : a + n]
                if cov.any():
                    flat = params[i].data.reshape(-1)
                    flat[cov] = whole.params[a : a + n][cov]
        zero.rank, zero.world = self.ft.rank, self.ft.world_size
        sizes = [p.data.size for p in params]
        kinds = [(str(p.dtype), p.device) for p in params]
        zero.ranges = shard_ranges(sizes, kinds, zero.world)
        self._build(wholes)
        self.fresh = False

    # -- stepping -----------------------------------------------------------------------

    def _ft_prepare(self) -> None:
        """Step this rank's two slices, then all-gather the owned ones (undone if no commit)."""
        zero, params = self.zero, self.zero._params
        self.saved = []
        if zero.optim is not None:
            for g, local in zip(zero.param_groups, zero.optim.param_groups, strict=True):
                for k, v in g.items():
                    if k != "params":
                        local[k] = v
            for i, lo, hi, piece in self.pieces:
                grad = params[i].grad
                piece.grad = None if grad is None else Tensor(grad.data.reshape(-1)[lo:hi])
                st = zero.optim.state.get(piece)
                copy = None if st is None else {k: _copy(v) for k, v in st.items()}
                self.saved.append((piece, piece.data.copy(), copy))
            zero.optim.step()
        flat = np.concatenate([self._owned(v, zero.rank) for v in range(len(self.kinds))])
        self.got = self.ft._all_gather(flat.astype(np.float64), flat.size)

    def _ft_finish(self, committed: bool) -> None:
        zero = self.zero
        if not committed:  # undo the step: the slices and their state as they were
            for piece, data, st in self.saved:
                piece.data[...] = data
                if zero.optim is not None:
                    if st is None:
                        zero.optim.state.pop(piece, None)
                    else:
                        zero.optim.state[piece] = st
        else:
            for rid, data in self.got.items():
                q = self.ft.members.index(rid)
                if q == zero.rank:
                    continue
                at = 0
                for v, idx in enumerate(self.kinds):
                    layout = FlatLayout(self.numels[v], zero.world)
                    lo, hi = layout.owned(q)
                    self._write(idx, lo, hi, data[at : at + hi - lo])
                    at += layout.shard
        self.saved, self.got = [], {}

    def consolidate(self, to: int) -> dict[str, Any] | None:
        """The full state dict on member ``to``, None elsewhere (collective over the
        members, as the re-sharding: every member sends what it holds).

        Raises:
            ConfigError: ``to`` is not a member index, or some state is not elementwise.
            WorkerLostError: a member failed (this step then fails, and is redone).
        """
        ft, zero, params = self.ft, self.zero, self.zero._params
        if not 0 <= to < ft.world_size:
            raise ConfigError(
                f"consolidate_state_dict: to={to} is not in [0, {ft.world_size}) (this step's "
                "members)"
            )
        held, scalars = self._held()
        dtypes = [params[idx[0]].data.dtype for idx in self.kinds]
        try:
            wholes = regather(ft, held, scalars, self.numels, dtypes, self.fresh)
        except (OSError, WorkerLostError) as e:
            ft._fail()
            raise WorkerLostError(f"consolidate_state_dict: a member failed ({e})") from e
        if ft.rank != to:
            return None
        state: dict[int, dict[str, Any]] = {}
        for v, idx in enumerate(self.kinds):
            whole = wholes[v]
            for i in idx:
                a, n = self.starts[i], params[i].data.size
                st = {}
                for k in whole.state:
                    arr = whole.take(k, a, a + n)
                    if arr is not None:
                        st[k] = arr.reshape(params[i].data.shape)
                for key, val in whole.scalars.items():
                    pi, _, k = key.partition("/")
                    if st and int(pi) == i:
                        st[k] = val
                if st:
                    state[i] = st
        sd: dict[str, Any] = zero._full.state_dict()  # groups with global indices; no state
        sd["state"] = {i: state[i] for i in sorted(state)}
        return sd

    # -- helpers ------------------------------------------------------------------------

    def _owned(self, v: int, rank: int) -> np.ndarray[Any, Any]:
        """Rank ``rank``'s slice of kind ``v``, padded to the layout's shard size."""
        params = self.zero._params
        layout = FlatLayout(self.numels[v], self.zero.world)
        lo, hi = layout.owned(rank)
        first = params[self.kinds[v][0]].data
        out = np.zeros(layout.shard, host(first[:0]).dtype)
        for i in self.kinds[v]:
            a, n = self.starts[i], params[i].data.size
            s, e = max(lo, a), min(hi, a + n)
            if s < e:
                out[s - lo : e - lo] = host(params[i].data.reshape(-1)[s - a : e - a])
        return out

    def _write(self, idx: list[int], lo: int, hi: int, values: np.ndarray[Any, Any]) -> None:
        params = self.zero._params
        for i in idx:
            a, n = self.starts[i], params[i].data.size
            s, e = max(lo, a), min(hi, a + n)
            if s < e:
                flat = params[i].data.reshape(-1)
                flat[s - a : e - a] = values[s - lo : e - lo].astype(flat.dtype)

    def _held(self) -> tuple[list[list[Entry]], list[dict[str, Any]]]:
        held: list[list[Entry]] = [[] for _ in self.kinds]
        scalars: list[dict[str, Any]] = [{} for _ in self.kinds]
        kind_of = {i: v for v, idx in enumerate(self.kinds) for i in idx}
        optim = self.zero.optim
        for i, lo, hi, piece in self.pieces:
            v, a = kind_of[i], self.starts[i]
            st = optim.state.get(piece) if optim is not None else None
            state = {}
            for k, val in (st or {}).items():
                if getattr(val, "ndim", 0) == 1 and val.size == hi - lo:
                    state[k] = host(val)
                else:
                    scalars[v][f"{i}/{k}"] = val.item() if hasattr(val, "item") else val
            held[v].append(Entry(a + lo, a + hi, host(piece.data), state))
        return held, scalars

    def _build(self, wholes: list[Any]) -> None:
        """The pieces and local optimizer of this rank's two slices at the new world."""
        zero = self.zero
        params = zero._params
        kind_of = {i: v for v, idx in enumerate(self.kinds) for i in idx}
        position = {id(p): i for i, p in enumerate(params)}
        self.pieces = []
        groups = []
        for g in zero.param_groups:
            pieces = []
            for p in g["params"]:
                i = position[id(p)]
                v, a, n = kind_of[i], self.starts[i], p.data.size
                for lo, hi in held_ranges(self.numels[v], zero.world, zero.rank):
                    s, e = max(lo, a), min(hi, a + n)
                    if s < e:
                        piece = Tensor(p.data.reshape(-1)[s - a : e - a])
                        self.pieces.append((i, s - a, e - a, piece))
                        pieces.append(piece)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": pieces})
        zero.optim = zero.optimizer_class(groups, **zero.defaults) if self.pieces else None
        if zero.optim is None:
            return
        for i, lo, hi, piece in self.pieces:
            whole, a = wholes[kind_of[i]], self.starts[i]
            st: dict[str, Any] = {}
            for k in whole.state:
                arr = whole.take(k, a + lo, a + hi)
                if arr is not None:
                    st[k] = arr.astype(piece.data.dtype, copy=False)
            if st:
                for key, val in whole.scalars.items():
                    pi, _, k = key.partition("/")
                    if int(pi) == i:
                        st[k] = val
                zero.optim.state[piece] = st
