"""The distributed backward pass: FAST mode, made exact so that it cannot hang.

``backward(context_id, roots)`` runs the local engine from the roots. When it
reaches a :class:`DistRecv` (tensors that arrived in a message), the
gradients go back to the sender (``autograd.grads``), whose :class:`DistSend`
for that message feeds them into *its* engine, which may send more on. Each
gradient message is an RPC answered once the receiver has run everything the
gradients made runnable and its own gradient messages were answered, so the
root's pass ends when its messages are answered; an error anywhere fails it,
with the remote traceback and the failing worker's name.

A worker counts dependencies, once per pass, from its start nodes: the
roots (on the root worker) and the send functions of the context (PyTorch's
FAST mode). PyTorch hangs when a send gets no gradient in the pass (its
output never reached the loss) while a node below it also serves a send or
root that does: that node waits forever. rpcdist finds such sends before it
runs: a send whose subgraph shares a node with another start node is
*overlapping* (leaves do not count: they are summed as gradients arrive,
``eager_leaves``); for each overlapping send the worker asks the receiver
whether the matching receive function is reached in this pass
(``autograd.reach``), which the receiver answers from its own graph (is it
reached from a root here, or from one of its sends that is reached: asked on
in turn; the cross-worker graph follows causality, so this ends), and leaves
the unreached ones out of the count. Passes without overlapping sends (the
usual case: parameter servers, pipelines) cost no extra message.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._deadline import UNSET, current_deadline, deadline_for
from .._errors import AutogradError, ConfigError
from .._futures import Future
from .._rpc._context import current_agent
from .._rpc._started import Started, abandon
from .._worker import WorkerInfo
from ..tensor import GraphTask, Node, Tensor
from ._context import ContextTable, DistContext, DistRecv, DistSend, Key, PassState

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = ["GRADS", "apply_grads", "backward_blocking", "on_reach"]

#: Gradient messages are plain calls of :func:`apply_grads` (the dispatcher's
#: fast path: no loop task on the receiver, and a blocking caller's link).
GRADS = "rpcdist.autograd._backward:apply_grads"
REACH = "autograd.reach"

_collect = threading.local()


def _ext(agent: Agent) -> ContextTable:
    found: Any = agent.registry.extensions.get("autograd")
    if found is None:
        raise AutogradError(f"the rpcdist agent {agent.name!r} has no distributed autograd")
    ext: ContextTable = found
    return ext


def _deadline(agent: Agent) -> float | None:
    """The deadline of a pass's messages: the handler's, else the agent's default."""
    inherited = current_deadline.get()
    if inherited is not None:
        return inherited
    return deadline_for(UNSET, agent.rpc_timeout)


def _task(agent: Agent, ctx: DistContext, st: PassState, unreached: set[DistSend]) -> GraphTask:
    """The pass's graph task here, counting from the start nodes minus ``unreached``."""
    if ctx.freed_by is not None:
        raise AutogradError(
            f"backward in context {ctx.id} on worker {agent.name!r}: the graph was freed by "
            f"an earlier backward ({ctx.freed_by}); pass retain_graph=True to every backward "
            "that walks a graph again"
        )
    starts = [*st.roots, *(s for s in ctx.sends.values() if s not in unreached)]
    leaf_done = functools.partial(_leaf_done, ctx) if ctx.reducers else None
    task = GraphTask(
        starts,
        grad_map=ctx.grads,
        callback=_make_callback(agent, ctx, st),
        retain_graph=st.retain,
        eager_leaves=True,
        leaf_done=leaf_done,
    )
    if not st.retain:
        ctx.freed_by = f"pass {st.key[1]} started by rank {st.key[0]}"
    return task


def _make_callback(agent: Agent, ctx: DistContext, st: PassState) -> Any:
    # Closes over values, not ``st``: ``st.task`` holds this function, and a
    # cycle would keep the graph (and its saved arrays) alive after the pass
    # until the garbage collector next ran.
    key, retain = list(st.key), st.retain

    def send_back(node: Node, grads: list[Any]) -> None:
        assert isinstance(node, DistRecv)
        run: _GradientMessages | None = getattr(_collect, "run", None)
        if run is None:
            raise AutogradError("internal: gradients for a receive function outside a pass")
        payload: Any = ((ctx.id, key, node.message_id, grads, retain), {})
        run.send(agent, node.peer, payload)

    return send_back


