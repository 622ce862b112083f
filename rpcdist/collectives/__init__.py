"""Collectives: all-reduce and friends among processes, over NumPy and CuPy arrays.

Vocabulary follows ``torch.distributed``::

    from rpcdist import collectives as dist
    dist.init_process_group()               # or on top of rpcdist.init_rpc()
    dist.all_reduce(grad)                   # in place, ReduceOp.SUM
    work = dist.all_reduce(x, async_op=True); ...; work.wait()
    dist.destroy_process_group()

Ranks on one host exchange data through shared memory; across hosts through
the agent's gRPC streams; CuPy buffers on one GPU per rank through NCCL.
Collectives on a group complete in the order they were issued. A failed
collective (mismatched calls, a dead peer, a timeout) raises on every rank
involved and leaves the group unusable. See ``docs/collectives.md``.
"""

from __future__ import annotations

from .._publish import publish
from ._api import (
    destroy_process_group,
    get_backend,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)
from ._calls import all_reduce, barrier, broadcast, reduce, reduce_scatter
from ._exchange import all_gather, all_to_all, gather, scatter
from ._group import ProcessGroup
from ._ops import ReduceOp
from ._sendrecv import irecv, isend, recv, send
from ._work import Work

__all__ = [
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]

publish(__name__, __all__, globals())
