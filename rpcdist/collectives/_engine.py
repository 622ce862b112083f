"""One interface for every collective engine, and the staging of buffers.

An :class:`Engine` runs one collective on the group's executing thread and
returns when it is done. Each op body in :mod:`._calls` and
:mod:`._exchange` asks :func:`engine_for` for the engine of its buffer and
calls it; which engine that is, and how buffers reach it, is decided here:

* :class:`NcclEngineOps`: CuPy buffers, when every rank has NCCL and a GPU
  of its own (on device, on the caller's CUDA stream);
* :class:`HostEngine` around the group's CPU engine: shared memory on one
  host (``ShmEngine``, blocking), or the message ring over the agent's
  links (``RingEngine``, coroutines run on the agent loop); CuPy buffers are
  staged through host memory where the engine needs host arrays, and a
  reduction of a CuPy buffer of the sizes the engine names
  (``reduces_on_host``) is copied down whole, reduced by the host algorithm
  and copied back (two device copies instead of a few per piece);
* the same :class:`HostEngine` around :class:`LocalOps` for a group of one
  (copies only).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._nccl import nccl_supports, setup_nccl, use_nccl
from ._ops import NUMPY_XP, Meta, ReduceOp, Xp, flat, is_cupy, xp_for

if TYPE_CHECKING:
    from ._types import GroupView

__all__ = [
    "Engine",
    "HostEngine",
    "LocalOps",
    "NcclEngineOps",
    "cuda_stream",
    "engine_for",
    "host_in",
    "host_out",
    "writeback",
]

Finish = Callable[[], None]


class Engine(Protocol):
    """Runs one collective of a group, blocking its executing thread.

    Buffers are flat and contiguous (``flat``); ``seq`` is the op's per-group
    sequence number and ``meta`` what every rank compares. All-reduce,
    reduce and reduce-scatter take arrays of the buffer's own library
    (``xp``); the other ops take the caller's arrays and stage them as the
    engine needs.
    """

    def all_reduce(self, seq: int, xp: Xp, src: Any, dst: Any, op: ReduceOp, meta: Meta) -> None:
        """``dst`` = the reduction of every rank's ``src``."""

    def reduce(
        self, seq: int, xp: Xp, src: Any, out: Any | None, root: int, op: ReduceOp, meta: Meta
    ) -> None:
        """The reduction into ``out`` on group rank ``root`` (``None`` elsewhere)."""

    def reduce_scatter(
        self, seq: int, xp: Xp, ins: Sequence[Any], out: Any, op: ReduceOp, meta: Meta
    ) -> None:
        """``out`` on rank q = the reduction of every rank's ``ins[q]``."""

    def broadcast(self, seq: int, buf: Any, root: int, meta: Meta) -> None:
        """``buf`` of group rank ``root`` into ``buf`` everywhere (any shape)."""

    def all_gather(self, seq: int, buf: Any, outs: Sequence[Any], meta: Meta) -> None:
        """Every rank's ``buf`` into ``outs[rank]`` everywhere."""

    def gather(self, seq: int, buf: Any, outs: Sequence[Any] | None, root: int, meta: Meta) -> None:
        """Every rank's ``buf`` into ``outs[rank]`` on ``root``."""

    def scatter(self, seq: int, buf: Any, ins: Sequence[Any] | None, root: int, meta: Meta) -> None:
        """``ins[rank]`` of ``root`` into ``buf`` on every rank."""

    def all_to_all(self, seq: int, outs: Sequence[Any], ins: Sequence[Any], meta: Meta) -> None:
        """``ins[q]`` of every rank into ``outs[that rank]`` on rank q."""

    def barrier(self, seq: int, meta: Meta) -> None:
        """Return once every rank has reached it."""


# ------------------------------------------------------------------- staging


def host_in(a: Any) -> np.ndarray:
    """A flat contiguous host array with ``a``'s values (a view when possible)."""
    if is_cupy(a):
        return a.reshape(-1).get()  # type: ignore[no-any-return]
    out: np.ndarray = flat(a)[0]
    return out


def host_out(a: Any) -> tuple[np.ndarray, Finish | None]:
    """A flat host array to fill, and how to copy it back into ``a`` (if needed)."""
    if is_cupy(a):
        h = np.empty(a.size, a.dtype)
        return h, lambda: a.__setitem__(Ellipsis, xp_for(a).module.asarray(h).reshape(a.shape))
    f, copied = flat(a)
    if not copied:
        return f, None
    return f, lambda: a.__setitem__(Ellipsis, f.reshape(a.shape))


def writeback(a: Any, f: Any, copied: bool) -> None:
    """Copy the contiguous scratch ``f`` back into ``a`` if it was a copy."""
    if copied:
        a[...] = f.reshape(a.shape)


def _finish(staged: Sequence[tuple[np.ndarray, Finish | None]]) -> None:
    for _, done in staged:
        if done is not None:
            done()