class _GradientMessages:
    """The gradient messages one ``execute`` sends. Each leaves as soon as it
    is made (the receiver works meanwhile, while this worker goes on with its
    own part), and the run's end reads every reply on this thread: on a
    thread-driven link when the call qualifies (``Agent.start_blocking``), so
    no loop thread wakes for it here or at the receiver."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[Started | Future[Any]] = []

    def send(self, agent: Agent, peer: int, payload: Any) -> None:
        self.calls.append(
            agent.start_blocking(
                peer, GRADS, payload, deadline=_deadline(agent), meta=None, label="autograd.grads"
            )
        )

    def finish(self) -> None:
        """Wait for every reply (blocking); on the first error, give up the rest."""
        calls, self.calls = self.calls, []
        try:
            for call in calls:
                call.wait()
        except BaseException:
            abandon(calls)
            raise

    def abandon(self) -> None:
        calls, self.calls = self.calls, []
        abandon(calls)


def _execute(task: GraphTask, seeds: list[tuple[Node, Any]]) -> _GradientMessages:
    """``task.execute(seeds)``, collecting the gradient messages it sends."""
    run = _collect.run = _GradientMessages()
    try:
        task.execute(seeds)
    except BaseException:
        run.abandon()
        raise
    finally:
        _collect.run = None
    return run


# ------------------------------------------------------------------- the root


def backward_blocking(
    agent: Agent, context_id: int, roots: Sequence[Tensor], retain_graph: bool
) -> None:
    """Run a backward pass from ``roots`` (this worker is the root; blocking).

    Raises:
        ConfigError: a root is not a scalar tensor that requires grad.
        AutogradError: no such context, a freed graph, or a failure anywhere.
        RpcTimeoutError, WorkerLostError: a worker did not answer in time, or died.
    """
    ext = _ext(agent)
    ctx = ext.get(context_id, "backward()")
    if not isinstance(roots, list | tuple) or not roots:
        raise ConfigError(f"backward(): roots must be a non-empty list of tensors, got {roots!r}")
    seeds: list[tuple[Node, Any]] = []
    for i, t in enumerate(roots):
        if not isinstance(t, Tensor):
            raise ConfigError(f"backward(): roots[{i}] is a {type(t).__name__}, not a Tensor")
        edge = t.gradient_edge()
        if edge is None:
            raise ConfigError(f"backward(): roots[{i}] does not require grad")
        if t.numel() != 1:
            raise ConfigError(f"backward(): roots[{i}] has shape {t.shape}; roots must be scalars")
        grads: list[Any] = [None] * edge[0].num_outputs
        grads[edge[1]] = t.data.dtype.type(1) * _ones(t)
        seeds.append((edge[0], grads))
    key = (agent.rank, ctx.next_pass())
    st = PassState(key, [node for node, _ in seeds], retain_graph)
    with ctx.lock:
        ctx.passes = {k: v for k, v in ctx.passes.items() if k[0] != agent.rank}
        ctx.passes[key] = st
    _, overlapping = st.analyse(ctx)
    unreached = {s for s in overlapping if isinstance(s, DistSend) and not _ask(agent, ctx, st, s)}
    task = st.task = _task(agent, ctx, st, unreached)
    try:
        _execute(task, _merge(seeds)).finish()
    finally:
        reducers, ctx.reducers = ctx.reducers, []
    for reducer in reducers:  # DDP inside the pass: average, into the context
        _finish_ddp(ctx, reducer)


def _leaf_done(ctx: DistContext, leaf: Tensor) -> None:
    """A leaf's gradient is final: DDP reducers that hold it may reduce its bucket."""
    for reducer in ctx.reducers:
        if reducer.holds(leaf) and not reducer.is_ready(leaf):
            reducer.grad_ready(leaf, ctx.grads[leaf])


def _finish_ddp(ctx: DistContext, reducer: Any) -> None:
    """End a DDP iteration inside a pass: hand over the gradients that only
    became final at its end, then let the reducer average into the context."""
    for p in reducer.params:
        g = ctx.grads.get(p)
        if g is not None and not reducer.is_ready(p):
            reducer.grad_ready(p, g)
    reducer.finalize(ctx.grads)


def _ones(t: Tensor) -> Any:
    data = t.data
    return np.ones_like(data) if isinstance(data, np.ndarray) else data * 0 + 1


def _merge(seeds: list[tuple[Node, Any]]) -> list[tuple[Node, Any]]:
    """One seed per node (two roots may be outputs of one node)."""
    merged: dict[Node, list[Any]] = {}
    for node, grads in seeds:
        cur = merged.setdefault(node, [None] * node.num_outputs)
        for i, g in enumerate(grads):
            if g is not None:
                cur[i] = g if cur[i] is None else cur[i] + g
    return list(merged.items())


