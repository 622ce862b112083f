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

from .._deadline import current_deadline
from .._errors import (
    ProtocolError,
    RpcTimeoutError,
    SerializationError,
)
from .._futures import Future
from .._serialization import decode, encode, exception_to_wire, resolve_function
from .._transport._frames import ERROR_REPLY, INTERNAL, REPLY, InMessage, OutMessage
from ..functions import ASYNC_EXECUTION_ATTR
from ._context import WireContext, bind_agent, reset_agent

if TYPE_CHECKING:
    from .._transport._conn import BaseConnection as Connection
    from ._agent import Agent

__all__ = ["dispatch", "is_async_execution", "serve"]

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


def dispatch(agent: Agent, conn: Connection, m: InMessage) -> None:
    """Start handling one CALL or INTERNAL message (on the loop).

    A plain function whose arguments need no gating goes straight to the
    thread pool, which encodes the reply and hands it back to the loop: no
    task, one hop each way. Everything else runs as a :func:`serve` task.
    """
    if m.kind != INTERNAL:
        try:
            fn = _resolve(m.method)
        except Exception:
            fn = None  # serve() reports it
        if fn is not None and _kind(fn) == 0:
            ctx = WireContext(agent, agent.workers[conn.peer_rank])
            try:
                args, kwargs = decode_call(agent, m, ctx)
            except BaseException as e:
                ctx.abort()
                _send_reply(agent, conn, m, ctx, ERROR_REPLY, *_encode_error(e))
                return
            if not ctx.gates:
                agent.wake_after_read(conn, _post_plain, agent, conn, m, fn, args, kwargs, ctx)
                return
            # Never decode twice: decoding has side effects (RRef forks).
            agent.spawn(serve(agent, conn, m, (ctx, args, kwargs)))
            return
    agent.spawn(serve(agent, conn, m))


def _post_plain(agent: Agent, *job: Any) -> None:
    """Hand ``run_plain(agent, *job)`` to the pool (on the loop, after the read callback)."""
    post_plain(agent, *job, on_loop=True)


def post_plain(agent: Agent, *job: Any, on_loop: bool = False) -> None:
    """Hand ``run_plain(agent, *job)`` to the pool from any thread; ``job`` is
    ``(conn, m, fn, args, kwargs, ctx)``."""
    try:
        agent.executor.post(run_plain, agent, *job)
    except RuntimeError:  # the pool was shut down: the agent is closing
        agent.handler_done() if on_loop else agent.handler_done_threadsafe()


def plain_function(m: InMessage) -> Callable[..., Any] | None:
    """The plain (not ``async``) function a CALL names, else None."""
    try:
        fn = _resolve(m.method)
    except Exception:
        return None  # serve() reports it
    return fn if _kind(fn) == 0 else None


def reply_error_threadsafe(
    agent: Agent, conn: Connection, m: InMessage, ctx: WireContext, e: BaseException
) -> None:
    """From a thread other than the loop's: answer ``m`` with error ``e``."""
    _reply_from_thread(agent, conn, m, ctx, ERROR_REPLY, *_encode_error(e))


def decode_call(agent: Agent, m: InMessage, ctx: WireContext) -> tuple[Any, Any]:
    """A CALL's ``(args, kwargs)``.

    Raises:
        SerializationError: the payload is malformed.
    """
    decoded = decode(m.header, m.buffers, allow_pickle=agent.options.allow_pickle, context=ctx)
    if not (isinstance(decoded, tuple) and len(decoded) == 2):
        raise SerializationError(f"malformed call payload for {m.method!r}")
    return decoded[0], decoded[1]


def _encode_error(e: BaseException) -> tuple[bytes, list[memoryview]]:
    return encode(exception_to_wire(e), allow_pickle=False, context=None, where="error")


def run_plain(
    agent: Agent,
    conn: Connection,
    m: InMessage,
    fn: Callable[..., Any],
    args: Any,
    kwargs: Any,
    ctx: WireContext,
) -> None:
    """In a pool thread (or on a borrowed slot): run ``fn``, encode its reply,
    send it (or hand it to the loop)."""
    t_agent = bind_agent(agent)
    t_deadline = current_deadline.set(m.deadline)
    try:
        _check_deadline(m.deadline, m.method, ctx.peer.name)
        result = _call(fn, m.method, args, kwargs)
        kind = REPLY
        header, buffers = encode(
            result, allow_pickle=agent.options.allow_pickle, context=ctx, where="result"
        )
    except BaseException as e:  # the caller gets every error, typed
        ctx.abort()
        kind = ERROR_REPLY
        header, buffers = _encode_error(e)
    finally:
        current_deadline.reset(t_deadline)
        reset_agent(t_agent)
    _reply_from_thread(agent, conn, m, ctx, kind, header, buffers)


