"""The collectives that move pieces without combining them: all_gather, gather, scatter, all_to_all.

Pieces may differ in size from rank to rank (the "-v" variants), including
empty ones. CuPy buffers are staged through host memory (NCCL takes
all_gather when every piece has the same size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import ConfigError
from ._calls import array_list, member_group, same_kind
from ._engine import cuda_stream, engine_for
from ._group import ProcessGroup
from ._ops import Meta, check_array, xp_for

__all__ = ["all_gather", "all_to_all", "gather", "scatter"]


def all_gather(
    out_list: Sequence[Any], buf: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> Any:
    """Every rank's ``buf`` into ``out_list[rank]`` on every rank; sizes may differ (all-gather-v).

    Raises:
        ConfigError: ``out_list`` is not one array per rank, a dtype differs,
            or ``out_list[my rank]`` does not match ``buf``'s size.
        CollectiveError: ranks disagree on sizes or dtype, a peer died.
        RpcTimeoutError: the group's timeout passed.
    """
    g = member_group(group, "all_gather")
    check_array(buf, "all_gather buf")
    outs = array_list(out_list, g.size, "all_gather out_list", writable=True)
    same_kind([buf, *outs], buf.dtype, "all_gather")
    if outs[g.rank].size != buf.size:
        raise ConfigError(
            f"all_gather: out_list[{g.rank}] has {outs[g.rank].size} elements, buf {buf.size}"
        )
    sizes = [o.size for o in outs]
    xp = xp_for(buf)
    stream, device = cuda_stream(buf)

    def body(seq: int) -> Any:
        meta = Meta("all_gather", seq, 0, -1, buf.dtype, sizes)
        eng = engine_for(g, "all_gather", xp, buf.dtype, None, stream, device, sizes)
        eng.all_gather(seq, buf, outs, meta)
        return list(out_list)

    return g.submit("all_gather", body, async_op)


def gather(
    buf: Any,
    gather_list: Sequence[Any] | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Every rank's ``buf`` into ``gather_list[rank]`` on global rank ``dst``.

    ``gather_list`` is needed on ``dst`` only (ignored elsewhere); sizes may differ.

    Raises:
        ConfigError: a bad list on ``dst``.
        CollectiveError: ``dst`` is not a member, sizes disagree, a peer died.
        RpcTimeoutError: the group's timeout passed.
    """
    g = member_group(group, "gather")
    root = g.group_rank(dst, "gather")
    check_array(buf, "gather buf")
    outs = (
        array_list(gather_list, g.size, "gather gather_list", writable=True)
        if g.rank == root
        else None
    )
    if outs is not None:
        same_kind([buf, *outs], buf.dtype, "gather")
        if outs[root].size != buf.size:
            raise ConfigError(
                f"gather: gather_list[{root}] has {outs[root].size} elements, buf {buf.size}"
            )

    def body(seq: int) -> Any:
        meta = Meta(
            "gather",
            seq,
            0,
            root,
            buf.dtype,
            (),
            [buf.size],
            [o.size for o in outs] if outs else [],
        )
        _host_engine(g, "gather").gather(seq, buf, outs, root, meta)
        return list(gather_list) if outs is not None and gather_list is not None else None

    return g.submit("gather", body, async_op)


def scatter(
    buf: Any,
    scatter_list: Sequence[Any] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """``scatter_list[rank]`` of global rank ``src`` into ``buf`` on every rank.

    ``scatter_list`` is needed on ``src`` only; sizes may differ.

    Raises:
        ConfigError: a bad list on ``src``.
        CollectiveError: ``src`` is not a member, sizes disagree, a peer died.
        RpcTimeoutError: the group's timeout passed.
    """
    g = member_group(group, "scatter")
    root = g.group_rank(src, "scatter")
    check_array(buf, "scatter buf", writable=True)
    ins = array_list(scatter_list, g.size, "scatter scatter_list") if g.rank == root else None
    if ins is not None:
        same_kind([buf, *ins], buf.dtype, "scatter")
        if ins[root].size != buf.size:
            raise ConfigError(
                f"scatter: scatter_list[{root}] has {ins[root].size} elements, buf {buf.size}"
            )

    def body(seq: int) -> Any:
        meta = Meta(
            "scatter", seq, 0, root, buf.dtype, (), [i.size for i in ins] if ins else [], [buf.size]
        )
        _host_engine(g, "scatter").scatter(seq, buf, ins, root, meta)
        return buf

    return g.submit("scatter", body, async_op)


def all_to_all(
    out_list: Sequence[Any],
    in_list: Sequence[Any],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Rank ``r`` sends ``in_list[q]`` to rank ``q``, receiving into ``out_list[q]``; sizes may differ.

    Raises:
        ConfigError: lists of the wrong length, dtypes differ, or
            ``out_list[r]`` and ``in_list[r]`` differ in size.
        CollectiveError: what one rank sends another does not expect, a peer died.
        RpcTimeoutError: the group's timeout passed.
    """
    g = member_group(group, "all_to_all")
    outs = array_list(out_list, g.size, "all_to_all out_list", writable=True)
    ins = array_list(in_list, g.size, "all_to_all in_list")
    same_kind([*outs, *ins], ins[0].dtype, "all_to_all")
    if outs[g.rank].size != ins[g.rank].size:
        raise ConfigError(f"all_to_all: out_list[{g.rank}] and in_list[{g.rank}] differ in size")

    def body(seq: int) -> Any:
        meta = Meta(
            "all_to_all",
            seq,
            0,
            -1,
            ins[0].dtype,
            (),
            [i.size for i in ins],
            [o.size for o in outs],
        )
        _host_engine(g, "all_to_all").all_to_all(seq, outs, ins, meta)
        return list(out_list)

    return g.submit("all_to_all", body, async_op)


def _host_engine(g: ProcessGroup, kind: str) -> Any:
    """The engine of ops NCCL does not run (any buffer: staged through host memory)."""
    return engine_for(g, kind, xp_for(None), "u1", None, None, -1)
