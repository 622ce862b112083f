"""Running incoming calls: the one handler path.

Every incoming CALL or INTERNAL message, whichever thread reads it, is run
here: :func:`run_handler` on a pool or serving thread for a plain function
whose arguments need no waiting, :func:`serve` as a loop task for the rest
(``async def`` functions, ``@async_execution`` functions, internal methods,
arguments gated on RRef confirmations). Both bind the current agent and the
call's deadline, enter the registry's *handler scopes* around the user
function and the encoding of its reply (that is where an extension such as
distributed autograd binds its per-call state), and attach the registry's
metadata to the reply. :func:`call_user` runs a user function by its kind
for the RRef owner's handlers, which themselves run under :func:`serve`.

``async def`` functions run on the agent loop; ``@async_execution`` ones in
the pool, their returned Future then awaited without holding a thread;
plain ones in the pool, which bounds how many run at once
(``num_worker_threads``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from .._deadline import current_deadline
from .._errors import ProtocolError, RpcdistError, RpcTimeoutError, SerializationError
from .._futures import Future
from .._serialization import decode, encode, exception_to_wire
from .._serialization._functions import DEFAULT_POLICY, CallablePolicy
from .._serialization._functions import resolve as _resolve
from .._transport import Link
from .._transport._frames import ERROR_REPLY, INTERNAL, REPLY, InMessage, OutMessage
from ..functions import ASYNC_EXECUTION_ATTR
from ._registry import CallInfo
from ._wire import WireContext, bind_agent, bound_agent, reset_agent

if TYPE_CHECKING:
    from .._worker import WorkerInfo
    from ._agent_view import AgentView

__all__ = [
    "blocked_handler",
    "call_user",
    "call_wire",
    "decode_call",
    "dispatch",
    "is_async_execution",
    "plain_function",
    "post_handler",
    "reply_error_threadsafe",
    "run_handler",
    "serve",
]

_log = logging.getLogger(__name__)

_PLAIN, _ASYNC, _ASYNC_EXECUTION = 0, 1, 2


def is_async_execution(fn: Any) -> bool:
    return bool(getattr(fn, ASYNC_EXECUTION_ATTR, False))


def resolve(name: str, policy: CallablePolicy | None = None) -> Callable[..., Any]:
    """The function a call names, under ``policy`` (default: the current
    agent's callable policy); cached, refusals included in the check.

    Raises:
        SerializationError: it cannot be imported or is not a function.
        CallPolicyError: the policy refuses it.
    """
    if policy is None:
        agent = bound_agent()
        policy = agent.policy if agent is not None else DEFAULT_POLICY
    return _resolve(name, policy)


def _kind_of(fn: Callable[..., Any]) -> int:
    if is_async_execution(fn):
        return _ASYNC_EXECUTION
    if inspect.iscoroutinefunction(fn):
        return _ASYNC
    return _PLAIN


#: For functions resolved by name (module-level, long-lived). Never for bound
#: methods of owned values: the cache would keep the values alive.
_kind = functools.lru_cache(maxsize=4096)(_kind_of)


def plain_function(m: InMessage, policy: CallablePolicy) -> Callable[..., Any] | None:
    """The plain (not ``async``) function a CALL names, if ``policy`` allows it, else None."""
    try:
        fn = _resolve(m.method, policy)
    except Exception:
        return None  # serve() reports it
    return fn if _kind(fn) == _PLAIN else None


def call(fn: Callable[..., Any], name: str, args: Any, kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with a clear message when the arguments do not fit."""
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


def log_user_error(name: str, caller: str, e: BaseException) -> None:
    """One line on this (the callee's) log for a user function that raised:
    the caller gets the error itself, as PyTorch's agent logs it too."""
    # (formatted here: a log record holding ``e`` would keep its traceback's frames)
    _log.warning("%s", f"{name}() called by {caller} raised {e!r} (sent back to the caller)")


def blocked_handler(agent: AgentView, ident: int, waits_on: object) -> tuple[str, str]:
    """What blocked thread ``ident``'s handler runs and what it waits on,
    for the handler pool's warnings (its ``describe`` hook; any thread, only
    when a warning or snapshot is made): the function of the innermost
    :func:`call` on that thread's stack, and the call whose reply
    ``waits_on`` is (a ``Started`` call, the Future of a pending call, or
    that of an ``Agent.rpc_sync`` on the stack not sent yet)."""
    running, sent_by = "a task", None
    frame = sys._current_frames().get(ident)
    while frame is not None:
        code = frame.f_code
        if code is call.__code__:
            running = repr(frame.f_locals.get("name"))
            break
        if sent_by is None and code.co_qualname == "Agent.rpc_sync":
            sent_by = frame.f_locals
        frame = frame.f_back
    del frame
    if isinstance(waits_on, Future):
        what = agent.calls.describe(waits_on)
        if what is None and sent_by is not None:
            msg, peer = sent_by.get("msg"), sent_by.get("peer")
            what = f"{getattr(msg, 'label', '') or getattr(msg, 'method', '?')!r} on "
            what += repr(getattr(peer, "name", "?"))
        what = what or "a Future (its call not sent yet, or other work)"
    elif hasattr(waits_on, "chan") and hasattr(waits_on, "label"):  # a ``Started`` call
        what = f"{waits_on.label!r} on {agent.workers[waits_on.chan.link.peer_rank].name!r}"
    else:
        what = str(waits_on)
    return running, what


async def call_user(
    agent: AgentView, fn: Callable[..., Any], label: str, args: Any, kwargs: Any
) -> Any:
    """Run a user function by its kind (on the loop, in a handler's context)."""
    how = _kind_of(fn)
    if how == _ASYNC:
        return await call(fn, label, args, kwargs)
    cv = contextvars.copy_context()  # the handler scopes' state follows into the pool
    ret = await agent.loop.run_in_executor(agent.executor, cv.run, call, fn, label, args, kwargs)
    if how == _PLAIN:
        return ret
    if isinstance(ret, Future) or inspect.isawaitable(ret):
        try:
            return await ret
        finally:
            ret = None  # (a failure's traceback keeps this frame: not the Future that holds it)
    raise TypeError(
        f"an @async_execution function must return an rpcdist.Future or awaitable, "
        f"got {type(ret).__name__}"
    )


def _check_deadline(deadline: float | None, method: str, peer: str) -> None:
    # Checked after decoding, so that RRefs in a late request are still
    # registered (and then released) rather than leaked.
    if deadline is not None and deadline <= time.monotonic():
        raise RpcTimeoutError(f"call {method!r} from {peer!r} arrived after its deadline")


def call_wire(
    agent: AgentView, peer: WorkerInfo, m: InMessage, *, off_loop: bool = False
) -> WireContext:
    """The wire context a received CALL is handled in (any thread), after
    handing its riders' fields to their extensions (``Registry.on_call``)."""
    meta = m.meta
    wire = WireContext(agent, peer, off_loop=off_loop, meta=meta, reply_meta={})
    if meta:  # (most calls carry none)
        agent.registry.on_call(agent, peer, meta, wire)
    return wire


def decode_call(agent: AgentView, m: InMessage, wire: WireContext) -> tuple[Any, Any]:
    """A CALL's ``(args, kwargs)``.

    Raises:
        SerializationError: the payload is malformed.
    """
    decoded = decode(m.header, m.buffers, allow_pickle=agent.options.allow_pickle, context=wire)
    if not (isinstance(decoded, tuple) and len(decoded) == 2):
        raise SerializationError(f"malformed call payload for {m.method!r}")
    return decoded[0], decoded[1]


# ------------------------------------------------------------------ the loop


def dispatch(agent: AgentView, link: Link, m: InMessage) -> None:
    """Start handling one CALL or INTERNAL message (on the loop).

    A plain function whose arguments need no gating goes straight to the
    thread pool, which encodes the reply and sends it (or hands it back to
    the loop): no task, one hop each way. Everything else runs as a
    :func:`serve` task.
    """
    if m.kind != INTERNAL and (fn := plain_function(m, agent.policy)) is not None:
        wire = call_wire(agent, agent.workers[link.peer_rank], m)
        try:
            args, kwargs = decode_call(agent, m, wire)
        except BaseException as e:
            wire.abort()
            _send_reply(agent, link, m, wire, ERROR_REPLY, *_encode_error(e))
            return
        if not wire.gates:
            agent.wake_after_read(link, _post_from_loop, agent, link, m, fn, args, kwargs, wire)
            return
        # Never decode twice: decoding has side effects (RRef forks).
        agent.spawn(serve(agent, link, m, (wire, args, kwargs)))
        return
    agent.spawn(serve(agent, link, m))


def _post_from_loop(agent: AgentView, *job: Any) -> None:
    try:  # (post_handler inlined: every dispatched call comes here)
        agent.executor.post(run_handler, agent, *job)
    except RuntimeError:  # the pool was shut down: the agent is closing
        agent.activity.handler_done()


def post_handler(agent: AgentView, *job: Any) -> None:
    """Hand ``run_handler(agent, *job)`` to the pool from a thread other than
    the loop's; ``job`` is ``(link, m, fn, args, kwargs, wire)``."""
    try:
        agent.executor.post(run_handler, agent, *job)
    except RuntimeError:  # the pool was shut down: the agent is closing
        agent.activity.handler_done_threadsafe()


async def serve(
    agent: AgentView,
    link: Link,
    m: InMessage,
    decoded: tuple[WireContext, Any, Any] | None = None,
) -> None:
    """Handle one CALL or INTERNAL message as a loop task and reply on ``link``.

    ``decoded`` is ``(wire context, args, kwargs)`` of a call
    :func:`dispatch` decoded already.
    """
    peer = agent.workers[link.peer_rank]
    deadline = m.deadline
    bind_agent(agent)  # this task runs in its own copy of the context
    current_deadline.set(deadline)
    if decoded is not None:
        wire = decoded[0]
    elif m.kind == INTERNAL:
        wire = WireContext(agent, peer, meta=m.meta, reply_meta={})
    else:
        wire = call_wire(agent, peer, m)
    scopes: AbstractContextManager[Any] | None = None
    kind = REPLY
    try:
        if m.kind == INTERNAL:
            handler = agent.registry.handlers.get(m.method)
            if handler is None:
                raise ProtocolError(f"unknown internal method {m.method!r}")
            payload = decode(
                m.header, m.buffers, allow_pickle=agent.options.allow_pickle, context=wire
            )
            _check_deadline(deadline, m.method, peer.name)
            await wire.wait_gates(deadline)
            scopes = agent.registry.enter_scopes(CallInfo(agent, peer, m.method, m.meta, deadline))
            result = await handler(agent, peer, payload)
        else:
            fn = _resolve(m.method, agent.policy)
            if decoded is None:
                args, kwargs = decode_call(agent, m, wire)
            else:
                args, kwargs = decoded[1], decoded[2]
            _check_deadline(deadline, m.method, peer.name)
            await wire.wait_gates(deadline)
            scopes = agent.registry.enter_scopes(CallInfo(agent, peer, m.method, m.meta, deadline))
            try:
                result = await call_user(agent, fn, m.method, args, kwargs)
            except Exception as e:
                log_user_error(m.method, peer.name, e)
                raise
        wire.meta = agent.registry.meta()
        header, buffers = encode(
            result, allow_pickle=agent.options.allow_pickle, context=wire, where="result"
        )
        if buffers:
            agent.check_size(header, buffers, f"the reply to {m.method!r}")
    except asyncio.CancelledError:
        _exit(scopes, None)
        agent.activity.handler_done()
        raise
    except BaseException as e:  # the caller gets every error, typed
        _exit(scopes, e)
        scopes = None
        wire.abort()  # a result that failed to encode: undo its RRef forks
        kind = ERROR_REPLY
        header, buffers = _encode_error(e)
    _exit(scopes, None)
    _send_reply(agent, link, m, wire, kind, header, buffers)


# --------------------------------------------------------------- threads


def run_handler(
    agent: AgentView,
    link: Link,
    m: InMessage,
    fn: Callable[..., Any],
    args: Any,
    kwargs: Any,
    wire: WireContext,
) -> None:
    """On a pool or serving thread: run plain function ``fn`` under the
    handler scopes, encode its reply and send it (or hand it to the loop)."""
    deadline = m.deadline
    t_agent = bind_agent(agent)
    t_deadline = current_deadline.set(deadline)
    scopes: AbstractContextManager[Any] | None = None
    try:
        _check_deadline(deadline, m.method, wire.peer.name)
        if agent.registry.wants_scopes(m.meta):
            info = CallInfo(agent, wire.peer, m.method, m.meta, deadline)
            scopes = agent.registry.enter_scopes(info)
        try:
            result = call(fn, m.method, args, kwargs)
        except Exception as e:
            log_user_error(m.method, wire.peer.name, e)
            raise
        kind = REPLY
        wire.meta = agent.registry.meta()
        header, buffers = encode(
            result, allow_pickle=agent.options.allow_pickle, context=wire, where="result"
        )
        if buffers:
            agent.check_size(header, buffers, f"the reply to {m.method!r}")
        if scopes is not None:
            _exit(scopes, None)
    except BaseException as e:  # the caller gets every error, typed
        _exit(scopes, e)
        wire.abort()
        kind = ERROR_REPLY
        header, buffers = _encode_error(e)
    finally:
        current_deadline.reset(t_deadline)
        reset_agent(t_agent)
    _reply_from_thread(agent, link, m, wire, kind, header, buffers)


def reply_error_threadsafe(
    agent: AgentView, link: Link, m: InMessage, wire: WireContext, e: BaseException
) -> None:
    """From a thread other than the loop's: answer ``m`` with error ``e``."""
    _reply_from_thread(agent, link, m, wire, ERROR_REPLY, *_encode_error(e))


# --------------------------------------------------------------- replies


def _exit(scopes: AbstractContextManager[Any] | None, exc: BaseException | None) -> None:
    if scopes is not None:
        scopes.__exit__(None if exc is None else type(exc), exc, None)


def _encode_error(e: BaseException) -> tuple[bytes, list[memoryview]]:
    return encode(exception_to_wire(e), allow_pickle=False, context=None, where="error")


def _reply(
    m: InMessage, wire: WireContext, kind: int, header: bytes, buffers: list[memoryview]
) -> OutMessage:
    meta = wire.meta if kind == REPLY else None
    if wire.reply_meta:  # (what extensions send back; ``wire.abort`` takes it back)
        meta = {**meta, **wire.reply_meta} if meta else wire.reply_meta
    return OutMessage(kind, m.method, header, buffers, id=m.id, meta=meta, undo=wire.abort)


def _reply_from_thread(
    agent: AgentView,
    link: Link,
    m: InMessage,
    wire: WireContext,
    kind: int,
    header: bytes,
    buffers: list[memoryview],
) -> None:
    """Account for the finished handler and send its reply, from a thread."""
    reply = _reply(m, wire, kind, header, buffers)
    link.to_segment(reply)  # (a large payload: copied on this thread, not the loop)
    try:
        # (busy: replies coalesce better on the loop; asked here first, the usual answer)
        if agent.activity.inflight > 1 or not _reply_now(agent, link, reply):
            agent.loop.call_soon_threadsafe(_send, agent, link, reply)
    except RuntimeError:  # the loop is closed: the agent shut down meanwhile
        pass
    if wire.extra:
        _after_reply(wire)


def _reply_now(agent: AgentView, link: Link, reply: OutMessage) -> bool:
    """From a thread: send a reply straight away if the link allows.

    Saves one thread hop per call (the reply no longer waits for the loop)
    when this is the only handler running; under load, replies queued on the
    loop leave several per write, which measured faster.
    """
    if agent.activity.inflight > 1:  # busy: replies coalesce better on the loop
        return False
    # Counted just before the reply leaves, so the caller never sees its
    # reply before this worker's statistics include the call.
    try:
        return link.try_send_now(reply, before=agent.activity.handler_done_threadsafe)
    except RpcdistError:  # a fault rule failed it: as good as dropped
        agent.activity.handler_done_threadsafe()
        reply.dropped()
        return True


def _send_reply(
    agent: AgentView,
    link: Link,
    m: InMessage,
    wire: WireContext,
    kind: int,
    header: bytes,
    buffers: list[memoryview],
) -> None:
    """On the loop: account for the finished handler and send its reply."""
    _send(agent, link, _reply(m, wire, kind, header, buffers))
    _after_reply(wire)


def _after_reply(wire: WireContext) -> None:
    """Run what extensions left for after a call's reply (``extra["after_reply"]``:
    work the caller need not wait for, such as freeing released contexts)."""
    for fn in wire.extra.pop("after_reply", ()):
        try:
            fn()
        except Exception:  # (a bug in an extension: say so, and answer the next call)
            _log.exception("error after replying to a call from %s", wire.peer.name)


def _send(agent: AgentView, link: Link, reply: OutMessage) -> None:
    agent.activity.handler_done()
    if link.closed is not None:
        reply.dropped()
        return
    try:
        link.send(reply)
    except RpcdistError as e:  # closed meanwhile, or a fault rule failed it
        _log.debug("reply %d to %s not sent: %s", reply.id, link.label, e)
        reply.dropped()
