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

import math
from typing import Any

from .. import collectives as dist
from .._futures import Future
from ._arrays import future_of, xp_of
from ._bf16 import from_bf16, to_bf16
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


class _Codec:
    """How a compressing hook puts float32 values on the wire and back."""

    header = 0  # wire elements in front of each block

    def __init__(self, wire: Any) -> None:
        self.wire = wire

    def encode(self, a: Any) -> Any:
        raise NotImplementedError

    def decode(self, w: Any) -> Any:
        raise NotImplementedError


class _Fp16(_Codec):
    """float16 with a power-of-two scale per block, carried in the block's first element.

    The scale puts the block's largest magnitude near 2**14, so gradients
    (often 1e-5 and below) do not fall into float16's subnormal range,
    where they would lose precision (and where NumPy's conversion is about
    30 times slower).
    """

    header = 1

    def encode(self, a: Any) -> Any:
        xp = xp_of(a)
        out = xp.empty(a.size + 1, xp.float16)
        big = float(xp.abs(a).max()) if a.size else 0.0
        e = 0 if not 0 < big < math.inf else max(-60, min(60, math.floor(math.log2(2**14 / big))))
        out[0] = e
        out[1:] = a * (2.0**e)
        return out

    def decode(self, w: Any) -> Any:
        xp = xp_of(w)
        return xp.multiply(w[1:], 2.0 ** -float(w[0]), dtype=xp.float32)


class _Bf16(_Codec):
    def encode(self, a: Any) -> Any:
        return to_bf16(a)

    def decode(self, w: Any) -> Any:
        return from_bf16(w)


def _compressed_average(
    group: dist.ProcessGroup | None, bucket: GradBucket, codec: _Codec
) -> Future[Any]:
    """Average ``bucket`` with compressed values on the wire, summing in float32.

    An all-reduce would add in the wire type (slow and lossy for float16 in
    NumPy; impossible for emulated bfloat16). Instead an all-to-all sends
    slice ``q`` of every rank's pre-divided, encoded values to rank ``q``,
    which decodes them and sums in float32 in rank order; an all-gather
    returns the encoded sums. That is the bytes of a ring all-reduce in the
    wire type (plus a header per block), and the same result on every rank.
    """
    buf = bucket.buffer()
    xp = xp_of(buf)
    p, n, h = bucket.world_size, buf.size, codec.header
    me = dist.get_rank(group)
    bounds = [n * q // p for q in range(p + 1)]
    sizes = [bounds[q + 1] - bounds[q] for q in range(p)]
    scaled = xp.multiply(buf, 1.0 / p, dtype=xp.float32)
    send = [codec.encode(scaled[bounds[q] : bounds[q + 1]]) for q in range(p)]
    recv = [xp.empty(sizes[me] + h, codec.wire) for _ in range(p)]
    mine = xp.empty(sizes[me] + h, codec.wire)
    first = future_of(dist.all_to_all(recv, send, group=group, async_op=True))

    def reduce_slice(f: Future[Any]) -> None:
        f.value()
        acc = codec.decode(recv[0]).astype(xp.float32, copy=True)
        for part in recv[1:]:
            acc += codec.decode(part)
        mine[...] = codec.encode(acc)

    reduced = first.then(reduce_slice)  # runs before the all-gather below reads ``mine``
    slices = [xp.empty(s + h, codec.wire) for s in sizes]
    second = future_of(dist.all_gather(slices, mine, group=group, async_op=True))

    def widen(f: Future[Any]) -> Any:
        f.value()
        reduced.value()
        for q in range(p):
            buf[bounds[q] : bounds[q + 1]] = codec.decode(slices[q])
        return buf

    return second.then(widen)


def fp16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Future[Any]:
    """Average the bucket with float16 on the wire: half the bytes, about 3 significant digits.

    Values are divided by the group size, scaled by a power of two per
    block (so small gradients do not become float16 subnormals; the scale
    travels with the block) and rounded to float16. The additions are done
    in float32, and the average comes back as float16, widened into the
    buffer (see ``_compressed_average``).

    Returns:
        A Future of the buffer holding the averaged values.
    """
    codec = _Fp16(xp_of(bucket.buffer()).float16)
    return _compressed_average(_group(process_group, bucket), bucket, codec)


def bf16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Future[Any]:
    """Average the bucket with bfloat16 on the wire (emulated: see below).

    NumPy has no bfloat16, so a value travels as the top 16 bits of its
    float32, *truncated* (rounded toward zero; relative error below 2**-7),
    in a ``uint16`` array. No collective can add those, so the additions
    are done in float32 after widening, as for ``fp16_compress_hook``: half
    the bytes of the float32 all-reduce, the same result on every rank.

    Returns:
        A Future of the buffer holding the averaged values.
    """
    codec = _Bf16(xp_of(bucket.buffer()).uint16)
    return _compressed_average(_group(process_group, bucket), bucket, codec)


for _name in ("PowerSGDState", "powerSGD_hook"):
    globals()[_name].__module__ = __name__
del _name