def _ask(agent: Agent, ctx: DistContext, st: PassState, send: DistSend) -> bool:
    """Blocking: whether ``send``'s receive function is reached in the pass."""
    payload = [ctx.id, list(st.key), send.message_id]
    got = agent.call(send.peer, REACH, payload, deadline=_deadline(agent), meta=None, internal=True)
    return bool(got.wait())


# ------------------------------------------------------------------ handlers


def apply_grads(
    context_id: int, key_list: list[int], message_id: int, grads: list[Any], retain: bool
) -> None:
    """Gradients for this worker's send function of message ``message_id``:
    run what they make runnable, and wait for the gradient messages that
    sends on (a plain function, so it runs on the thread that serves the
    call: a pool thread, or the one reading a blocking caller's link)."""
    agent = current_agent()
    key: Key = (int(key_list[0]), int(key_list[1]))
    ctx = _ext(agent).get(context_id, "gradients")
    st = _ready(agent, ctx, key, bool(retain))
    send = ctx.sends.get(message_id)
    if send is None:
        raise AutogradError(
            f"worker {agent.name!r} has no send function for message {message_id} of context "
            f"{context_id}"
        )
    assert st.task is not None
    try:
        run = _execute(st.task, [(send, grads)])
    except AutogradError as e:
        raise AutogradError(f"backward on worker {agent.name!r} failed: {e}") from e
    run.finish()


def _ready(agent: Agent, ctx: DistContext, key: Key, retain: bool) -> PassState:
    """The pass state with its task, set up by the first gradient message here
    (the others wait for it)."""
    with ctx.lock:
        st = ctx.passes.get(key)
        if st is None:
            st = ctx.passes[key] = PassState(key, (), retain)
        if st.task is not None:  # set up already (on the root: before it sent anything)
            return st
        first = st.ready is None
        if first:
            st.ready = threading.Event()
    assert st.ready is not None
    if not first:
        st.ready.wait()
        if st.failed is not None:
            raise st.failed
        return st
    try:
        _, overlapping = st.analyse(ctx)
        sends = [s for s in overlapping if isinstance(s, DistSend)]
        answers = [_ask_sent(agent, ctx, st, s) for s in sends]
        unreached = {s for s, got in zip(sends, answers) if not got.wait()}
        st.task = _task(agent, ctx, st, unreached)
    except BaseException as e:
        st.failed = e
        raise
    finally:
        st.ready.set()
    return st


def _ask_sent(agent: Agent, ctx: DistContext, st: PassState, send: DistSend) -> Future[Any]:
    payload = [ctx.id, list(st.key), send.message_id]
    return agent.call(
        send.peer, REACH, payload, deadline=_deadline(agent), meta=None, internal=True
    )


async def _ask_async(agent: Agent, ctx: DistContext, st: PassState, send: DistSend) -> bool:
    payload = [ctx.id, list(st.key), send.message_id]
    got = agent.call(send.peer, REACH, payload, deadline=_deadline(agent), meta=None, internal=True)
    return bool(await got)


async def on_reach(agent: Agent, src: WorkerInfo, payload: list[Any]) -> bool:
    """``autograd.reach``: ``[context id, pass key, message id]`` -> whether this
    worker's receive function for that message is reached in the pass."""
    context_id, key_list, message_id = payload
    key: Key = (int(key_list[0]), int(key_list[1]))
    ctx = _ext(agent).get(context_id, f"a reachability question from {src.name!r}")
    with ctx.lock:
        st = ctx.passes.get(key)
        if st is None:
            st = ctx.passes[key] = PassState(key)
        answer = st.answers.get(message_id)
        if answer is None:
            answer = st.answers[message_id] = agent.loop.create_future()
            asking = True
        else:
            asking = False
    if asking:
        try:
            answer.set_result(await _reached(agent, ctx, st, message_id))
        except BaseException as e:
            answer.set_exception(e)
            answer.exception()
            raise
    return await asyncio.shield(answer)


async def _reached(agent: Agent, ctx: DistContext, st: PassState, message_id: int) -> bool:
    recv = ctx.recvs.get(message_id)
    if recv is None:
        return False
    reached_from, _ = await agent.loop.run_in_executor(agent.executor, st.analyse, ctx)
    starts = reached_from.get(recv, set())
    if any(s in st.roots for s in starts):
        return True
    sends = [s for s in starts if isinstance(s, DistSend)]
    answers = await asyncio.gather(*(_ask_async(agent, ctx, st, s) for s in sends))
    return any(answers)