def cuda_stream(buf: Any) -> tuple[Any, int]:
    """The caller's current CUDA stream and ``buf``'s device (``None, -1`` for NumPy).

    Taken on the calling thread when a collective is issued: CuPy's current
    stream is per thread, and the op may run on the group's worker thread.
    """
    if not is_cupy(buf):
        return None, -1
    import cupy

    return cupy.cuda.get_current_stream(), buf.device.id


# ------------------------------------------------------------------- engines


class LocalOps:
    """Collectives of a group of one: copies only (host arrays, as staged)."""

    def all_reduce(self, seq: int, xp: Xp, src: Any, dst: Any, op: ReduceOp, meta: Meta) -> None:
        if dst is not src:
            xp.copy(dst, src)

    def reduce(
        self, seq: int, xp: Xp, src: Any, out: Any | None, root: int, op: ReduceOp, meta: Meta
    ) -> None:
        if out is not None and out is not src:
            xp.copy(out, src)

    def reduce_scatter(
        self, seq: int, xp: Xp, ins: Sequence[Any], out: Any, op: ReduceOp, meta: Meta
    ) -> None:
        xp.copy(out, ins[0])

    def broadcast(self, seq: int, buf: np.ndarray, root: int, meta: Meta) -> None:
        return None

    def all_gather(self, seq: int, src: np.ndarray, outs: Sequence[np.ndarray], meta: Meta) -> None:
        np.copyto(outs[0], src)

    def gather(
        self, seq: int, src: np.ndarray, outs: Sequence[np.ndarray] | None, root: int, meta: Meta
    ) -> None:
        assert outs is not None
        np.copyto(outs[0], src)

    def scatter(
        self, seq: int, out: np.ndarray, ins: Sequence[np.ndarray] | None, root: int, meta: Meta
    ) -> None:
        assert ins is not None
        np.copyto(out, ins[0])

    def all_to_all(
        self, seq: int, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray], meta: Meta
    ) -> None:
        np.copyto(outs[0], ins[0])

    def barrier(self, seq: int, meta: Meta) -> None:
        return None

    def reduces_on_host(self, nbytes: int) -> bool:
        return False  # copies only: device buffers stay on their device

    def close(self) -> None:
        return None


class HostEngine:
    """An :class:`Engine` over a CPU engine (shared memory, the message ring,
    or :class:`LocalOps`): runs its coroutines on the agent loop, and stages
    CuPy buffers through host memory for the ops that need host arrays."""

    device = False

    def __init__(self, inner: Any, group: GroupView) -> None:
        self.inner = inner
        self.name: str = getattr(inner, "name", "local")
        self._group = group

    def _run(self, result: Any) -> None:
        if asyncio.iscoroutine(result):
            self._group.run_async(result)

    def _on_host(self, xp: Xp, src: Any) -> bool:
        """Whether to reduce the device buffer ``src`` on the host (the engine's choice)."""
        return not xp.host and bool(self.inner.reduces_on_host(src.nbytes))

    def all_reduce(self, seq: int, xp: Xp, src: Any, dst: Any, op: ReduceOp, meta: Meta) -> None:
        if self._on_host(xp, src):
            h = xp.host_view(src)  # one copy down, finished when it returns
            self._run(self.inner.all_reduce(seq, NUMPY_XP, h, h, op, meta))
            xp.from_host(dst, h)
            return
        self._run(self.inner.all_reduce(seq, xp, src, dst, op, meta))

    def reduce(
        self, seq: int, xp: Xp, src: Any, out: Any | None, root: int, op: ReduceOp, meta: Meta
    ) -> None:
        if self._on_host(xp, src):
            h = xp.host_view(src)
            mine = None if out is None else h
            self._run(self.inner.reduce(seq, NUMPY_XP, h, mine, root, op, meta))
            if out is not None:
                xp.from_host(out, h)
            return
        self._run(self.inner.reduce(seq, xp, src, out, root, op, meta))

    def reduce_scatter(
        self, seq: int, xp: Xp, ins: Sequence[Any], out: Any, op: ReduceOp, meta: Meta
    ) -> None:
        self._run(self.inner.reduce_scatter(seq, xp, ins, out, op, meta))

    def broadcast(self, seq: int, buf: Any, root: int, meta: Meta) -> None:
        if self._group.rank == root:
            self._run(self.inner.broadcast(seq, host_in(buf), root, meta))
            return
        host, done = host_out(buf)
        self._run(self.inner.broadcast(seq, host, root, meta))
        if done is not None:
            done()

    def all_gather(self, seq: int, buf: Any, outs: Sequence[Any], meta: Meta) -> None:
        staged = [host_out(o) for o in outs]
        self._run(self.inner.all_gather(seq, host_in(buf), [h for h, _ in staged], meta))
        _finish(staged)

    def gather(self, seq: int, buf: Any, outs: Sequence[Any] | None, root: int, meta: Meta) -> None:
        staged = [host_out(o) for o in outs] if outs is not None else []
        hosts = [h for h, _ in staged] if outs is not None else None
        self._run(self.inner.gather(seq, host_in(buf), hosts, root, meta))
        _finish(staged)

    def scatter(self, seq: int, buf: Any, ins: Sequence[Any] | None, root: int, meta: Meta) -> None:
        host, done = host_out(buf)
        hins = [host_in(i) for i in ins] if ins is not None else None
        self._run(self.inner.scatter(seq, host, hins, root, meta))
        if done is not None:
            done()

    def all_to_all(self, seq: int, outs: Sequence[Any], ins: Sequence[Any], meta: Meta) -> None:
        staged = [host_out(o) for o in outs]
        hins = [host_in(i) for i in ins]
        self._run(self.inner.all_to_all(seq, [h for h, _ in staged], hins, meta))
        _finish(staged)

    def barrier(self, seq: int, meta: Meta) -> None:
        self._run(self.inner.barrier(seq, meta))

    def interrupt(self) -> None:
        """Wake a blocking engine's waits (shared memory), if it has any."""
        fn = getattr(self.inner, "interrupt", None)
        if fn is not None:
            fn()

    def close(self) -> None:
        self.inner.close()


