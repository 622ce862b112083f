"""The collectives that move pieces without combining them: all_gather, gather, scatter, all_to_all.

Pieces may differ in size from rank to rank (the "-v" variants), including
empty ones. CuPy buffers are staged through host memory (NCCL takes
all_gather when every piece has the same size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import ConfigError
from ._calls import (
    array_list,
    cuda_stream,
    host_in,
    host_out,
    member_group,
    nccl_engine,
    run_engine,
    same_kind,
)
from ._group import ProcessGroup
from ._ops import Meta, check_array, flat, xp_for

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
        eng = nccl_engine(g, "all_gather", xp, buf.dtype, None, device, sizes)
        if eng is not None:
            whole = xp.module.empty(buf.size * g.size, buf.dtype)
            f, _ = flat(buf)
            g.run_async(
                eng.run(
                    "all_gather",
                    {"src": f, "out": whole, "device": device},
                    stream,
                    g.timeout,
                    meta.kind,
                )
            )
            for q, o in enumerate(outs):
                o[...] = whole[q * buf.size : (q + 1) * buf.size].reshape(o.shape)
            return list(out_list)
        staged = [host_out(o) for o in outs]
        hosts = [h for h, _ in staged]
        if g.size == 1:
            np.copyto(hosts[0], host_in(buf))
        else:
            run_engine(g, g.engine.all_gather(seq, host_in(buf), hosts, meta))
        for _, finish in staged:
            if finish is not None:
                finish()
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
        staged = [host_out(o) for o in outs] if outs is not None else None
        hosts = [h for h, _ in staged] if staged is not None else None
        if g.size == 1:
            assert hosts is not None
            np.copyto(hosts[0], host_in(buf))
        else:
            run_engine(g, g.engine.gather(seq, host_in(buf), hosts, root, meta))
        for _, finish in staged or ():
            if finish is not None:
                finish()
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
        host, finish = host_out(buf)
        hins = [host_in(i) for i in ins] if ins is not None else None
        if g.size == 1:
            assert hins is not None
            np.copyto(host, hins[0])
        else:
            run_engine(g, g.engine.scatter(seq, host, hins, root, meta))
        if finish is not None:
            finish()
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
        staged = [host_out(o) for o in outs]
        hosts = [h for h, _ in staged]
        hins = [host_in(i) for i in ins]
        if g.size == 1:
            np.copyto(hosts[0], hins[0])
        else:
            run_engine(g, g.engine.all_to_all(seq, hosts, hins, meta))
        for _, finish in staged:
            if finish is not None:
                finish()
        return list(out_list)

    return g.submit("all_to_all", body, async_op)
