"""One FSDP unit: its parameters flattened into one padded vector, sharded 1/p per rank.

The vector and its slices are :class:`._flat.FlatLayout`'s, the scheme
ZeRO uses too.

A :class:`FlatUnit` owns the shard (a :class:`Parameter` the optimizer
updates) and, while the unit computes, the gathered full vector. Each
forward hands the module *views* of the gathered vector through
:class:`_Unflatten`, one differentiable node whose backward receives every
view's gradient at once, writes them into one flat gradient and
reduce-scatters it (async; the shard's ``.grad`` is filled when the
backward pass ends).

On the host the gathered vector lives in an anonymous ``mmap``: freeing it
(``MADV_DONTNEED``) returns its pages to the OS while the views that the
autograd graph saved stay valid, and gathering again before backward
refills the same addresses. This is what ``resize_(0)`` of a storage does
in PyTorch's FSDP. CuPy buffers are dropped instead (the graph may keep
them alive until backward).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import collectives as dist
from .._errors import WorkerLostError
from ..nn import Module, Parameter
from ..tensor import Function, Tensor
from ..tensor._engine import queue_callback
from ._arrays import is_cupy, xp_of
from ._bf16 import from_bf16, to_bf16
from ._flat import FlatLayout
from ._fsdp_policy import MixedPrecision

__all__ = ["FlatUnit", "Shared", "Slot"]


@dataclass
class Slot:
    """One original parameter inside a unit's flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    owners: list[tuple[Module, str]]