def _reply_from_thread(
    agent: Agent,
    conn: Connection,
    m: InMessage,
    ctx: WireContext,
    kind: int,
    header: bytes,
    buffers: list[memoryview],
) -> None:
    """Account for the finished handler and send its reply, from a pool thread."""
    try:
        if not _reply_now(agent, conn, m, kind, header, buffers):
            agent.loop.call_soon_threadsafe(_send_reply, agent, conn, m, ctx, kind, header, buffers)
    except RuntimeError:  # the loop is closed: the agent shut down meanwhile
        pass


#: Replies up to this size may go out from the pool thread that made them.
_DIRECT_REPLY_BYTES = 64 << 10


def _reply_now(
    agent: Agent,
    conn: Connection,
    m: InMessage,
    kind: int,
    header: bytes,
    buffers: list[memoryview],
) -> bool:
    """From a pool thread: send a small reply straight away if the link allows.

    Saves one thread hop per call (the reply no longer waits for the loop)
    when this is the only handler running; under load, replies queued on the
    loop leave several per write, which measured faster. Not done under
    fault injection, which decides on the loop.
    """
    if agent.options.faults is not None:
        return False
    if agent.inflight_handlers > 1:  # busy: replies coalesce better on the loop
        return False
    if len(header) + sum(b.nbytes for b in buffers) > _DIRECT_REPLY_BYTES:
        return False
    # Counted just before the reply leaves, so the caller never sees its
    # reply before this worker's statistics include the call.
    reply = OutMessage(kind, m.method, header, buffers, id=m.id)
    return conn.try_send_now(reply, before=agent.handler_done_threadsafe)


def _send_reply(
    agent: Agent,
    conn: Connection,
    m: InMessage,
    ctx: WireContext,
    kind: int,
    header: bytes,
    buffers: list[memoryview],
) -> None:
    """On the loop: account for the finished handler and send its reply."""
    agent.handler_done()
    reply = OutMessage(kind, m.method, header, buffers, id=m.id)
    faults = agent.options.faults
    if faults is not None:
        d = faults.decide(("reply:" if kind == REPLY else "error:") + m.method)
        if d is not None:
            action, delay = d
            if action in ("drop", "fail"):
                ctx.abort()  # never sent: undo the RRef forks in it
                return
            agent.loop.call_later(delay, _deliver, conn, reply, ctx)
            return
    _deliver(conn, reply, ctx)


def _deliver(conn: Connection, reply: OutMessage, ctx: WireContext) -> None:
    if conn.closed is None:
        conn.send(reply)
    else:
        ctx.abort()


async def serve(
    agent: Agent,
    conn: Connection,
    m: InMessage,
    decoded: tuple[WireContext, Any, Any] | None = None,
) -> None:
    """Handle one CALL or INTERNAL message and send its reply on ``conn``.

    ``decoded`` is ``(context, args, kwargs)`` of a call :func:`dispatch` decoded.
    """
    peer = agent.workers[conn.peer_rank]
    deadline = m.deadline
    bind_agent(agent)  # this task runs in its own copy of the context
    current_deadline.set(deadline)
    ctx = WireContext(agent, peer) if decoded is None else decoded[0]
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
            await ctx.wait_gates(deadline)
            result = await handler(agent, peer, payload)
        else:
            fn = _resolve(m.method)
            if decoded is None:
                args, kwargs = decode_call(agent, m, ctx)
            else:
                args, kwargs = decoded[1], decoded[2]
            _check_deadline(deadline, m.method, peer.name)
            await ctx.wait_gates(deadline)
            how = _kind(fn)
            if how == 1:
                result = await _call(fn, m.method, args, kwargs)
            else:
                cv = contextvars.copy_context()
                ret = await agent.loop.run_in_executor(
                    agent.executor, cv.run, _call, fn, m.method, args, kwargs
                )
                result = await _await_result(ret) if how == 2 else ret
        header, buffers = encode(
            result, allow_pickle=agent.options.allow_pickle, context=ctx, where="result"
        )
    except asyncio.CancelledError:
        agent.handler_done()
        raise
    except BaseException as e:  # the caller gets every error, typed
        ctx.abort()  # a result that failed to encode: undo its RRef forks
        kind = ERROR_REPLY
        header, buffers = _encode_error(e)
    _send_reply(agent, conn, m, ctx, kind, header, buffers)
