"""Communication hooks for :meth:`DistributedDataParallel.register_comm_hook`.

A hook is ``hook(state, bucket) -> rpcdist.Future`` of the reduced flat
array (averaged over the group). The state of the simple hooks is a process
group, or ``None`` for DDP's own group::

    ddp.register_comm_hook(None, comm_hooks.fp16_compress_hook)
    state = comm_hooks.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=10)
    ddp.register_comm_hook(state, comm_hooks.powerSGD_hook)

Bytes each rank sends per bucket of n float32 values, against the default
all-reduce's ``2(p-1)/p * 4n``: ``fp16_compress_hook`` and
``bf16_compress_hook`` half of it between hosts (on shared memory they
are the plain all-reduce: see there); ``powerSGD_hook`` ``(a+b) * rank``
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
from ._bf16 import from_bf16, from_fp16, to_bf16, to_fp16
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
    """How a compressing hook puts float32 values on the wire (``uint16``) and back.

    Each block carries ``header`` wire elements in front of its values.
    """

    header = 0

    def encode(self, a: Any, out: Any, scale: float) -> None:
        """Write ``a * scale`` (with its header) into ``out``."""
        raise NotImplementedError

    def decode(self, w: Any, out: Any) -> None:
        """Write the values of block ``w`` into ``out`` (float32)."""
        raise NotImplementedError


class _Fp16(_Codec):
    """float16 with a power-of-two scale per block, carried in the block's first element.

    The scale puts the block's largest magnitude near 2**14, so gradients
    (often 1e-5 and below) do not fall into float16's subnormal range and
    large ones do not overflow (PyTorch's hook turns values beyond 65504
    into infinity). Infinity and NaN in a block stay infinity and NaN, so
    a gradient scaler still sees them.
    """

    header = 1

    def encode(self, a: Any, out: Any, scale: float) -> None:
        big = max(float(a.max()), -float(a.min())) if a.size else 0.0
        e = 0 if not 0 < big < math.inf else max(-60, min(60, math.floor(math.log2(2**14 / big))))
        out[:1] = xp_of(out).float16(e).view(xp_of(out).uint16)
        to_fp16(a, out[1:], scale * 2.0**e)

    def decode(self, w: Any, out: Any) -> None:
        e = float(w[:1].view(xp_of(w).float16)[0])
        from_fp16(w[1:], out, 2.0**-e)


class _Bf16(_Codec):
    def encode(self, a: Any, out: Any, scale: float) -> None:
        to_bf16(a, out, scale)

    def decode(self, w: Any, out: Any) -> None:
        from_bf16(w, out)


def _compressed_average(
    group: dist.ProcessGroup | None, bucket: GradBucket, codec: _Codec
) -> Future[Any]:
    """Average ``bucket`` with compressed values on the wire, summing in float32.

    An all-reduce would add in the wire type (slow and lossy for float16 in
    NumPy; impossible for bfloat16). Instead an all-to-all sends slice ``q``
    of every rank's values, divided by the group size as they are encoded,
    to rank ``q``, which decodes them and sums in float32 in rank order; an
    all-gather returns the encoded sums, decoded straight into the bucket.
    That is the bytes of a ring all-reduce in the wire type (plus a header
    per block), and the same result on every rank.
    """
    buf = bucket.buffer()
    xp = xp_of(buf)
    p, n, h = bucket.world_size, buf.size, codec.header
    me = dist.get_rank(group)
    bounds = [n * q // p for q in range(p + 1)]
    sizes = [bounds[q + 1] - bounds[q] for q in range(p)]
    send = [xp.empty(s + h, xp.uint16) for s in sizes]
    for q in range(p):
        codec.encode(buf[bounds[q] : bounds[q + 1]], send[q], 1.0 / p)
    recv = [xp.empty(sizes[me] + h, xp.uint16) for _ in range(p)]
    mine = xp.empty(sizes[me] + h, xp.uint16)
    first = future_of(dist.all_to_all(recv, send, group=group, async_op=True))

    def reduce_slice(f: Future[Any]) -> None:
        f.value()
        acc = buf[bounds[me] : bounds[me + 1]]  # this rank's slice is not read again
        part = xp.empty_like(acc)
        codec.decode(recv[0], acc)
        for w in recv[1:]:
            codec.decode(w, part)
            acc += part
        codec.encode(acc, mine, 1.0)

    reduced = first.then(reduce_slice)  # runs before the all-gather below reads ``mine``
    slices = [xp.empty(s + h, xp.uint16) for s in sizes]
    second = future_of(dist.all_gather(slices, mine, group=group, async_op=True))

    def widen(f: Future[Any]) -> Any:
        f.value()
        reduced.value()
        for q in range(p):
            codec.decode(slices[q], buf[bounds[q] : bounds[q + 1]])
        return buf

    return second.then(widen)


def _on_shared_memory(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` reduces NumPy buffers through shared memory (one host)."""
    return dist.get_backend(group) == "shm"


def fp16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Future[Any]:
    """Average the bucket with float16 on the wire: half the bytes, about 3 significant digits.

    Values are divided by the group size, scaled by a power of two per
    block (so small gradients do not become float16 subnormals and large
    ones do not overflow; the scale travels with the block) and rounded to
    nearest float16. The additions are done in float32, and the average
    comes back as float16, widened into the buffer (see
    ``_compressed_average``).

    On shared memory (``get_backend(group) == "shm"``: every rank on one
    host) it is the plain float32 all-reduce: there, moving the bytes costs
    less than converting them, so compression would only slow the step and
    lose precision.

    Returns:
        A Future of the buffer holding the averaged values.
    """
    group = _group(process_group, bucket)
    if _on_shared_memory(group):
        return allreduce_hook(group, bucket)
    return _compressed_average(group, bucket, _Fp16())


def bf16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Future[Any]:
    """Average the bucket with bfloat16 on the wire: half the bytes, about 2 significant digits.

    Values are rounded to the nearest bfloat16 (ties to even, as
    ``ml_dtypes.bfloat16`` and hardware do) and travel as their bits in a
    ``uint16`` array. No collective can add those, so the additions are
    done in float32 after widening, as for ``fp16_compress_hook``: half the
    bytes of the float32 all-reduce, the same result on every rank. On
    shared memory it is the plain all-reduce, as ``fp16_compress_hook``.

    Returns:
        A Future of the buffer holding the averaged values.
    """
    group = _group(process_group, bucket)
    if _on_shared_memory(group):
        return allreduce_hook(group, bucket)
    return _compressed_average(group, bucket, _Bf16())


for _name in ("PowerSGDState", "powerSGD_hook"):
    globals()[_name].__module__ = __name__
del _name
