"""The collective calls: argument checks, buffer staging and dispatch to an engine.

Each call checks its arguments at once, on the calling thread (these errors
are local: nothing was sent, no sequence number used), then hands a body to
the group, which runs it in issue order on the executing thread (see
:mod:`._group`). Bodies read the buffers when they run (so an async op sees
the buffer as it is then), flatten them (a non-contiguous one is copied to a
contiguous scratch and written back), stage CuPy buffers through host memory
where the engine needs it, and run the engine :func:`~._engine.engine_for`
picks (NCCL for CuPy buffers when usable, else the group's CPU engine:
shared memory, or the message ring on the agent loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import ConfigError
from ._api import resolve
from ._engine import cuda_stream, engine_for, writeback
from ._group import ProcessGroup
from ._ops import Meta, ReduceOp, check_array, check_op, flat, is_cupy, xp_for

__all__ = [
    "all_reduce",
    "array_list",
    "barrier",
    "broadcast",
    "member_group",
    "reduce",
    "reduce_scatter",
    "same_kind",
]


def member_group(group: ProcessGroup | None, what: str) -> ProcessGroup:
    """The group (default: the world), checked that this process is a member."""
    g = resolve(group)
    g.check_member(what)
    return g


def same_kind(arrays: Sequence[Any], dtype: Any, what: str) -> None:
    """Check one dtype and one array library for all ``arrays``."""
    cupy = is_cupy(arrays[0]) if arrays else False
    for i, a in enumerate(arrays):
        if a.dtype != dtype:
            raise ConfigError(f"{what}: array {i} has dtype {a.dtype}, expected {dtype}")
        if is_cupy(a) != cupy:
            raise ConfigError(f"{what}: NumPy and CuPy arrays cannot be mixed")


def array_list(arrays: Any, n: int, what: str, writable: bool = False) -> list[Any]:
    """Check a list of one array per rank."""
    if not isinstance(arrays, list | tuple) or len(arrays) != n:
        raise ConfigError(f"{what} must be a list of {n} arrays (one per rank), got {arrays!r:.80}")
    return [check_array(a, f"{what}[{i}]", writable=writable) for i, a in enumerate(arrays)]


def all_reduce(
    buf: Any,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    out: Any = None,
) -> Any:
    """Reduce ``buf`` over the group; every rank gets the result, in ``buf`` (or ``out``).

    Ring (reduce-scatter then all-gather, chunked and pipelined) over gRPC,
    or slices reduced in place in shared memory on one host, or NCCL.

    Returns:
        ``None``, or a :class:`Work` when ``async_op``.

    Raises:
        ConfigError: a bad buffer, op or ``out`` (local, nothing sent).
        CollectiveError: not a member, ranks disagree on shape/dtype/op, a
            peer died or failed.
        RpcTimeoutError: the group's timeout passed.
    """
    g = member_group(group, "all_reduce")
    check_array(buf, "all_reduce buf", writable=out is None)
    rop = check_op(op, buf.dtype)
    if out is not None:
        check_array(out, "all_reduce out", writable=True)
        same_kind([buf, out], buf.dtype, "all_reduce")
        if out.shape != buf.shape:
            raise ConfigError(f"all_reduce: out has shape {out.shape}, buf {buf.shape}")
    target = buf if out is None else out
    xp = xp_for(buf)
    stream, device = cuda_stream(buf)

    def body(seq: int) -> Any:
        meta = Meta("all_reduce", seq, rop, -1, buf.dtype, buf.shape)
        src, src_copied = flat(buf)
        dst, dst_copied = (src, src_copied) if out is None else flat(out)
        eng = engine_for(g, "all_reduce", xp, buf.dtype, rop, stream, device)
        eng.all_reduce(seq, xp, src, dst, rop, meta)
        writeback(target, dst, dst_copied)
        return target

    return g.submit("all_reduce", body, async_op)


def reduce(
    buf: Any,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``buf`` over the group into ``buf`` on global rank ``dst`` (others' are left alone).

    Raises:
        CollectiveError: ``dst`` is not a member, not a member yourself,
            ranks disagree, a peer died or failed.
        ConfigError: a bad buffer or op.
        RpcTimeoutError: the group's timeout passed.
    """
    g = member_group(group, "reduce")
    root = g.group_rank(dst, "reduce")
    check_array(buf, "reduce buf", writable=g.rank == root)
    rop = check_op(op, buf.dtype)
    xp = xp_for(buf)
    stream, device = cuda_stream(buf)

    def body(seq: int) -> Any:
        meta = Meta("reduce", seq, rop, root, buf.dtype, buf.shape)
        src, copied = flat(buf)
        out = src if g.rank == root else None
        eng = engine_for(g, "reduce", xp, buf.dtype, rop, stream, device)
        eng.reduce(seq, xp, src, out, root, rop, meta)
        if out is not None:
            writeback(buf, out, copied)
        return buf

    return g.submit("reduce", body, async_op)


