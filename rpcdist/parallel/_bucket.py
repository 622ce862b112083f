"""``GradBucket``: the gradients of one bucket, as a communication hook sees them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import collectives as dist
from ..nn import Parameter
from ._arrays import xp_of
from ._buckets import FIRST_BUCKET_BYTES, BucketPlan, ParamSpec, plan_buckets

__all__ = ["GradBucket", "comm_overlap", "make_buckets"]


class GradBucket:
    """One bucket of gradients, flattened into one buffer, handed to a comm hook.

    A hook (``hook(state, bucket)``) reduces :meth:`buffer` across the
    process group and returns an :class:`rpcdist.Future` of the reduced flat
    array (the buffer itself, reduced in place, or a new array of the same
    size). DDP copies that result into the parameters' ``.grad``.

    Attributes:
        process_group: DDP's process group (``None``: the default group);
            the built-in hooks use it when their state names no group.
        world_size: Number of ranks in that group.
    """

    __module__ = "rpcdist.parallel"
    __slots__ = (
        "_buffer",
        "_flat",
        "_index",
        "_is_last",
        "_names",
        "_params",
        "_views",
        "future",
        "param_indices",
        "pending",
        "plan",
        "process_group",
        "world_size",
    )

    def __init__(
        self,
        index: int,
        plan: BucketPlan,
        params: Sequence[Parameter],
        names: Sequence[str],
        flat: Any,
        *,
        is_last: bool,
        process_group: dist.ProcessGroup | None,
        world_size: int,
    ) -> None:
        self._index = index
        self.plan = plan
        self._params = list(params)
        self._names = list(names)
        self._flat = flat  # the buffer, plus (last bucket) room for the status flags
        self._buffer = flat[: plan.numel]
        self._views = [
            self._buffer[off : off + p.data.size].reshape(p.shape)
            for p, off in zip(self._params, plan.offsets)
        ]
        self._is_last = is_last
        self.process_group = process_group
        self.world_size = world_size
        #: The reducer's bookkeeping (not for hooks).
        self.param_indices: tuple[int, ...] = plan.params
        self.pending = 0
        self.future: Any = None

    def index(self) -> int:
        """The bucket's position in the reduction order (0 is reduced first)."""
        return self._index

    def buffer(self) -> Any:
        """The flat array of every gradient in the bucket (NumPy or CuPy)."""
        return self._buffer

    def gradients(self) -> list[Any]:
        """One view into :meth:`buffer` per parameter, shaped like it."""
        return list(self._views)

    def parameters(self) -> list[Parameter]:
        """The bucket's parameters, in buffer order."""
        return list(self._params)

    def parameter_names(self) -> list[str]:
        """The parameters' names in the wrapped module, in buffer order."""
        return list(self._names)

    def is_last(self) -> bool:
        """Whether this is the last bucket reduced in an iteration."""
        return self._is_last

    def set_buffer(self, array: Any) -> None:
        """Copy ``array`` (same number of elements) into :meth:`buffer`."""
        self._buffer[...] = array.reshape(self._buffer.shape)

    def __repr__(self) -> str:
        return (
            f"<GradBucket {self._index}: {len(self._params)} parameters, "
            f"{self._buffer.size} x {self._buffer.dtype}>"
        )


def make_buckets(
    params: Sequence[Parameter],
    names: Sequence[str],
    group: dist.ProcessGroup | None,
    world: int,
    cap_bytes: int,
) -> tuple[list[GradBucket], list[tuple[int, int]]]:
    """The buckets of a model, and each parameter's ``(bucket, position)``.

    Buffers are zeroed arrays of the parameters' dtype on their device; the
    last bucket has room for one status flag per parameter after its
    gradients (see :mod:`._reducer`).
    """
    n = len(params)
    specs = [ParamSpec(p.data.size, p.data.dtype.itemsize, (p.dtype, p.device)) for p in params]
    plans = plan_buckets(specs, cap_bytes, FIRST_BUCKET_BYTES)
    buckets: list[GradBucket] = []
    where: list[tuple[int, int]] = [(0, 0)] * n
    for b, plan in enumerate(plans):
        last = b == len(plans) - 1
        first = params[plan.params[0]].data
        flat = xp_of(first).zeros(plan.numel + (n if last else 0), first.dtype)
        buckets.append(
            GradBucket(
                b,
                plan,
                [params[i] for i in plan.params],
                [names[i] for i in plan.params],
                flat,
                is_last=last,
                process_group=group,
                world_size=world,
            )
        )
        for pos, i in enumerate(plan.params):
            where[i] = (b, pos)
    return buckets, where


def comm_overlap(times: Sequence[Sequence[float]], end_of_backward: float) -> tuple[float, float]:
    """How long reductions ran, and how much of that before ``end_of_backward`` (pure).

    ``times`` holds each bucket's ``(launch, completion)`` in launch order.
    Reductions on a group run one at a time, so a bucket's runs from its
    launch (or the previous one's completion, if later) to its completion.
    """
    comm = hidden = prev = 0.0
    for start, done in times:
        begin = max(start, prev)
        comm += max(0.0, done - begin)
        hidden += max(0.0, min(done, end_of_backward) - begin)
        prev = max(prev, done)
    return comm, hidden
