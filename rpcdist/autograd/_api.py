"""``rpcdist.autograd``'s functions: contexts, backward, gradients, statistics."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

from .._rpc._context import current_agent
from ..tensor import Tensor
from ._backward import backward_blocking
from ._context import CURRENT
from ._extension import ext

__all__ = ["backward", "context", "get_gradients", "statistics"]


class context:
    """A distributed autograd context: ``with context() as context_id: ...``.

    Calls made inside the block (``rpc_sync``, ``rpc_async``, ``remote``,
    RRef proxies, ``to_here``; also from coroutines and tasks started
    inside it) carry the context, so tensors that cross workers record
    send and receive edges for :func:`backward`. Leaving the block releases
    the context here and on every worker it touched.

    Raises:
        NotInitializedError: no agent runs in this process.
    """

    __module__ = "rpcdist.autograd"

    def __init__(self) -> None:
        self._agent = current_agent()
        self._id: int | None = None
        self._token: Any = None

    def __enter__(self) -> int:
        ctx = ext(self._agent).new_context()
        self._id = ctx.id
        self._token = CURRENT.set(ctx.id)
        return ctx.id

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        CURRENT.reset(self._token)
        if self._id is not None:
            ext(self._agent).release(self._id)


def backward(context_id: int, roots: Sequence[Tensor], retain_graph: bool = False) -> None:
    """Run one backward pass from ``roots`` across every worker of the context.

    Gradients of leaves accumulate in the context on the worker that holds
    them (read them with :func:`get_gradients`), never in ``.grad``. Returns
    when every worker the pass reached has finished its part.

    Args:
        context_id: The context the forward pass ran in.
        roots: Scalar tensors (the losses), on this worker.
        retain_graph: Keep the graph for another backward pass in this context
            (gradients then add up).

    Raises:
        ConfigError: a root is not a scalar tensor that requires grad.
        AutogradError: unknown context, a graph freed by an earlier backward,
            or a failure on any worker (its name and remote traceback attached).
        RpcTimeoutError: a worker did not answer within the agent's timeout.
        WorkerLostError: a worker died before or during the pass.
        WrongThreadError: called on the agent's event-loop thread.
    """
    agent = current_agent()
    agent.check_not_loop_thread("rpcdist.autograd.backward()")
    backward_blocking(agent, context_id, list(roots), retain_graph)


def get_gradients(context_id: int) -> dict[Tensor, Any]:
    """This worker's leaf gradients in context ``context_id``: ``{tensor: array}``.

    Keyed by the very tensor objects this worker holds (its parameters).

    Raises:
        AutogradError: no such context on this worker.
    """
    ctx = ext(current_agent()).get(context_id, "get_gradients()")
    with ctx.lock:
        return dict(ctx.grads)


def statistics() -> dict[str, int]:
    """``{"contexts": live contexts on this worker, ...}``."""
    e = ext(current_agent())
    stats = dict(e.statistics())
    return {"contexts": stats["autograd_contexts"], **stats}