def broadcast(buf: Any, src: int, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Copy ``buf`` of global rank ``src`` into ``buf`` on every rank of the group.

    Raises:
        CollectiveError: ``src`` is not a member, ranks disagree, a peer died.
        ConfigError: a bad buffer.
        RpcTimeoutError: the group's timeout passed.
    """
    g = member_group(group, "broadcast")
    root = g.group_rank(src, "broadcast")
    check_array(buf, "broadcast buf", writable=g.rank != root)
    xp = xp_for(buf)
    stream, device = cuda_stream(buf)

    def body(seq: int) -> Any:
        meta = Meta("broadcast", seq, 0, root, buf.dtype, buf.shape)
        engine_for(g, "broadcast", xp, buf.dtype, None, stream, device).broadcast(
            seq, buf, root, meta
        )
        return buf

    return g.submit("broadcast", body, async_op)


def reduce_scatter(
    out: Any,
    in_list: Sequence[Any],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``in_list[q]`` over the group into ``out`` on rank ``q``; sizes may differ.

    Raises:
        ConfigError: ``in_list`` is not one array per rank, dtypes differ, or
            ``in_list[my rank]`` does not match ``out``'s size.
        CollectiveError: ranks disagree, a peer died.
        RpcTimeoutError: the group's timeout passed.
    """
    g = member_group(group, "reduce_scatter")
    check_array(out, "reduce_scatter out", writable=True)
    ins = array_list(in_list, g.size, "reduce_scatter in_list")
    same_kind([out, *ins], out.dtype, "reduce_scatter")
    rop = check_op(op, out.dtype)
    if ins[g.rank].size != out.size:
        raise ConfigError(
            f"reduce_scatter: in_list[{g.rank}] has {ins[g.rank].size} elements, out {out.size}"
        )
    sizes = [i.size for i in ins]
    xp = xp_for(out)
    stream, device = cuda_stream(out)

    def body(seq: int) -> Any:
        meta = Meta("reduce_scatter", seq, rop, -1, out.dtype, sizes)
        dst, copied = flat(out)
        flats = [flat(i)[0] for i in ins]
        eng = engine_for(g, "reduce_scatter", xp, out.dtype, rop, stream, device, sizes)
        eng.reduce_scatter(seq, xp, flats, dst, rop, meta)
        writeback(out, dst, copied)
        return out

    return g.submit("reduce_scatter", body, async_op)


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Wait until every rank of the group has reached the barrier.

    Collectives on a group complete in issue order, so a barrier that returns
    also means this rank's earlier collectives on the group are complete.

    Raises:
        CollectiveError: not a member, or a peer died.
        RpcTimeoutError: the group's timeout passed.
    """
    g = member_group(group, "barrier")

    def body(seq: int) -> Any:
        meta = Meta("barrier", seq, 0, -1, "u1", ())
        engine_for(g, "barrier", xp_for(None), "u1", None, None, -1).barrier(seq, meta)
        return None

    return g.submit("barrier", body, async_op)
