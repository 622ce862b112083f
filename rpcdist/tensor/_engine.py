"""The backward engine: a dependency-counted walk over :class:`Node` graphs.

:class:`GraphTask` is the one implementation; ``Tensor.backward`` and
distributed autograd are both thin users of it:

1. Dependencies are counted over every node reachable from the *start nodes*
   (the roots, plus any extra nodes such as send functions whose gradients
   will arrive later). A node runs once all of its counted inputs arrived.
2. ``execute(roots)`` seeds gradients into nodes and runs everything that
   becomes ready. It may be called again with more roots (FAST mode: one
   call per gradient message) and from several threads; graph state is
   guarded by a lock that is not held while nodes run or callbacks fire.
3. Leaves' gradients go into ``.grad`` (then post-accumulate hooks run) or,
   when a ``grad_map`` is given, are summed into it keyed by leaf tensor and
   ``.grad`` is left alone.
4. Nodes of ``callback_kinds`` (by default :class:`RecvFunction`) are not
   applied: ``callback(node, grads)`` receives their gradients instead.
5. Code running inside a pass (a hook) may :func:`queue_callback` a function
   to run once the pass is over: ``Tensor.backward`` runs them after the
   walk; a caller that feeds a task in several calls runs them itself with
   :meth:`GraphTask.run_final_callbacks` (data parallelism waits for its
   gradient all-reduces there).
6. In a pass that hands gradients to a callback (distributed autograd:
   they are sent to other workers), a :attr:`Node.splittable` node computes
   its leaves' gradients only once nothing else is ready, so what is sent
   leaves first and the parameters' gradients overlap the receivers' work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import AutogradError, RpcdistError
from . import _tensor
from ._node import AccumulateGrad, Node, RecvFunction

if TYPE_CHECKING:
    from ._tensor import Tensor

__all__ = [
    "GraphTask",
    "compute_dependencies",
    "current_graph_task",
    "queue_callback",
    "run_backward",
]

#: ``(node, grads)``: gradients for a node's outputs (a list with one entry,
#: array or None, per output; a bare array for a single-output node).
Root = tuple[Node, Any]
NodeCallback = Callable[[Node, list[Any]], None]


_GRAD_LOCK = threading.Lock()
#: Per thread, the tasks whose nodes this thread is running (innermost last).
_RUNNING = threading.local()


def current_graph_task() -> GraphTask | None:
    """The backward pass whose nodes (and hooks) this thread is running, if any."""
    stack: list[GraphTask] | None = getattr(_RUNNING, "stack", None)
    return stack[-1] if stack else None


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn()`` once the backward pass this thread is running is over.

    Meant for hooks: a post-accumulate-grad hook that launched work can
    queue a callback that waits for it. Callbacks run in the order queued,
    on the thread that finishes the pass, and only if the pass succeeded.

    Raises:
        AutogradError: no backward pass is running in this thread.
    """
    task = current_graph_task()
    if task is None:
        raise AutogradError(
            "queue_callback() must be called while a backward pass runs (from a hook)"
        )
    task.queue_callback(fn)


def compute_dependencies(start_nodes: Iterable[Node]) -> dict[Node, int]:
    """Count, for every node reachable from ``start_nodes``, its incoming edges.

    Start nodes themselves begin at 0 (plus edges from other reachable nodes).
    """
    deps: dict[Node, int] = {}
    stack: list[Node] = []
    for node in start_nodes:
        if node not in deps:
            deps[node] = 0
            stack.append(node)
    while stack:
        node = stack.pop()
        for edge in node.next_edges:
            if edge is None:
                continue
            child = edge[0]
            if child in deps:
                deps[child] += 1
            else:
                deps[child] = 1
                stack.append(child)
    return deps


class _Buffer:
    """Gradients summed so far for one node's outputs."""

    __slots__ = ("grads", "owned")

    def __init__(self, n: int) -> None:
        self.grads: list[Any] = [None] * n
        self.owned: list[bool] = [False] * n

    def add(self, nr: int, g: Any, owned: bool) -> None:
        cur = self.grads[nr]
        if cur is None:
            self.grads[nr] = g
            self.owned[nr] = owned
        elif self.owned[nr] and cur.shape == g.shape:
            cur += g  # in place for arrays; rebinds for NumPy scalars
            self.grads[nr] = cur
        else:
            self.grads[nr] = cur + g
            self.owned[nr] = True


def _is_fresh(g: Any, inputs: list[Any], outs: Sequence[Any], i: int) -> bool:
    """Whether the engine may modify ``g`` in place (nobody else holds it)."""
    if g.base is not None:
        return False
    for x in inputs:
        if g is x:
            return False
    return all(outs[j] is not g for j in range(i))


