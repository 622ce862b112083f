"""Communication hooks for :meth:`DistributedDataParallel.register_comm_hook`.

A hook is ``hook(state, bucket) -> rpcdist.Future`` of the reduced flat
array (averaged over the group). The state of the simple hooks is a process
group, or ``None`` for DDP's own group::

    ddp.register_comm_hook(None, comm_hooks.fp16_compress_hook)
    state = comm_hooks.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=10)
    ddp.register_comm_hook(state, comm_hooks.powerSGD_hook)

Bytes each rank sends per bucket of n float32 values, against the default
all-reduce's ``2(p-1)/p * 4n``: ``fp16_compress_hook`` and
``bf16_compress_hook`` half of it; ``powerSGD_hook`` ``(a+b) * rank``
instead of ``a * b`` for each ``a x b`` matrix (1-D tensors go uncompressed).

A hook runs on the thread running backward. It must issue every collective
it needs from its own body, in an order that depends on nothing but the
bucket: a collective issued later from a future's callback could be issued
after the next bucket's on one rank and before it on another. Work that
depends on a first collective's result can still sit between two
collectives: issue both, with the work in a callback attached to the first
one's future before the second is issued (collectives on a group run one at
a time, and an op's callbacks run before the next op starts, so the second
reads its input after the callback wrote it). ``bf16_compress_hook`` and
``powerSGD_hook`` work this way.
"""

from __future__ import annotations

from typing import Any

from .. import collectives as dist
from .._futures import Future
from ._arrays import future_of, xp_of
from ._bf16 import bf16_sum, from_bf16, to_bf16
from ._bucket import GradBucket
from ._powersgd import PowerSGDState, powerSGD_hook

__all__ = [
    "PowerSGDState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "powerSGD_hook",
]


def _group(state: Any, bucket: GradBucket) -> dist.ProcessGroup | None:
    return state if isinstance(state, dist.ProcessGroup) else bucket.process_group


def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Future[Any]:
    """Average the bucket with one all-reduce (what DDP does without a hook).

    Args:
        process_group: The group (None: DDP's group).
        bucket: The gradients.

    Returns:
        A Future of the bucket's buffer, averaged in place.
    """
    work = dist.all_reduce(
        bucket.buffer(), dist.ReduceOp.AVG, group=_group(process_group, bucket), async_op=True
    )
    return future_of(work)


def fp16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Future[Any]:
    """All-reduce the bucket as float16: half the bytes, about 3 significant digits.

    Each rank divides by the group size first (so the float16 sum cannot
    overflow where the average does not), sums in float16, and the result is
    widened back into the buffer.

    Returns:
        A Future of the buffer holding the averaged values.
    """
    buf = bucket.buffer()
    xp = xp_of(buf)
    half = (buf * (1.0 / bucket.world_size)).astype(xp.float16)
    work = dist.all_reduce(half, group=_group(process_group, bucket), async_op=True)

    def widen(f: Future[Any]) -> Any:
        f.value()
        buf[...] = half
        return buf

    return future_of(work).then(widen)


def bf16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Future[Any]:
    """Average the bucket with bfloat16 on the wire (emulated: see below).

    NumPy has no bfloat16, so values travel as the top 16 bits of their
    float32 (rounded to nearest even) in ``uint16`` arrays, which no
    collective can add. The hook builds the all-reduce from two steps that
    move them as they are: an all-to-all sends slice ``q`` of every rank's
    (pre-divided) values to rank ``q``, which widens them and sums in float32
    in rank order; an all-gather returns the slices, rounded to bfloat16
    again. The bytes are half a float32 all-reduce's; the result is the same
    on every rank.

    Returns:
        A Future of the buffer holding the averaged values.
    """
    group = _group(process_group, bucket)
    buf = bucket.buffer()
    xp = xp_of(buf)
    p, n = bucket.world_size, buf.size
    me = dist.get_rank(group)
    bounds = [n * q // p for q in range(p + 1)]
    sizes = [bounds[q + 1] - bounds[q] for q in range(p)]
    enc = to_bf16(buf * (1.0 / p))
    send = [enc[bounds[q] : bounds[q + 1]] for q in range(p)]
    recv = [xp.empty(sizes[me], xp.uint16) for _ in range(p)]
    mine = xp.empty(sizes[me], xp.uint16)
    first = future_of(dist.all_to_all(recv, send, group=group, async_op=True))

    def reduce_slice(f: Future[Any]) -> None:
        f.value()
        mine[...] = to_bf16(bf16_sum(recv))

    reduced = first.then(reduce_slice)  # runs before the all-gather below reads ``mine``
    slices = [xp.empty(s, xp.uint16) for s in sizes]
    second = future_of(dist.all_gather(slices, mine, group=group, async_op=True))

    def widen(f: Future[Any]) -> Any:
        f.value()
        reduced.value()
        for q in range(p):
            buf[bounds[q] : bounds[q + 1]] = from_bf16(slices[q])
        return buf

    return second.then(widen)


for _name in ("PowerSGDState", "powerSGD_hook"):
    globals()[_name].__module__ = __name__
del _name
