"""The reducer: averages DDP's gradients in buckets while backward still runs.

One iteration, on every rank of the group::

    forward  -> prepare()            arm: every parameter expects a gradient
    backward -> grad_ready(p, g)     copy g into p's bucket slot; when a bucket
                                     is complete and all buckets before it were
                                     launched, launch its all-reduce (async)
             -> finalize()           end of backward (an engine callback):
                                     launch what is left, wait, check that the
                                     ranks agree on who got gradients, write
                                     the averages into .grad

Buckets are launched strictly in index order, so every rank issues the same
collectives in the same order whatever order its gradients arrive in.

Every rank also reports which parameters got a gradient (a 0/1 flag per
parameter). With the default all-reduce the flags ride in spare room at the
end of the last bucket (no extra collective); with a comm hook they take one
small all-reduce after the last bucket. Summed, they say on how many ranks
each parameter took part, which is what ``find_unused_parameters`` needs to
leave parameters that no rank used alone, and what turns PyTorch's "Expected
to have finished reduction in the prior iteration" into an error raised on
every rank at the end of the backward that went wrong, naming the
parameters and the ranks.

Distributed autograd can drive the same object without ``.grad``: call
:meth:`Reducer.grad_ready` with each leaf's gradient from its own pass and
:meth:`Reducer.finalize` with its gradient map when the pass is over.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import numpy as np

from .. import collectives as dist
from .._errors import AutogradError, ConfigError, RpcdistError
from .._futures import Future
from ..nn import Parameter
from ..tensor import AccumulateGrad, Tensor, compute_dependencies
from ..tensor._engine import current_graph_task
from ._arrays import future_of, group_size, host, xp_of
from ._bucket import GradBucket, comm_overlap, make_buckets
from ._unused import raise_unused

__all__ = ["CommHook", "Reducer"]

_log = logging.getLogger(__name__)

#: ``hook(state, bucket)`` -> Future of the reduced flat array.
CommHook = Callable[[Any, GradBucket], "Future[Any]"]

_IDLE, _ARMED, _LOCAL = "idle", "armed", "local"


def _make_hook(ref: weakref.ref[Reducer], index: int) -> Callable[[Tensor], None]:
    def on_accumulated(param: Tensor) -> None:
        reducer = ref()
        if reducer is not None:
            reducer.on_accumulated(index, param)

    return on_accumulated


class Reducer:
    """Buckets, their all-reduces and the per-iteration state of one DDP model.

    Args:
        named_params: ``(name, parameter)`` pairs, in ``parameters()`` order,
            of the parameters that require grad.
        group: The process group (None: the default group).
        bucket_cap_bytes: Bucket size cap.
        find_unused_parameters: Allow parameters without a gradient on
            some or all ranks (see :meth:`finalize`).
        gradient_as_bucket_view: Leave ``.grad`` as a view into the bucket.
        static_graph: The set of parameters used does not change between
            iterations: look for unused ones in the first iteration only.

    Raises:
        ConfigError: this process is not a member of ``group``.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, Parameter]],
        group: dist.ProcessGroup | None,
        *,
        bucket_cap_bytes: int,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        static_graph: bool,
    ) -> None:
        self.group = group
        self.rank, self.world = group_size(group, "DistributedDataParallel")
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self._position = {id(p): i for i, p in enumerate(self.params)}
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.static_graph = static_graph
        n = len(self.params)
        self.buckets, self._where = make_buckets(
            self.params, self.names, group, self.world, bucket_cap_bytes
        )
        _log.debug(
            "DDP rank %d/%d: %d parameters in %d buckets of %s elements",
            self.rank,
            self.world,
            n,
            len(self.buckets),
            [b.plan.numel for b in self.buckets],
        )
        self.hook: CommHook | None = None
        self.hook_state: Any = None
        self.expected = self.world  # ranks that take part (fewer while some joined)
        self.scale = 1.0  # applied to the averages (Join: divide by the ranks taking part)
        self.active: list[int] | None = None
        self._state = _IDLE
        self._shadow = False
        self._ready = [False] * n
        self._used = [0] * n
        self._got = [False] * n  # a gradient came in this iteration's backward
        self._local = [False] * n  # gradient accumulated under no_sync since the last sync
        self._unreached: list[int] = []
        self._static_unused: list[int] | None = None
        self._marked_any = False
        self._next = 0
        self._status_work: Any = None
        self.iterations = 0
        self.last_wait_s = 0.0
        self.last_comm_s = 0.0  # reductions' run time in the last iteration ...
        self.last_hidden_s = 0.0  # ... and the part of it before backward ended
        self._times: list[list[float]] = [[0.0, 0.0] for _ in self.buckets]
        self._last_grad_t = 0.0  # when the last gradient of this iteration came in
        ref = weakref.ref(self)
        self._handles = [
            p.register_post_accumulate_grad_hook(_make_hook(ref, i))
            for i, p in enumerate(self.params)
        ]

    # ----------------------------------------------------------- iteration state

    def _check_finished(self, what: str) -> None:
        if self._state is _ARMED and self._marked_any:
            done = [self.names[i] for i in range(len(self.params)) if self._ready[i]]
            missing = [self.names[i] for i in range(len(self.params)) if not self._ready[i]]
            self._reset()
            raise AutogradError(
                f"DistributedDataParallel {what} (rank {self.rank}): the previous iteration's "
                f"gradient reduction did not finish: {done} got gradients, {missing} did not, "
                "and the backward pass never ended (it raised, or gradients were fed with "
                "grad_ready() without finalize()); run forward and backward in pairs"
            )

    def prepare(self, outputs: Any, *, expected: int, scale: float = 1.0) -> None:
        """Arm the reducer for the backward of a synchronised forward.

        Args:
            outputs: The forward's outputs (searched for unused parameters
                when ``find_unused_parameters`` or ``static_graph``).
            expected: Ranks that take part in this iteration.
            scale: Factor applied to the averaged gradients.

        Raises:
            AutogradError: the previous iteration's reduction is half-done.
        """
        self._check_finished("forward")
        self._reset()
        self._state = _ARMED
        self.expected, self.scale = expected, scale
        if self.static_graph and self._static_unused is not None:
            self._unreached = list(self._static_unused)
        elif self.find_unused or self.static_graph:
            self._unreached = self._find_unreached(outputs)

    def begin_local(self) -> None:
        """A forward under ``no_sync``: its backward only accumulates locally.

        Raises:
            AutogradError: the previous iteration's reduction is half-done.
        """
        self._check_finished("forward under no_sync()")
        self._reset()
        self._state = _LOCAL

    def _reset(self) -> None:
        n = len(self.params)
        self._state = _IDLE
        self._shadow = False
        self._ready = [False] * n
        self._used = [0] * n
        self._got = [False] * n
        self._unreached = []
        self._marked_any = False
        self._next = 0
        self._status_work = None
        for b in self.buckets:
            b.pending = len(b.param_indices)
            b.future = None

    def _find_unreached(self, outputs: Any) -> list[int]:
        """Parameters the backward of ``outputs`` cannot reach."""
        roots = []
        for t in _tensors(outputs):
            edge = t.gradient_edge()
            if edge is not None:
                roots.append(edge[0])
        reached = {
            id(node.variable)
            for node in compute_dependencies(roots)
            if isinstance(node, AccumulateGrad)
        }
        return [i for i, p in enumerate(self.params) if id(p) not in reached]

    # -------------------------------------------------------------- gradients

    def on_accumulated(self, index: int, param: Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``index``.

        Raises:
            AutogradError: no synchronised forward waits for this backward.
        """
        if self._state is _LOCAL:
            self._local[index] = True
            return
        if self._state is _IDLE:
            raise AutogradError(
                f"a gradient for DDP parameter {self.names[index]!r} arrived on rank "
                f"{self.rank}, but no DistributedDataParallel forward is waiting for its "
                "backward: run a forward through the DDP wrapper before each backward "
                "(a second backward after one forward, or a backward through .module, "
                "gets here)"
            )
        grad = param.grad
        assert grad is not None
        first = not self._marked_any
        self._grad_ready(index, grad.data, rebind=True)
        if first:
            task = current_graph_task()
            if task is not None:
                task.queue_callback(self.finalize)

    def grad_ready(self, param: Tensor, grad: Any) -> None:
        """Take ``param``'s gradient for this iteration; launch buckets that are complete.

        The entry point for gradients that do not come through ``.grad``
        (distributed autograd passes each leaf's gradient from its own map).

        Args:
            param: One of the model's parameters.
            grad: Its gradient (an array of its shape).

        Raises:
            AutogradError: not armed, or a second gradient in one iteration.
            ConfigError: not one of this model's parameters.
        """
        index = self._position.get(id(param))
        if index is None:
            raise ConfigError(f"grad_ready: {param!r:.60} is not a parameter of this DDP model")
        self._grad_ready(index, grad, rebind=False)

    def holds(self, param: Tensor) -> bool:
        """Whether ``param`` is one of this model's (reduced) parameters."""
        return id(param) in self._position

    def is_ready(self, param: Tensor) -> bool:
        """Whether ``param``'s gradient for this iteration was taken."""
        index = self._position.get(id(param))
        return index is not None and self._ready[index]

    def _grad_ready(self, index: int, grad: Any, rebind: bool) -> None:
        if self._state is not _ARMED:
            raise AutogradError(
                f"grad_ready({self.names[index]!r}): no DistributedDataParallel forward "
                "is waiting for its backward"
            )
        if self._ready[index]:
            raise AutogradError(
                f"DDP parameter {self.names[index]!r} got a second gradient in one iteration "
                f"on rank {self.rank}: each forward through DistributedDataParallel allows "
                "one backward (use no_sync() to accumulate over several)"
            )
        if not self._marked_any:
            self._marked_any = True
            for i in self._unreached:
                self._mark(i, self._local[i])
        b, pos = self._where[index]
        bucket = self.buckets[b]
        view = bucket._views[pos]
        if grad is not view:
            view[...] = grad
            if rebind and self.as_view:
                self.params[index].grad = Tensor(view)
        self._got[index] = True
        self._last_grad_t = time.perf_counter()
        self._set_ready(index, 1)

    def _mark(self, index: int, used: bool) -> None:
        """Mark a parameter without a gradient in this backward as ready."""
        if self._ready[index]:
            return
        b, pos = self._where[index]
        view = self.buckets[b]._views[pos]
        g = self.params[index].grad
        if self._shadow or g is None:
            view[...] = 0
        elif g.data is not view:
            view[...] = g.data
        self._set_ready(index, 1 if used and not self._shadow else 0)

    def _set_ready(self, index: int, used: int) -> None:
        self._ready[index] = True
        self._used[index] = used
        b, _ = self._where[index]
        self.buckets[b].pending -= 1
        if self.buckets[b].pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            bucket = buckets[self._next]
            self._next += 1
            times = self._times[bucket.index()]
            times[0] = time.perf_counter()
            fut = bucket.future = self._launch(bucket)
            fut.add_done_callback(_stamp(times))

    def _launch(self, bucket: GradBucket) -> Future[Any]:
        if self.hook is None:
            if not bucket.is_last():
                work = dist.all_reduce(
                    bucket._flat, dist.ReduceOp.AVG, group=self.group, async_op=True
                )
                return future_of(work)
            # The last bucket is complete only once every gradient is in:
            # nothing is left to overlap with, so reduce it on this thread
            # (no hand-off to the group's thread and back), flags included.
            bucket._flat[bucket.plan.numel :] = xp_of(bucket._flat).asarray(
                self._used, dtype=bucket._flat.dtype
            )
            done: Future[Any] = Future()
            try:
                dist.all_reduce(bucket._flat, dist.ReduceOp.AVG, group=self.group)
            except RpcdistError as e:  # raised from finalize(), like the others
                done.set_exception(e)
            else:
                done.set_result(bucket._flat)
            return done
        fut = self.hook(self.hook_state, bucket)
        if isinstance(fut, dist.Work):
            fut = fut.get_future()
        if not isinstance(fut, Future):
            raise ConfigError(
                f"communication hook {getattr(self.hook, '__name__', self.hook)!r} returned "
                f"{type(fut).__name__}; expected an rpcdist.Future of the reduced flat array"
            )
        # Every rank (joined ones too) counts the same iterations, so every
        # rank skips the flags' all-reduce from the same iteration on.
        if bucket.is_last() and not (self.static_graph and self.iterations > 0):
            status = np.asarray(self._used, dtype=np.int32)
            self._status_work = dist.all_reduce(status, group=self.group, async_op=True)
        return fut

    # ---------------------------------------------------------------- the end

    def finalize(self, grad_map: MutableMapping[Tensor, Any] | None = None) -> None:
        """End the iteration: reduce what is left, wait, check, write the averages.

        Runs as an end-of-backward callback after a backward through the
        engine; call it yourself after feeding :meth:`grad_ready`.

        Args:
            grad_map: Write each averaged gradient here (a copy, keyed by
                parameter) instead of into ``.grad``.

        Raises:
            AutogradError: without ``find_unused_parameters``, some parameter
                got no gradient on some rank (raised on every rank).
            CollectiveError: a reduction failed.
            RpcTimeoutError: a reduction timed out.
        """
        if self._state is not _ARMED:
            return
        t0 = time.perf_counter()
        n = len(self.params)
        try:
            for i in range(n):
                if not self._ready[i]:
                    self._mark(i, self._local[i])
            self._launch_ready()
            values = [b.future.wait() for b in self.buckets]
            counts = self._counts()
        except BaseException:
            self._reset()
            raise
        end_of_backward = self._last_grad_t if self._marked_any else t0
        self.last_wait_s = time.perf_counter() - end_of_backward
        self.last_comm_s, self.last_hidden_s = comm_overlap(self._times, end_of_backward)
        used, shadow, got = list(self._used), self._shadow, list(self._got)
        self._local = [False] * n
        self._reset()  # whatever happens below, the next forward starts afresh
        lenient = self.find_unused or self.static_graph
        if counts is not None and not lenient:
            bad = [i for i in range(n) if counts[i] != self.expected]
            if bad:
                raise_unused(self, bad, counts, used, shadow)
        skip = self._skipped(counts, lenient)
        for bucket, value in zip(self.buckets, values):
            self._write_back(bucket, value, skip, grad_map)
        if self.static_graph and self._static_unused is None and not shadow:
            self._static_unused = [i for i in range(n) if not got[i]]
        self.iterations += 1

    def _counts(self) -> list[int] | None:
        """On how many ranks each parameter got a gradient (None: not known)."""
        if self.hook is None and self.buckets:
            last = self.buckets[-1]
            tail = host(last._flat[last.plan.numel :]).astype(np.float64)
            return [int(c) for c in np.rint(tail * self.world)]
        if self._status_work is not None:
            out = self._status_work.result()
            return [int(c) for c in out]
        return None

    def _skipped(self, counts: list[int] | None, lenient: bool) -> set[int]:
        """Parameters no rank used: their ``.grad`` is left as it was."""
        if not lenient:
            return set()
        if counts is None:
            return set(self._static_unused or ())
        return {i for i, c in enumerate(counts) if c == 0}

    def _write_back(
        self,
        bucket: GradBucket,
        value: Any,
        skip: set[int],
        grad_map: MutableMapping[Tensor, Any] | None,
    ) -> None:
        buf = bucket.buffer()
        if value is not bucket._flat and value is not buf:
            if getattr(value, "size", -1) != buf.size:
                raise ConfigError(
                    f"communication hook returned {getattr(value, 'shape', type(value))} for "
                    f"bucket {bucket.index()} of {buf.size} elements"
                )
            buf[...] = value.reshape(buf.shape)
        if self.scale != 1.0:
            buf *= self.scale
        for pos, i in enumerate(bucket.param_indices):
            if i in skip:
                continue
            p, view = self.params[i], bucket._views[pos]
            if grad_map is not None:
                grad_map[p] = view.copy()
                continue
            g = p.grad
            if self.as_view:
                if g is None or g.data is not view:
                    p.grad = Tensor(view)
            elif g is None:
                p.grad = Tensor(view.copy())
            else:
                g.data[...] = view

    def shadow(self, *, expected: int, scale: float = 1.0) -> None:
        """Take part in one iteration's reductions with zero gradients (a joined rank).

        The averages of the ranks still training land in ``.grad``, so that
        a sharded optimizer can step its shard with them.

        Raises:
            AutogradError, CollectiveError, RpcTimeoutError: as :meth:`finalize`.
        """
        self._reset()
        self._state = _ARMED
        self._shadow = True
        self.expected, self.scale = expected, scale
        self.finalize()

    def statistics(self) -> dict[str, Any]:
        """Buckets, iterations, and timings of the last iteration.

        ``ddp_last_wait_s``: how long the reductions still took after the
        last gradient came in (communication not hidden); ``ddp_last_comm_s``: how long the reductions ran (one
        after the other, from launch to completion); ``ddp_last_hidden_s``:
        the part of that before the last gradient came in (hidden under
        backward).
        """
        return {
            "ddp_buckets": len(self.buckets),
            "ddp_bucket_bytes": sum(b.buffer().nbytes for b in self.buckets),
            "ddp_iterations": self.iterations,
            "ddp_inflight": sum(
                1 for b in self.buckets if b.future is not None and not b.future.done()
            ),
            "ddp_last_wait_s": self.last_wait_s,
            "ddp_last_comm_s": self.last_comm_s,
            "ddp_last_hidden_s": self.last_hidden_s,
        }

    def remove_hooks(self) -> None:
        """Unregister the post-accumulate-grad hooks from the parameters."""
        for h in self._handles:
            h.remove()


def _stamp(times: list[float]) -> Callable[[Future[Any]], None]:
    """A done-callback that records when a reduction completed."""

    def done(_: Future[Any]) -> None:
        times[1] = time.perf_counter()

    return done


def _tensors(obj: Any) -> list[Tensor]:
    """Tensors inside a forward's outputs (nested tuples, lists, dicts)."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return [t for o in obj for t in _tensors(o)]
    return []