@dataclass
class Shared:
    """What all units of one root FSDP share: group, options, the iteration's log."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    strategy: str
    mp: MixedPrecision | None
    xp: Any = np  # the model's array module: an empty unit is made with it
    units: list[FlatUnit] = field(default_factory=list)
    sync: bool = True
    kept: bool = False
    divisor: float = 1.0
    log: list[tuple[str, int]] = field(default_factory=list)
    pending: list[Callable[[], None]] = field(default_factory=list)
    live: int = 0
    peak: int = 0
    gathers: int = 0
    prefetches: int = 0
    reductions: int = 0
    ft: Any = None  # a FaultTolerance: gathers and averages go over its mesh (_fsdp_ft.py)

    @property
    def sharded(self) -> bool:
        return self.strategy != "no_shard"

    def drain(self) -> None:
        """Finish the reductions in flight (their shard gradients land in ``.grad``)."""
        while self.pending:
            self.pending.pop(0)()

    def track(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)


def _comm_dtype(name: str | None) -> Any:
    return {None: None, "float16": np.float16, "bfloat16": np.uint16}[name]


def round_to(x: Any, name: str | None) -> Any:
    """``x`` rounded to ``"float16"`` or ``"bfloat16"`` (widened to float32, exactly); None: ``x``."""
    low = _comm_dtype(name)
    if low is np.uint16:
        return from_bf16(to_bf16(x))
    return x if low is None else x.astype(low)


class FlatUnit:
    """The flat, padded, sharded parameters of one unit and their gathered copy."""

    def __init__(self, index: int, slots: list[Slot], full: Any, shared: Shared) -> None:
        self.index = index
        self.slots = slots
        self.shared = shared
        self.numel = int(full.size)
        self.layout = FlatLayout(self.numel, shared.world if shared.sharded else 1)
        self.padded = self.layout.padded
        self.shard_size = self.layout.shard
        xp = xp_of(full)
        self.xp = xp
        self.dtype = full.dtype
        padded = xp.zeros(self.padded, full.dtype)
        padded[: self.numel] = full
        self.shard = Parameter(padded[slice(*self._bounds())].copy())
        self._buf: Any = None if shared.sharded else self.shard.data
        self._mm: mmap.mmap | None = None
        self._work: Any = None
        self._comm: Any = None
        self.state = "free" if shared.sharded else "ready"
        self.acc: Any = None  # full-size gradient summed under no_sync
        self.ft_flat: Any = None  # fault-tolerant mode: this step's local flat gradient

    # ----------------------------------------------------------------- gather
    def _buffer(self) -> Any:
        if self._buf is None:
            nbytes = self.padded * self.dtype.itemsize
            if self.xp is np:
                self._mm = mmap.mmap(-1, nbytes)
                self._buf = np.frombuffer(self._mm, self.dtype, self.padded)
            else:
                self._buf = self.xp.empty(self.padded, self.dtype)
        return self._buf

    def start_gather(self, prefetch: bool = False) -> None:
        """Launch the all-gather of the full vector (no-op unless freed)."""
        sh = self.shared
        if self.state == "reducing":  # the buffer still feeds this unit's reduce-scatter
            sh.drain()
        if self.state != "free" or not self.slots:
            return
        buf = self._buffer()
        self._comm, self._work = self._all_gather(buf)
        self.state = "gathering"
        sh.track(buf.nbytes)
        sh.gathers += 1
        sh.prefetches += prefetch
        sh.log.append(("ag", self.index))

    def _all_gather(self, buf: Any) -> tuple[Any, Any]:
        """Launch the all-gather of the shard (in the communication dtype) into ``buf``."""
        sh = self.shared
        if sh.ft is not None:  # rounded as the wire below rounds, gathered exactly
            mine = round_to(
                self.shard.data[: self.shard_size], sh.mp.param_dtype if sh.mp else None
            )
            self._ft_gather(mine, buf)
            return buf, _Done()
        low = _comm_dtype(sh.mp.param_dtype) if sh.mp else None
        data = self.shard.data
        if low is None:
            comm, send = buf, data
        elif low is np.uint16:
            comm, send = self.xp.empty(self.padded, low), to_bf16(data)
        else:
            comm, send = self.xp.empty(self.padded, low), data.astype(low)
        n = self.shard_size
        outs = [comm[i * n : (i + 1) * n] for i in range(sh.world)]
        return comm, dist.all_gather(outs, send, group=sh.group, async_op=True)

    def wait_gather(self) -> None:
        """Gather (or finish a prefetch): afterwards :meth:`views` are valid."""
        self.start_gather()
        if self.state != "gathering":
            return
        self._work.wait()
        comm, buf = self._comm, self._buf
        if comm is not buf:
            if comm.dtype == np.uint16 and buf.dtype == np.float32:
                from_bf16(comm, out=buf)
            elif comm.dtype == np.uint16:
                buf[...] = from_bf16(comm)
            else:
                buf[...] = comm
        self._work = self._comm = None
        self.state = "ready"

    def free(self, graph_holds_views: bool = False) -> None:
        """Drop the gathered vector's memory (sharded strategies only).

        On CuPy, memory the autograd graph still views cannot be returned, so
        with ``graph_holds_views`` the vector stays gathered (and backward
        needs no second all-gather).
        """
        if not self.shared.sharded or self.state == "free":
            return
        if graph_holds_views and self._mm is None and self.slots:
            return
        if self.state != "reducing":
            self.wait_gather()
        if self._mm is not None:
            self._mm.madvise(mmap.MADV_DONTNEED)
        else:
            self._buf = None
        self.shared.track(-self.padded * self.dtype.itemsize)
        self.state = "free"

    def views(self) -> list[Any]:
        """One array per slot, viewing the gathered vector."""
        buf = self._buf
        return [buf[s.offset : s.offset + s.numel].reshape(s.shape) for s in self.slots]

    def install(self, grad: bool) -> None:
        """Point the modules' parameter attributes at views of the gathered vector."""
        if grad and self.slots and self.shard.requires_grad:
            tensors = list(_Unflatten.call(self.shard, unit=self))
        else:
            tensors = [Tensor._wrap(v) for v in self.views()]
        for slot, t in zip(self.slots, tensors):
            for mod, attr in slot.owners:
                object.__setattr__(mod, attr, t)

    # --------------------------------------------------------------- backward
    def post_backward(self, grads: tuple[Any, ...]) -> None:
        """Every view's gradient arrived: flatten, then reduce (or accumulate under no_sync)."""
        sh = self.shared
        keep = sh.strategy == "shard_grad_op" and not sh.sync
        sh.kept = sh.kept or keep  # ZeRO-2 under no_sync: the next forward reuses them
        # The gathered parameters are not needed any more: on the host their
        # pages take the flat gradient (no new allocation, no page faults) and
        # are given back once the reduce-scatter has read them.
        reuse = (
            sh.sync
            and sh.sharded
            and self.state == "ready"
            and self._mm is not None
            and self.acc is None
            and not (sh.mp and sh.mp.reduce_dtype)
        )
        if reuse:
            flat = self._buf
            self.state = "reducing"
        else:
            if not keep:
                self.free()
            flat = self.xp.empty(self.padded, self.dtype)
        flat[self.numel :] = 0
        for slot, g in zip(self.slots, grads):
            part = flat[slot.offset : slot.offset + slot.numel]
            if g is None:
                part[...] = 0
            else:
                part[...] = g.reshape(-1)
        if not sh.sync:
            if self.acc is None:
                self.acc = flat
            else:
                self.acc += flat
            return
        if self.acc is not None:
            flat += self.acc
            self.acc = None
        self.reduce(flat, reuse)

    def post_scale(self) -> float:
        """The factor applied to a reduced gradient (1 where it was divided before)."""
        sh = self.shared
        return 1.0 if sh.mp and sh.mp.reduce_dtype == "float16" else 1.0 / sh.divisor

    def ft_reduced(self, avg: Any) -> Any:
        """Fault-tolerant mode: ``ft.commit()``'s float64 average as the reduction's result.

        In the reduce dtype, as the reduce-scatter would give it: float16 was
        divided before the sum (the commit divided again: undone), rounded
        once; bfloat16 summed in float32.
        """
        name = self.shared.mp.reduce_dtype if self.shared.mp else None
        if name == "float16":
            return (avg * self.shared.divisor).astype(np.float16)
        return avg.astype(np.float32) if name == "bfloat16" else avg

    def reduce(self, flat: Any, in_buffer: bool = False) -> None:
        """Average ``flat`` over the group into this rank's shard gradient (async).

        The sum is divided afterwards, on the (p times smaller) result,
        except in float16, which divides first so that the sum cannot overflow.
        """
        sh = self.shared
        name = sh.mp.reduce_dtype if sh.mp else None
        if name == "float16":
            flat *= 1.0 / sh.divisor
        flat = round_to(flat, name)  # bfloat16: summed in float32
        if sh.ft is not None:  # averaged by ft.commit() with the other units' (_fsdp_ft.py)
            self.ft_flat = self.xp.array(flat[: self.numel])
            if in_buffer:
                self.free()
            return
        sh.drain()  # launched one unit ago: done by now; frees its flat gradient
        if not in_buffer:
            sh.track(flat.nbytes)
        sh.reductions += 1
        scale = self.post_scale()
        if sh.sharded:
            n = self.shard_size
            out = self.xp.empty(n, flat.dtype)
            ins = [flat[i * n : (i + 1) * n] for i in range(sh.world)]
            work = dist.reduce_scatter(out, ins, group=sh.group, async_op=True)
            sh.log.append(("rs", self.index))
        else:
            out = flat
            work = dist.all_reduce(flat, group=sh.group, async_op=True)
            sh.log.append(("ar", self.index))
        nbytes = flat.nbytes

        def finish() -> None:
            work.wait()
            if in_buffer:
                self.free()  # the reduce-scatter has read it
            else:
                sh.track(-nbytes)
            if scale != 1.0:
                out[...] *= scale
            self.add_grad(out)

        sh.pending.append(finish)
        queue_callback(sh.drain)

    def add_grad(self, g: Any) -> None:
        """Add ``g`` (shard-sized) into the shard's ``.grad``."""
        g = g.astype(self.dtype, copy=False)
        shard = self.shard
        if shard.grad is None:
            shard.grad = Tensor._wrap(g if g.base is None else g.copy())
        else:
            shard.grad.data += g

    def shadow(self, kind: str) -> tuple[Any, Any]:
        """Issue the collective ``kind`` with this rank's share being zero (Join)."""
        sh = self.shared
        if kind == "ag":
            return None, self._all_gather(self.xp.empty(self.padded, self.dtype))[1]
        low = _comm_dtype(sh.mp.reduce_dtype) if sh.mp else None
        dtype = self.dtype if low in (None, np.uint16) else low
        flat = self.xp.zeros(self.padded, dtype)
        if kind == "ar":
            return flat, dist.all_reduce(flat, group=sh.group, async_op=True)
        n = self.shard_size
        out = self.xp.empty(n, dtype)
        ins = [flat[i * n : (i + 1) * n] for i in range(sh.world)]
        return out, dist.reduce_scatter(out, ins, group=sh.group, async_op=True)

    def full_vector(self) -> Any:
        """The unpadded full vector in the master dtype (a collective when sharded)."""
        return self.gather_shaped(self.shard.data)

    def gather_shaped(self, piece: Any) -> Any:
        """All-gather a shard-sized array into the unpadded full vector."""
        if not self.shared.sharded:
            return piece[: self.numel].copy()
        if self.shared.ft is not None:
            full = self.xp.empty(self.padded, piece.dtype)
            self._ft_gather(piece, full, raising=True)
            return full[: self.numel]
        n = self.shard_size
        full = self.xp.empty(self.padded, piece.dtype)
        outs = [full[i * n : (i + 1) * n] for i in range(self.shared.world)]
        dist.all_gather(outs, self.xp.ascontiguousarray(piece), group=self.shared.group)
        return full[: self.numel]

    def my_piece(self, full: Any) -> Any:
        """This rank's shard of an unpadded full vector."""
        padded = self.xp.zeros(self.padded, full.dtype)
        padded[: self.numel] = self.xp.asarray(full)
        if self.shared.ft is not None:
            return self.xp.concatenate([padded[slice(*b)] for b in self.ft_bounds()])
        return padded[slice(*self._bounds())].copy()

    def ft_bounds(self) -> list[tuple[int, int]]:
        """Fault-tolerant mode: the padded slices the shard holds (own, then successor's;
        ``no_shard``: the whole vector)."""
        sh = self.shared
        if not sh.sharded or sh.world == 1:  # the whole vector
            return [self.layout.bounds(0)]
        return [self.layout.bounds(q) for q in (sh.rank, (sh.rank + 1) % sh.world)]

    def _ft_gather(self, piece: Any, out: Any, raising: bool = False) -> None:
        """Fault-tolerant mode: every member's own slice into ``out`` over the mesh.

        A failure marks the step failed (zeros in ``out``; the vote will be
        ``ok=False``) unless ``raising``.
        """
        ft, n = self.shared.ft, self.shard_size
        mine = np.asarray(piece[:n], np.float64)
        try:
            got = ft._all_gather(mine, n)
        except (OSError, WorkerLostError):
            if raising:
                raise
            ft._fail()
            out[...] = 0
            return
        for rid, data in got.items():
            q = ft.members.index(rid)
            out[q * n : (q + 1) * n] = data

    def _bounds(self) -> tuple[int, int]:
        return self.layout.bounds(self.shared.rank if self.shared.sharded else 0)

    @property
    def on_gpu(self) -> bool:
        return is_cupy(self.shard.data)


class _Done:
    """The finished work of a synchronous gather."""

    def wait(self) -> None:
        pass


class _Unflatten(Function):
    """Shard → one view per original parameter; backward reduces their gradients."""

    __slots__ = ("_unit",)

    def forward(self, shard: Any, *, unit: FlatUnit) -> tuple[Any, ...]:
        self._unit = unit
        return tuple(unit.views())

    def backward(self, *grads: Any) -> tuple[Any, ...]:
        self._unit.post_backward(grads)
        return (None,)