class GraphTask:
    """One backward pass over a local graph, possibly fed in several calls.

    Args:
        start_nodes: Nodes from which dependencies are counted: the roots and
            any extra nodes (send functions) whose gradients come later.
        grad_map: When given, leaf gradients are summed into it (keyed by
            leaf tensor, values arrays owned by the map) instead of ``.grad``;
            post-accumulate hooks do not run then.
        callback: Called as ``callback(node, grads)`` for nodes that are
            instances of ``callback_kinds``, instead of applying them; the walk
            does not continue past them. ``grads`` may alias arrays used
            elsewhere: copy what you keep.
        callback_kinds: Node classes handed to ``callback``.
        retain_graph: Keep saved arrays so that the graph can be walked again.
            Tasks that walk one graph at the same time need it.
        eager_leaves: Sum each gradient into a leaf's slot of ``grad_map`` as
            it arrives, instead of once every counted input has arrived. A
            leaf then never waits: distributed autograd uses it so that a
            parameter shared by several sent tensors gets its gradient even
            when some of them get none in a pass. Needs ``grad_map``.
        leaf_done: With ``eager_leaves``: called with each leaf tensor once
            every counted gradient for it has been summed into ``grad_map``
            (its gradient is final for this task), e.g. for DDP's reducer.

    Each task has its own dependency counts and gradient buffers, so tasks in
    different threads never mix. After a node fails, the task is abandoned.

    Raises:
        AutogradError: on misuse (unknown root, gradient after a node ran).
    """

    __module__ = "rpcdist.tensor"

    def __init__(
        self,
        start_nodes: Iterable[Node],
        *,
        grad_map: MutableMapping[Tensor, Any] | None = None,
        callback: NodeCallback | None = None,
        callback_kinds: tuple[type[Node], ...] = (RecvFunction,),
        retain_graph: bool = False,
        eager_leaves: bool = False,
        leaf_done: Callable[[Tensor], None] | None = None,
    ) -> None:
        if eager_leaves and grad_map is None:
            raise AutogradError("GraphTask(eager_leaves=True) needs a grad_map")
        self.leaf_done = leaf_done
        self.grad_map = grad_map
        self.callback = callback
        self.callback_kinds = callback_kinds
        self.retain_graph = retain_graph
        self.eager_leaves = eager_leaves
        self._deps = compute_dependencies(start_nodes)
        #: Whether splittable nodes compute their parameters' gradients last:
        #: in a pass that sends gradients on (distributed autograd), so that
        #: they are sent as early as possible and the parameters' gradients
        #: overlap the receivers' work. Not for DDP (``leaf_done``), which
        #: wants them early to start its all-reduces.
        self._defer_leaves = (
            eager_leaves
            and callback is not None
            and leaf_done is None
            and any(isinstance(n, callback_kinds) for n in self._deps)
        )
        self._buffers: dict[Node, _Buffer] = {}
        self._lock = threading.Lock()
        self._final_callbacks: list[Callable[[], None]] = []

    def queue_callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` when :meth:`run_final_callbacks` is called (end of the pass)."""
        with self._lock:
            self._final_callbacks.append(fn)

    def run_final_callbacks(self) -> None:
        """Run, in order, the callbacks queued for the end of this pass.

        ``Tensor.backward`` calls it after the walk; whoever feeds a task in
        several :meth:`execute` calls (distributed autograd) calls it once the
        whole pass is over. Callbacks queued meanwhile run too; the first one
        that raises stops the rest (they are dropped).
        """
        while True:
            with self._lock:
                if not self._final_callbacks:
                    return
                fn = self._final_callbacks.pop(0)
            try:
                fn()
            except BaseException:
                with self._lock:
                    self._final_callbacks.clear()
                raise

    def pending(self) -> list[Node]:
        """Nodes holding some gradient but still waiting for more inputs."""
        with self._lock:
            return list(self._buffers)

    def execute(self, roots: Sequence[Root]) -> None:
        """Seed gradients into root nodes and run every node that gets ready.

        Args:
            roots: ``(node, grads)`` pairs; each node must be one of this
                task's nodes. ``grads`` is a list with one array (or None)
                per output, or a bare array for a single-output node.

        Raises:
            AutogradError: a root is not part of this task, a gradient came for
                a node that already ran, or a node failed.
        """
        ready: list[Node] = []
        with self._lock:
            for node, grads in roots:
                glist = _grad_list(node, grads)
                deps = self._deps.get(node)
                if deps is None:
                    raise AutogradError(
                        f"{node.name()} is not a start node of this backward pass: its "
                        "dependencies were not counted (pass it in start_nodes or "
                        "extra_start_nodes)"
                    )
                for nr, g in enumerate(glist):
                    if g is not None:
                        buf = self._buffers.get(node)
                        if buf is None:
                            buf = self._buffers[node] = _Buffer(node.num_outputs)
                        buf.add(nr, g, False)
                if deps == 0 and node not in ready:
                    ready.append(node)
        stack: list[GraphTask] | None = getattr(_RUNNING, "stack", None)
        if stack is None:
            stack = _RUNNING.stack = []
        stack.append(self)
        try:
            self._run(ready)
        finally:
            stack.pop()

    def _run(self, ready: list[Node]) -> None:
        buffers, lock = self._buffers, self._lock
        callback, kinds = self.callback, self.callback_kinds
        may_split = self._defer_leaves
        #: Splittable nodes whose leaves' gradients wait until nothing else is
        #: ready: ``(node, grads, what computes them, the node's other edges)``.
        later: list[tuple[Node, list[Any], Callable[[], Sequence[Any]], tuple[bool, ...]]] = []
        grads: list[Any]
        outs: Sequence[Any]
        while ready or later:
            if not ready:
                node, grads, rest, others = later.pop()
                outs = _counted(node, _apply(node, rest))
                if not self.retain_graph:
                    node.release()
                self._route(node, grads, outs, ready, others)
                continue
            node = ready.pop()
            with lock:
                buf = buffers.pop(node, None)
            if buf is None:
                grads = [None] * node.num_outputs
                owned = [False] * node.num_outputs
            else:
                grads, owned = buf.grads, buf.owned
            if node._pre_hooks:
                _run_pre_hooks(node, grads, owned)
            if type(node) is AccumulateGrad:
                if grads[0] is not None:
                    self._accumulate(node, grads[0], owned[0])
                continue
            if callback is not None and isinstance(node, kinds):
                if buf is not None:  # the callback may keep them: none may change later
                    grads = [g if o or g is None else g.copy() for g, o in zip(grads, owned)]
                callback(node, grads)
                continue
            deferred = None
            if buf is None:  # no gradient reached it: pass "none" on
                outs = (None,) * len(node.next_edges)
            else:
                if may_split and node.splittable:
                    deferred = _deferred_leaves(node)
                if deferred is None:
                    outs = _counted(node, _apply(node, node.apply, grads))
                else:  # what leaves the worker first, the parameters' gradients later
                    others = tuple(not x for x in deferred)
                    outs, rest = _apply(node, node.apply_split, grads, others)
                    outs = _counted(node, outs)
                    later.append((node, grads, rest, others))
            if deferred is None and not self.retain_graph:
                node.release()
            self._route(node, grads, outs, ready, deferred)

    def _route(
        self,
        node: Node,
        grads: list[Any],
        outs: Sequence[Any],
        ready: list[Node],
        skip: tuple[bool, ...] | None,
    ) -> None:
        """Pass a node's input gradients on along its edges (but those in ``skip``)."""
        deps, buffers, lock = self._deps, self._buffers, self._lock
        eager = self.eager_leaves
        leaves: list[tuple[AccumulateGrad, Any, bool, bool]] = []
        with lock:
            for i, edge in enumerate(node.next_edges):
                if edge is None or (skip is not None and skip[i]):
                    continue
                child, nr = edge
                g = outs[i]
                if eager and type(child) is AccumulateGrad:
                    d = deps[child] - 1
                    deps[child] = d
                    if g is not None or d == 0:
                        fresh = g is not None and _is_fresh(g, grads, outs, i)
                        leaves.append((child, g, fresh, d == 0))
                    continue
                if g is not None:
                    b = buffers.get(child)
                    if b is None:
                        b = buffers[child] = _Buffer(child.num_outputs)
                    b.add(nr, g, _is_fresh(g, grads, outs, i))
                d = deps[child] - 1
                deps[child] = d
                if d == 0:
                    ready.append(child)
                elif d < 0:
                    raise AutogradError(
                        f"a gradient reached {child.name()} after it had already run"
                    )
        for leaf, g, fresh, last in leaves:  # outside the lock: it takes it itself
            if g is not None:
                self._accumulate(leaf, g, fresh)
            if last and self.leaf_done is not None:
                self.leaf_done(leaf.variable)

    def _accumulate(self, node: AccumulateGrad, g: Any, owned: bool) -> None:
        Tensor = _tensor.Tensor
        var = node.variable
        if var._hooks:
            for hook in list(var._hooks):
                out = hook(Tensor._wrap(g))
                if out is not None:
                    g = out.data if isinstance(out, Tensor) else out
                    owned = False
        if isinstance(g, np.generic):
            g = np.asarray(g)
            owned = True
        data = var.data
        if g.shape != data.shape:
            raise AutogradError(
                f"gradient of shape {tuple(g.shape)} reached a leaf of shape {tuple(data.shape)}"
            )
        if g.dtype != data.dtype:
            g = g.astype(data.dtype)
            owned = True
        grad_map = self.grad_map
        if grad_map is not None:
            with self._lock:
                cur = grad_map.get(var)
                if cur is None:
                    grad_map[var] = g if owned else g.copy()
                else:
                    cur += g
            return
        with _GRAD_LOCK:  # backward passes in several threads may share leaves
            current = var._grad
            if current is None:
                var._grad = Tensor._wrap(g if owned else g.copy())
            else:
                current.data += g
        if var._post_hooks:
            for post in list(var._post_hooks):
                post(var)


def _apply(node: Node, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``: ``node.apply(grads)`` or a part of it, with failures named."""
    try:
        return call(*args)
    except RpcdistError:
        raise
    except Exception as exc:
        raise AutogradError(f"{node.name()} failed in backward: {exc}") from exc


def _counted(node: Node, outs: Sequence[Any]) -> Sequence[Any]:
    """``outs``, checked to hold one gradient per input of ``node``."""
    if len(outs) != len(node.next_edges):
        raise AutogradError(
            f"{node.name()} returned {len(outs)} gradients for {len(node.next_edges)} inputs"
        )
    return outs


def _deferred_leaves(node: Node) -> tuple[bool, ...] | None:
    """A node's leaf edges, when it also has others: their gradients (the
    parameters') wait until everything else ready has run, so that gradients
    bound for other workers leave first. A pipeline stage or parameter
    server thus answers upstream before it computes its weights' gradients,
    and a trainer sends to its parameter server before computing its own."""
    edges = node.next_edges
    leaves = tuple(e is not None and type(e[0]) is AccumulateGrad for e in edges)
    if any(leaves) and any(e is not None and not x for e, x in zip(edges, leaves)):
        return leaves
    return None


def _grad_list(node: Node, grads: Any) -> list[Any]:
    if isinstance(grads, list | tuple):
        if len(grads) != node.num_outputs:
            raise AutogradError(
                f"{node.name()} has {node.num_outputs} outputs but {len(grads)} "
                "gradients were given"
            )
        return list(grads)
    if node.num_outputs != 1:
        raise AutogradError(
            f"{node.name()} has {node.num_outputs} outputs: give a list of gradients"
        )
    return [grads]


def _run_pre_hooks(node: Node, grads: list[Any], owned: list[bool]) -> None:
    Tensor = _tensor.Tensor
    for nr, hook in list(node._pre_hooks or ()):
        g = grads[nr]
        if g is None:
            continue
        out = hook(Tensor._wrap(g))
        if out is not None:
            grads[nr] = out.data if isinstance(out, Tensor) else out
            owned[nr] = False


def run_backward(
    roots: Sequence[Root],
    *,
    extra_start_nodes: Iterable[Node] = (),
    grad_map: MutableMapping[Tensor, Any] | None = None,
    callback: NodeCallback | None = None,
    callback_kinds: tuple[type[Node], ...] = (RecvFunction,),
    retain_graph: bool = False,
) -> GraphTask:
    """Run backward from ``(node, grads)`` pairs: the engine's low-level entry.

    Dependencies are counted from the roots' nodes *and* ``extra_start_nodes``
    (FAST mode: every send function of a distributed autograd context), so
    nodes that also depend on an extra start node wait until gradients for it
    are fed with ``task.execute([(send_fn, grads)])``.

    Args:
        roots: ``(node, grads)`` pairs to start from (see
            :meth:`GraphTask.execute`).
        extra_start_nodes: More nodes to count dependencies from.
        grad_map: Sum leaf gradients here (keyed by leaf tensor) instead of
            into ``.grad``.
        callback: ``callback(node, grads)`` for nodes of ``callback_kinds``.
        callback_kinds: Node classes given to the callback (RecvFunction).
        retain_graph: Keep the graph for another backward pass.

    Returns:
        The :class:`GraphTask`, to feed more gradients into.

    Raises:
        AutogradError: misuse of the graph or a failing node.
    """
    start = [node for node, _ in roots]
    start.extend(extra_start_nodes)
    task = GraphTask(
        start,
        grad_map=grad_map,
        callback=callback,
        callback_kinds=callback_kinds,
        retain_graph=retain_graph,
    )
    task.execute(roots)
    return task
