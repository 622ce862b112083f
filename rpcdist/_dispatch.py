"""Running incoming calls: function lookup, argument gating, execution, reply.

``async def`` functions run on the agent loop; functions marked
``@async_execution`` run in the thread pool and their returned Future is
awaited without holding a thread; other functions run in the thread pool,
which bounds how many run at once (``num_worker_threads``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._context import WireContext, bind_agent
from ._deadline import current_deadline
from ._errors import (
    ProtocolError,
    RpcTimeoutError,
    SerializationError,
)
from ._futures import Future
from ._serialization import decode, encode, exception_to_wire, resolve_function
from ._transport._frames import ERROR_REPLY, INTERNAL, REPLY, InMessage, OutMessage
from .functions import ASYNC_EXECUTION_ATTR

if TYPE_CHECKING:
    from ._agent import Agent
    from ._transport._grpc import Connection

__all__ = ["is_async_execution", "serve"]

_log = logging.getLogger(__name__)


def is_async_execution(fn: Any) -> bool:
    return bool(getattr(fn, ASYNC_EXECUTION_ATTR, False))


@functools.lru_cache(maxsize=4096)
def _resolve(name: str) -> Callable[..., Any]:
    return resolve_function(name)


@functools.lru_cache(maxsize=4096)
def _kind(fn: Callable[..., Any]) -> int:
    if is_async_execution(fn):
        return 2
    if inspect.iscoroutinefunction(fn):
        return 1
    return 0


def _call(fn: Callable[..., Any], name: str, args: Any, kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as bad:
            raise TypeError(f"{name}() called with the wrong arguments: {bad}") from None
        except ValueError:  # no signature available (some builtins)
            pass
        raise e


def _call_and_encode(
    agent: Agent, fn: Callable[..., Any], name: str, args: Any, kwargs: Any, ctx: WireContext
) -> tuple[bytes, list[memoryview]]:
    result = _call(fn, name, args, kwargs)
    return encode(result, allow_pickle=agent.options.allow_pickle, context=ctx, where="result")


async def _await_result(ret: Any) -> Any:
    if isinstance(ret, Future) or inspect.isawaitable(ret):
        return await ret
    raise TypeError(
        f"an @async_execution function must return an rpcdist.Future or awaitable, "
        f"got {type(ret).__name__}"
    )


def _check_deadline(deadline: float | None, method: str, peer: str) -> None:
    # Checked after decoding, so that RRefs in a late request are still
    # registered (and then released) rather than leaked.
    if deadline is not None and deadline <= time.monotonic():
        raise RpcTimeoutError(f"call {method!r} from {peer!r} arrived after its deadline")


async def serve(agent: Agent, conn: Connection, m: InMessage) -> None:
    """Handle one CALL or INTERNAL message and send its reply on ``conn``."""
    peer = agent.workers[conn.peer_rank]
    deadline = m.deadline
    bind_agent(agent)  # this task runs in its own copy of the context
    current_deadline.set(deadline)
    ctx = WireContext(agent, peer)
    kind = REPLY
    try:
        if m.kind == INTERNAL:
            from ._agent import INTERNAL_HANDLERS

            handler = INTERNAL_HANDLERS.get(m.method)
            if handler is None:
                raise ProtocolError(f"unknown internal method {m.method!r}")
            payload = decode(
                m.header, m.buffers, allow_pickle=agent.options.allow_pickle, context=ctx
            )
            _check_deadline(deadline, m.method, peer.name)
            await ctx.wait_gates()
            result = await handler(agent, peer, payload)
            header, buffers = encode(
                result, allow_pickle=agent.options.allow_pickle, context=ctx, where="result"
            )
        else:
            fn = _resolve(m.method)
            decoded = decode(
                m.header, m.buffers, allow_pickle=agent.options.allow_pickle, context=ctx
            )
            if not (isinstance(decoded, tuple) and len(decoded) == 2):
                raise SerializationError(f"malformed call payload for {m.method!r}")
            _check_deadline(deadline, m.method, peer.name)
            args, kwargs = decoded
            await ctx.wait_gates()
            how = _kind(fn)
            if how == 1:
                result = await _call(fn, m.method, args, kwargs)
                header, buffers = encode(
                    result, allow_pickle=agent.options.allow_pickle, context=ctx, where="result"
                )
            elif how == 2:
                cv = contextvars.copy_context()
                ret = await agent.loop.run_in_executor(
                    agent.executor, cv.run, _call, fn, m.method, args, kwargs
                )
                result = await _await_result(ret)
                header, buffers = encode(
                    result, allow_pickle=agent.options.allow_pickle, context=ctx, where="result"
                )
            else:
                cv = contextvars.copy_context()
                header, buffers = await agent.loop.run_in_executor(
                    agent.executor, cv.run, _call_and_encode, agent, fn, m.method, args, kwargs, ctx
                )
    except asyncio.CancelledError:
        agent.handler_done()
        raise
    except BaseException as e:  # the caller gets every error, typed
        ctx.abort()  # a result that failed to encode: undo its RRef forks
        kind = ERROR_REPLY
        header, buffers = encode(
            exception_to_wire(e), allow_pickle=False, context=None, where="error"
        )
    agent.handler_done()
    label = ("reply:" if kind == REPLY else "error:") + m.method
    reply = OutMessage(kind, m.method, header, buffers, id=m.id)
    faults = agent.options.faults
    if faults is not None and (d := faults.decide(label)) is not None:
        action, delay = d
        if action in ("drop", "fail"):
            ctx.abort()  # never sent: undo the RRef forks in it
            return
        await asyncio.sleep(delay)
    if conn.closed is None:
        conn.send(reply)
    else:
        ctx.abort()
