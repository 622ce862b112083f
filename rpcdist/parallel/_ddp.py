"""``DistributedDataParallel``: one model replica per rank, gradients averaged.

See :mod:`._reducer` for the per-iteration protocol and ``docs/ddp.md`` for
the user's view.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import collectives as dist
from .._errors import ConfigError
from ..nn import Module
from ..tensor import is_grad_enabled
from ._arrays import group_size
from ._ft import FaultTolerance
from ._join import Join, Joinable, JoinHook
from ._reducer import CommHook, Reducer
from ._sync import broadcast_tensors, check_same_model, describe

__all__ = ["DistributedDataParallel"]

_WHAT = "DistributedDataParallel"


class DistributedDataParallel(Module, Joinable):
    """Data parallelism: the same model on every rank, gradients averaged in backward.

    At construction every rank checks that all ranks hold the same model
    (names, shapes, dtypes) and takes rank 0's parameters and buffers. Each
    forward (except under :meth:`no_sync`) arms a backward whose gradients
    are averaged across the group in buckets, each bucket's all-reduce
    launched the moment its last gradient is ready so communication runs
    under the rest of the backward. When ``backward()`` returns, every rank
    holds the same averaged ``.grad``.

    Args:
        module: The model (an :class:`rpcdist.nn.Module`), the same on every rank.
        process_group: The ranks to average over (None: the default group).
        bucket_cap_mb: Size of a bucket in MiB (the first bucket is 1 MiB at most).
        broadcast_buffers: Copy rank 0's buffers to every rank at each forward.
        find_unused_parameters: Allow parameters that get no gradient on
            some or all ranks in an iteration: they count as zero where
            missing, and a parameter no rank used keeps its ``.grad``.
            Without it such an iteration raises ``AutogradError`` on every
            rank, naming the parameters and the ranks.
        gradient_as_bucket_view: Make ``.grad`` a view into the bucket
            buffers (no copy after the reduction).
        static_graph: The same parameters are used in every iteration:
            unused ones are found in the first iteration only.
        fault_tolerance: A :class:`FaultTolerance`: no process group; the
            backward keeps its gradients local and ``fault_tolerance.commit()``
            averages them over the step's live members
            (``docs/fault-tolerance.md``). The other arguments are ignored.

    Raises:
        ConfigError: bad arguments, this process is not a member of the
            group, or the model differs across ranks (on every rank).
        CollectiveError: a rank failed while the model was being checked.
    """

    __module__ = "rpcdist.parallel"

    def __init__(
        self,
        module: Module,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        fault_tolerance: FaultTolerance | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise ConfigError(f"{_WHAT}: module must be an rpcdist.nn.Module, got {module!r:.60}")
        if isinstance(module, DistributedDataParallel):
            raise ConfigError(f"{_WHAT}: the module is already wrapped in {_WHAT}")
        if not bucket_cap_mb > 0:
            raise ConfigError(f"{_WHAT}: bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        self.module = module
        self.process_group = process_group
        self.fault_tolerance = fault_tolerance
        if fault_tolerance is not None:  # no process group: see docs/fault-tolerance.md
            fault_tolerance.attach([p for p in module.parameters() if p.requires_grad])
            fault_tolerance.register_state("module", module)
            self.broadcast_buffers, self._buffer_list = False, []
            self._sync, self._divide_by_initial_world_size = True, True
            return
        self.rank, self.world_size = group_size(process_group, _WHAT)
        self.broadcast_buffers = broadcast_buffers
        params = list(module.named_parameters())
        buffers = list(module.named_buffers())
        lines = describe(params, "parameter") + describe(buffers, "buffer")
        check_same_model(lines, process_group, _WHAT)
        broadcast_tensors([p for _, p in params] + [b for _, b in buffers], 0, process_group)
        self._buffer_list = [b for _, b in buffers]
        self.reducer = Reducer(
            [(n, p) for n, p in params if p.requires_grad],
            process_group,
            bucket_cap_bytes=max(1, int(bucket_cap_mb * (1 << 20))),
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        self._sync = True
        self._divide_by_initial_world_size = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; arm the gradient reduction of the backward that follows.

        Raises:
            AutogradError: the previous iteration's reduction did not finish.
            CollectiveError: a buffer broadcast or a Join exchange failed.
        """
        if self.fault_tolerance is not None:
            return self.module(*args, **kwargs)
        grad_on = is_grad_enabled()
        sync = grad_on and self._sync
        in_join = Join.context_of(self) is not None
        active = Join.notify_join_context(self) if in_join and sync else None
        if self.broadcast_buffers and self._buffer_list and (sync or not in_join):
            broadcast_tensors(self._buffer_list, min(active) if active else 0, self.process_group)
        out = self.module(*args, **kwargs)
        if sync:
            expected, scale = self._participation(active)
            self.reducer.active = active
            self.reducer.prepare(out, expected=expected, scale=scale)
            _join_autograd_context(self.reducer)
        elif grad_on:
            self.reducer.begin_local()
        return out

    def _participation(self, active: list[int] | None) -> tuple[int, float]:
        if active is None:
            return self.world_size, 1.0
        if self._divide_by_initial_world_size:
            return len(active), 1.0
        return len(active), self.world_size / len(active)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside accumulate their gradients locally, without communication.

        The first forward after the block synchronises again and its
        backward averages everything accumulated meanwhile.
        """
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead of the all-reduce.

        The hook gets a :class:`GradBucket` and returns an
        :class:`rpcdist.Future` of the reduced flat array (see
        :mod:`rpcdist.parallel.comm_hooks`). It runs on the thread running
        backward and must issue every collective it needs itself, in a fixed
        order (not from a future's callback, which would race with the next
        bucket's). Register it on every rank, before training.

        Raises:
            ConfigError: ``hook`` is not callable, or a hook is already registered.
        """
        if not callable(hook):
            raise ConfigError(f"register_comm_hook: hook must be callable, got {hook!r:.60}")
        if self.reducer.hook is not None:
            raise ConfigError("register_comm_hook: a communication hook is already registered")
        self.reducer.hook, self.reducer.hook_state = hook, state

    # ------------------------------------------------------------------ Join

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """``Join([self], ...)``: a context for inputs of different lengths per rank."""
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows DDP's collectives on ranks that ran out of inputs.

        Args:
            **kwargs: ``divide_by_initial_world_size`` (default True): average
                over the whole group, joined ranks counting as zero, or over
                the ranks still training.
        """
        divide = bool(kwargs.get("divide_by_initial_world_size", True))
        self._divide_by_initial_world_size = divide
        return _DDPJoinHook(self)

    @property
    def join_process_group(self) -> dist.ProcessGroup | None:
        """The process group DDP averages over."""
        return self.process_group

    def statistics(self) -> dict[str, Any]:
        """Buckets, iterations, reductions in flight, timings of the last iteration (see Reducer)."""
        return self.reducer.statistics()

    def extra_repr(self) -> str:
        if self.fault_tolerance is not None:
            return "fault_tolerant=True"
        return f"world_size={self.world_size}, buckets={len(self.reducer.buckets)}"


class _DDPJoinHook(JoinHook):
    """Shadow: buffer broadcast and zero-gradient bucket reductions; end: sync the model."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        ctx = Join.context_of(ddp)
        active: list[int] = ctx.active if ctx is not None and ctx.active else [0]
        if ddp.broadcast_buffers and ddp._buffer_list:
            broadcast_tensors(ddp._buffer_list, min(active), ddp.process_group)
        expected, scale = ddp._participation(active)
        ddp.reducer.active = active
        ddp.reducer.shadow(expected=expected, scale=scale)

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = np.array([ddp.rank if is_last_joiner else -1], np.int64)
        dist.all_reduce(src, dist.ReduceOp.MAX, group=ddp.process_group)
        tensors = [p for p in ddp.module.parameters()] + ddp._buffer_list
        broadcast_tensors(tensors, int(src[0]), ddp.process_group)
        ddp.reducer.active = None
        ddp._divide_by_initial_world_size = True


def _join_autograd_context(reducer: Any) -> None:
    """Inside ``rpcdist.autograd.context()``: the distributed backward rooted
    here feeds this reducer (gradients go to the context, not ``.grad``)."""
    from ..autograd._context import CURRENT

    context_id = CURRENT.get()
    if context_id is None:
        return
    from .._rpc._context import current_agent
    from ..autograd._extension import ext

    ext(current_agent()).context(context_id).reducers.append(reducer)
