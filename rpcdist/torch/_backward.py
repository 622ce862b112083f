"""The distributed backward pass over torch's own autograd engine.

On the root worker, :func:`backward` runs torch's engine as
``torch.autograd.backward`` does, from the roots with ``inputs=`` every leaf
the roots reach (found by walking ``grad_fn.next_functions``), the receive
functions' anchors among them, so that torch runs exactly the part of the
graph that leads to leaves or to other workers. Each
:class:`~._edges.RecvFunction` it reaches sends its gradient to the worker the
tensor came from and waits for the answer: that worker (:func:`apply_grad`)
runs the engine as ``torch.autograd.grad`` does, from the tensor it sent,
which may send on in turn; the answer comes once everything below it is done,
so the root's pass ends when every worker's part has ended.

Gradients of leaves go into the context (``get_gradients``), not ``.grad``:
the root runs the engine with ``.grad`` of the leaves cleared, collects what
torch accumulated there and puts the old values back. Accumulating (rather
than ``torch.autograd.grad``) is what makes torch DDP's reducer hooks fire
inside the pass, so the gradients collected are the all-reduced averages. The
other workers use ``torch.autograd.grad``, which leaves ``.grad`` alone, so
several trainers may push gradients into one server's parameters at once.
A worker keeps its part of the graph (``retain_graph``) until the context is
released: a tensor sent twice gets a gradient message per copy.

Under torch's profiler the pass is recorded as PyTorch records it: a range
``torch::distributed::autograd::backward`` around the root's pass, and
ranges named for torch's receive and send functions
(``...::RecvRpcBackward``: a gradient sent home; ``...::SendRpcBackward``:
the pass below a tensor whose gradient came back). Torch's profiler records
only the thread that started it, and gradients come back on pool threads:
while a profiled root pass waits for a gradient it sent, the work that
gradients coming back start here runs on its thread (:mod:`._host`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._deadline import UNSET, current_deadline, deadline_for
from .._errors import AutogradError, ConfigError, RpcTimeoutError, WorkerLostError
from .._rpc._context import current_agent
from ..autograd._context import CURRENT
from ..autograd._extension import ext
from ._edges import ANCHOR_ATTR, TorchRecv, TorchSend, TorchState, state
from ._host import Host

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = [
    "APPLY",
    "BACKWARD_RANGE",
    "RECV_RANGE",
    "SEND_RANGE",
    "apply_grad",
    "backward",
    "backward_from_loss",
    "deliverer",
    "leaves_of",
]

#: Gradient messages are plain calls of :func:`apply_grad`.
APPLY = "rpcdist.torch._backward:apply_grad"

#: Root passes run one at a time in a process: they borrow the leaves' ``.grad``.
_ROOT_LOCK = threading.Lock()

#: PyTorch's profiler names: its distributed backward pass, its receive and
#: send functions' backward.
BACKWARD_RANGE = "torch::distributed::autograd::backward"
RECV_RANGE = "torch::distributed::autograd::RecvRpcBackward"
SEND_RANGE = "torch::distributed::autograd::SendRpcBackward"

#: ``host``: the :class:`Host` of the profiled root pass running on this thread.
_here = threading.local()

#: The entry to torch's engine below ``torch.autograd.backward`` and ``grad``
#: (torch 2.3 and later; ``None``: those are used). It skips their argument
#: handling, a visible part of a small pass, and ``grad``'s check of given
#: output gradients, which imports sympy the first time. (:func:`_partial` checks a received gradient's shape first,
#: so that a misfit is an ``AutogradError`` naming both shapes.)
_RUN_ENGINE: Callable[..., tuple[torch.Tensor, ...]] | None = getattr(
    getattr(torch.autograd, "graph", None), "_engine_run_backward", None
)


def leaves_of(roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf (parameters, inputs, anchors) the roots' graphs reach."""
    leaves: list[torch.Tensor] = []
    seen: set[Any] = set()
    stack: list[Any] = []
    for r in roots:
        fn = r.grad_fn
        if fn is None:
            if r.requires_grad:
                leaves.append(r)
        elif fn not in seen:
            seen.add(fn)
            stack.append(fn)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None or child in seen:
                continue
            seen.add(child)
            var = getattr(child, "variable", None)
            if var is not None:  # AccumulateGrad: a leaf
                leaves.append(var)
            else:
                stack.append(child)
    return leaves


def _is_anchor(t: torch.Tensor) -> bool:
    return getattr(t, ANCHOR_ATTR, False) is True


def _deadline(agent: Agent) -> float | None:
    inherited = current_deadline.get()
    if inherited is not None:
        return inherited
    return deadline_for(UNSET, agent.rpc_timeout)


def _profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A range ``name`` in torch's profile, where this thread records one."""
    if torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        # (typed here: without torch installed, mypy sees ``Any``)
        ranged: contextlib.AbstractContextManager[Any] = torch.autograd.profiler.record_function(
            name
        )
        return ranged
    return contextlib.nullcontext()