class NcclEngineOps:
    """An :class:`Engine` for CuPy buffers over the group's NCCL communicator,
    on the CUDA stream the collective was issued on (only the ops
    :func:`~._nccl.nccl_supports` names are ever routed here)."""

    device = True
    name = "nccl"

    def __init__(self, nccl: Any, group: GroupView, stream: Any, device: int) -> None:
        self._nccl = nccl
        self._group = group
        self._stream = stream
        self._device = device

    def _do(self, kind: str, meta: Meta, **args: Any) -> None:
        g = self._group
        args["device"] = self._device
        g.run_async(self._nccl.run(kind, args, self._stream, g.timeout, meta.kind))

    def all_reduce(self, seq: int, xp: Xp, src: Any, dst: Any, op: ReduceOp, meta: Meta) -> None:
        self._do("all_reduce", meta, src=src, dst=dst, op=op)

    def reduce(
        self, seq: int, xp: Xp, src: Any, out: Any | None, root: int, op: ReduceOp, meta: Meta
    ) -> None:
        self._do("reduce", meta, src=src, dst=src, op=op, root=root)

    def reduce_scatter(
        self, seq: int, xp: Xp, ins: Sequence[Any], out: Any, op: ReduceOp, meta: Meta
    ) -> None:
        self._do("reduce_scatter", meta, src=xp.module.concatenate(list(ins)), out=out, op=op)

    def broadcast(self, seq: int, buf: Any, root: int, meta: Meta) -> None:
        f, copied = flat(buf)
        self._do("broadcast", meta, buf=f, root=root)
        writeback(buf, f, copied)

    def all_gather(self, seq: int, buf: Any, outs: Sequence[Any], meta: Meta) -> None:
        xp = xp_for(buf)
        whole = xp.module.empty(buf.size * len(outs), buf.dtype)
        self._do("all_gather", meta, src=flat(buf)[0], out=whole)
        for q, o in enumerate(outs):
            o[...] = whole[q * buf.size : (q + 1) * buf.size].reshape(o.shape)

    def _unsupported(self, what: str) -> None:
        raise AssertionError(f"NCCL does not run {what}")  # engine_for never routes it here

    def gather(self, seq: int, buf: Any, outs: Sequence[Any] | None, root: int, meta: Meta) -> None:
        self._unsupported("gather")

    def scatter(self, seq: int, buf: Any, ins: Sequence[Any] | None, root: int, meta: Meta) -> None:
        self._unsupported("scatter")

    def all_to_all(self, seq: int, outs: Sequence[Any], ins: Sequence[Any], meta: Meta) -> None:
        self._unsupported("all_to_all")

    def barrier(self, seq: int, meta: Meta) -> None:
        self._unsupported("barrier")


_LOCAL = LocalOps()


def engine_for(
    g: GroupView,
    kind: str,
    xp: Xp,
    dtype: Any,
    op: ReduceOp | None,
    stream: Any,
    device: int,
    sizes: Sequence[int] = (),
) -> Engine:
    """The engine that runs collective ``kind`` on ``g`` for these buffers
    (on the executing thread; NCCL is set up on first use)."""
    if g.size == 1:
        return HostEngine(_LOCAL, g)
    if (
        not xp.host
        and g.requested not in ("ring", "shm")
        and nccl_supports(kind, np.dtype(dtype), op, sizes)
    ):
        if "nccl" not in g.extra:
            st = g.state
            g.extra["nccl"] = g.run_async(
                setup_nccl(
                    st.agent.store,
                    f"{st.tag}/g{g.gid}/nccl",
                    g.ranks,
                    g.rank,
                    st.agent.options.init_timeout,
                    device,
                )
            )
        nccl = g.extra["nccl"]
        if use_nccl(g.requested, True, nccl is not None):
            return NcclEngineOps(nccl, g, stream, device)
    engine: Engine = g.engine
    return engine