def deliverer(agent: Agent, context_id: int, recv: TorchRecv) -> Callable[[int, Any], None]:
    """What a receive function calls with its gradient: send it home and wait."""

    def deliver(index: int, grad: torch.Tensor) -> None:
        grad = grad if grad.is_sparse else grad.contiguous()
        payload: Any = ((context_id, recv.message_id, index, grad), {})
        label = "rpcdist.torch autograd gradients"
        with _profiled(RECV_RANGE):
            host: Host | None = getattr(_here, "host", None)
            if host is not None:  # (a profiled root pass: run what comes back meanwhile)
                fut = agent.call(
                    recv.peer, APPLY, payload, deadline=_deadline(agent), meta=None, label=label
                )
                with _node_errors(recv.peer):
                    host.wait(fut)
                return
            call = agent.start_blocking(
                recv.peer, APPLY, payload, deadline=_deadline(agent), meta=None, label=label
            )
            with _node_errors(recv.peer):
                call.wait()

    return deliver


class _ArgumentTypeError(ConfigError, TypeError):
    """An argument of the wrong type (a ``TypeError`` too, as torch's binding raises)."""


def _check_roots(context_id: Any, roots: Any) -> list[torch.Tensor]:
    # The texts begin as torch's do (programs match them), rpcdist's detail after.
    if not isinstance(context_id, int) or not isinstance(roots, list | tuple):
        raise _ArgumentTypeError(
            "backward(): incompatible function arguments: expected (context_id: int, "
            f"roots: list of tensors), got ({type(context_id).__name__}, {type(roots).__name__})"
        )
    if not roots:
        raise ConfigError(
            "No tensors provided for gradient computation (backward(): roots must be a "
            "non-empty list of tensors)"
        )
    for i, t in enumerate(roots):
        if not isinstance(t, torch.Tensor):
            raise _ArgumentTypeError(
                f"backward(): incompatible function arguments: roots[{i}] is a "
                f"{type(t).__name__}, not a torch.Tensor"
            )
        if not t.requires_grad:
            raise ConfigError(f"requires_grad not set on roots[{i}]: it does not require grad")
        if t.numel() != 1:
            raise ConfigError(
                f"roots[{i}] is not a scalar, all roots need to be scalar (shape "
                f"{tuple(t.shape)}; roots must be scalars)"
            )
        if t.grad_fn is None:
            raise ConfigError(
                f"roots[{i}] does not have a valid gradient function (a leaf tensor: "
                "nothing to differentiate)"
            )
    return list(roots)


def _on_node(rank: int, exc: BaseException) -> AutogradError:
    """``exc``, raised by worker ``rank``'s part of a pass, as torch words it:
    "Error on Node N: <message>" (the deepest worker's, where it already is).

    The error is an :class:`AutogradError` (a ``RuntimeError``, as torch's)
    and, where the type allows, also of ``exc``'s own type, so that code
    catching that type still does."""
    text = str(exc)
    message = text if text.startswith("Error on Node ") else f"Error on Node {rank}: {text}"
    kind = type(exc)
    if not isinstance(exc, AutogradError) and kind is not Exception:
        try:
            return _autograd_error_like(kind)(message)  # type: ignore[arg-type]  # classes hash
        except TypeError:  # a layout or a constructor that does not mix
            pass
    return AutogradError(message)


@contextlib.contextmanager
def _node_errors(rank: int) -> Iterator[None]:
    """Errors of worker ``rank``'s part of a pass as :func:`_on_node` words
    them (timeouts and lost workers as they are)."""
    try:
        yield
    except (RpcTimeoutError, WorkerLostError):
        raise
    except Exception as e:
        if isinstance(e, AutogradError) and str(e).startswith("Error on Node "):
            raise
        raise _on_node(rank, e) from e


@functools.cache
def _autograd_error_like(kind: type[BaseException]) -> type[AutogradError]:
    return type(kind.__name__, (AutogradError, kind), {"__module__": kind.__module__})


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run one backward pass from ``roots`` across every worker of the context.

    Leaf gradients accumulate in the context on the worker holding each leaf
    (read them with ``get_gradients``), never in ``.grad``. Returns when every
    worker the pass reached has finished its part.

    Args:
        context_id: The context the forward pass ran in.
        roots: Scalar torch tensors (the losses), on this worker.
        retain_graph: Keep this worker's graph for another backward pass.

    Raises:
        ConfigError: a root is not a scalar tensor that requires grad and has a
            gradient function (also a ``TypeError`` where an argument has the
            wrong type).
        AutogradError: unknown context, or the pass failed on a worker:
            "Error on Node N: <the error>", as torch words it.
        RpcTimeoutError: a worker did not answer within the agent's timeout.
        WorkerLostError: a worker died before or during the pass.
        WrongThreadError: called on the agent's event-loop thread.
    """
    agent = current_agent()
    agent.check_not_loop_thread("rpcdist.torch.autograd.backward()")
    roots = _check_roots(context_id, roots)
    ctx = ext(agent).get(context_id, "backward()")
    st = state(ctx)
    with _profiled(BACKWARD_RANGE):
        leaves = leaves_of(roots)
        if not leaves:
            return
        token = CURRENT.set(context_id)
        try:
            with _ROOT_LOCK, _hosting(st):
                _root_pass(agent, st, roots, leaves, retain_graph)
        finally:
            CURRENT.reset(token)


def _root_pass(
    agent: Agent,
    st: TorchState,
    roots: list[torch.Tensor],
    leaves: list[torch.Tensor],
    retain_graph: bool,
) -> None:
    """The root's pass, the leaves' gradients into the context (``_ROOT_LOCK`` held)."""
    saved = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    try:
        with _node_errors(agent.rank):
            _run_root(roots, leaves, retain_graph)
        for leaf in leaves:
            g = leaf.grad
            if g is not None and not _is_anchor(leaf):
                st.add_grad(leaf, g)
    finally:
        for leaf, old in zip(leaves, saved):
            leaf.grad = old


@contextlib.contextmanager
def _hosting(st: TorchState) -> Iterator[None]:
    """Under torch's profiler: gradients that come back to ``st``'s context
    while this thread waits for one it sent run here (:mod:`._host`)."""
    if not torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        yield
        return
    host = Host()
    outer = getattr(_here, "host", None)
    st.host = _here.host = host
    try:
        yield
    finally:
        st.host = None
        _here.host = outer


def _run_root(roots: list[torch.Tensor], leaves: list[torch.Tensor], retain_graph: bool) -> None:
    """``torch.autograd.backward(roots, inputs=leaves)``: accumulate into ``.grad``."""
    if _RUN_ENGINE is None:
        torch.autograd.backward(roots, inputs=leaves, retain_graph=retain_graph)
        return
    ones = tuple(torch.ones_like(r, memory_format=torch.preserve_format) for r in roots)
    _RUN_ENGINE(tuple(roots), ones, retain_graph, False, tuple(leaves), True, accumulate_grad=True)


def _grads_below(
    out: torch.Tensor, grad: torch.Tensor, leaves: list[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``leaves`` given ``grad`` at ``out`` (``None``: not reached)."""
    if _RUN_ENGINE is not None:
        return _RUN_ENGINE((out,), (grad,), True, False, tuple(leaves), True, accumulate_grad=False)
    # sum(out * grad) has exactly ``grad`` as its gradient at ``out``; seeding it
    # instead of passing ``grad_outputs`` spares the sympy import (see above).
    with torch.enable_grad():
        seed = (out * grad).sum()
    got: tuple[torch.Tensor | None, ...] = torch.autograd.grad(
        [seed], leaves, retain_graph=True, allow_unused=True
    )
    return got


def _partial(st: TorchState, out: torch.Tensor, grad: torch.Tensor) -> None:
    """Run this worker's part of a pass from ``out``, a tensor it sent."""
    if grad.shape != out.shape:
        raise AutogradError(
            f"a gradient of shape {tuple(grad.shape)} arrived for a tensor of shape "
            f"{tuple(out.shape)}"
        )
    leaves = leaves_of([out])
    if not leaves:
        return
    got = _grads_below(out, grad, leaves)
    for leaf, g in zip(leaves, got):
        if g is not None and not _is_anchor(leaf):
            st.add_grad(leaf, g)


def apply_grad(context_id: int, message_id: int, index: int, grad: torch.Tensor) -> None:
    """The gradient of tensor ``index`` that message ``message_id`` took from
    here: run everything below it here (and, through receive functions, on
    the workers it came from) before answering."""
    agent = current_agent()
    ctx = ext(agent).get(context_id, "gradients")
    st = state(ctx)
    with st.lock:
        send = st.sends.get(message_id)
    if send is None or not 0 <= index < len(send.tensors):
        raise AutogradError(
            f"worker {agent.name!r} has no sent tensor {index} of message {message_id} in "
            f"context {context_id}"
        )
    host = st.host
    if host is not None:  # (a profiled root pass here: on its thread, if it waits)
        run = contextvars.copy_context().run
        done = host.offer(functools.partial(run, _apply, agent, st, send, index, grad))
        if done is not None:
            done.wait()
            return
    _apply(agent, st, send, index, grad)


def _apply(agent: Agent, st: TorchState, send: TorchSend, index: int, grad: torch.Tensor) -> None:
    token = CURRENT.set(st.context_id)
    try:
        with _profiled(SEND_RANGE):
            _partial(st, send.tensors[index], grad)
    except AutogradError as e:
        raise AutogradError(f"backward on worker {agent.name!r} failed: {e}") from e
    finally:
        CURRENT.reset(token)


def backward_from_loss(context_id: int, loss: torch.Tensor, retain_graph: bool) -> None:
    """``RRef.backward``'s pass for a torch loss (see ``_extension``)."""
    backward(context_id, [loss], retain_graph)
