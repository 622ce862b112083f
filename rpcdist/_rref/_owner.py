"""The owner's side of RRef calls: creating values, ``to_here`` and proxy calls.

Every handler runs on the owner's loop. One that needs a value that does not
exist yet (its ``remote()`` is still running, or has not arrived) parks on the
record's ``ready`` future until the request's deadline; no thread is held.
User functions run as the dispatcher runs them: ``async def`` on the loop,
``@async_execution`` in the pool then awaited, plain ones in the pool.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from .._deadline import current_deadline, remaining
from .._errors import RpcdistError, RpcTimeoutError
from .._rpc._context import WireContext, current_agent
from .._rpc._dispatch import call as _call
from .._rpc._dispatch import call_user, is_async_execution, log_user_error
from .._rpc._dispatch import resolve as _resolve
from .._serialization import encode
from .._serialization._functions import check_method
from .._worker import WorkerInfo
from ._context import RRefContext, context_of
from ._protocol import Record

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = [
    "CALL_METHOD",
    "CREATE",
    "FETCH",
    "HAS_ATTR",
    "INVOKE",
    "REMOTE",
    "call_method",
    "create_value",
    "has_attr",
    "is_plain",
    "owner_handlers",
    "value_of",
]

REMOTE: Final = "rref.remote"
FETCH: Final = "rref.fetch"
INVOKE: Final = "rref.invoke"
HAS_ATTR: Final = "rref.has_attr"
#: A plain method of an owned value, called like a plain function (the
#: dispatcher's pool fast path); proxies use it once they know the method is plain.
CALL_METHOD: Final = "rpcdist._rref._owner:call_method"
#: ``remote()`` of a plain function, likewise.
CREATE: Final = "rpcdist._rref._owner:create_value"
#: The largest value sent back with its remote()'s reply, for a to_here
#: already waiting (saves that to_here a round trip).
EARLY_BYTES: Final = 16 << 10


async def value_of(ctx: RRefContext, rec: Record) -> Any:
    """The value of ``rec`` once created (or its creation error), within the deadline.

    Raises:
        RpcTimeoutError: the value was not created before the request's deadline.
        Exception: what the function that was to create the value raised.
    """
    if not rec.ready.done():
        try:
            async with asyncio.timeout_at(current_deadline.get()):
                await rec.ready
        except TimeoutError:
            raise RpcTimeoutError(
                f"RRef {rec.rid} on {ctx.agent.name!r}: its value was not created before the "
                "deadline (its remote() is still running, or never reached the owner)"
            ) from None
    try:
        return rec.get()
    finally:
        rec = None  # type: ignore[assignment]  # (a creation error's traceback keeps this frame)


def _rid(r0: int, r1: int) -> tuple[int, int]:
    return (r0, r1)


def is_plain(fn: Callable[..., Any]) -> bool:
    """Neither ``async def`` nor ``@async_execution``: it runs in the pool, to completion."""
    return not is_async_execution(fn) and not inspect.iscoroutinefunction(fn)


def _early_copy(agent: Agent, peer: WorkerInfo, value: Any) -> list[Any] | None:
    """``value`` encoded for its creator if small and free of side effects (no
    RRefs, no tensors recording autograd edges: encoded with this call's
    metadata, an extension that records anything registers an undo)."""
    ctx = WireContext(agent, peer, meta=agent.registry.meta())
    try:
        header, buffers = encode(value, allow_pickle=agent.options.allow_pickle, context=ctx)
    except RpcdistError:
        ctx.abort()
        return None
    if ctx.extra.get("undo") or len(header) + sum(b.nbytes for b in buffers) > EARLY_BYTES:
        ctx.abort()
        return None
    return [header, *(bytes(b) for b in buffers)]


async def _on_remote(agent: Agent, src: WorkerInfo, payload: list[Any]) -> list[Any]:
    """``[rid counter, fork counter | None, target, args, kwargs]`` from the creator.

    ``target`` is a function name, or ``[r0, r1, name]`` for a method of another
    owned value (``rref.remote().name(...)``). Replies ``[ok]``, or ``[True,
    header, *buffers]`` with a small value encoded for the creator; a failure
    is kept on the record, for ``to_here`` and proxies to raise.
    """
    n, f, target, args, kwargs = payload
    ctx = context_of(agent)
    rec = ctx.owners.begin_creation((src.id, n), None if f is None else (src.id, f), src.id)
    try:
        if isinstance(target, str):
            fn, label = _resolve(target), target
        else:
            owned = await value_of(ctx, ctx.owners.record(_rid(target[0], target[1])))
            check_method(agent.policy, owned, target[2])
            fn = getattr(owned, target[2])
            label = f"{type(owned).__qualname__}.{target[2]}"
        try:
            value = await call_user(agent, fn, label, args, kwargs)
        except Exception as e:
            log_user_error(label, src.name, e)
            raise
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        ctx.owners.finish_creation(rec, error=e)
        del rec  # (the error's traceback keeps this frame: it must not keep the record)
        return [False]
    return _created(agent, ctx, rec, src, f is not None, value)


def create_value(src: int, n: int, f: int | None, name: str, args: Any, kwargs: Any) -> list[Any]:
    """``remote()`` of a plain function from worker ``src``, in a pool thread.

    Sent as a plain call (``CREATE``), so it takes the dispatcher's fast path;
    replies as ``rref.remote`` does.
    """
    agent = current_agent()
    ctx = context_of(agent)
    rec = ctx.owners.begin_creation((src, n), None if f is None else (src, f), src)
    try:
        value = _call(_resolve(name), name, args, kwargs)
    except BaseException as e:
        if isinstance(e, Exception):
            log_user_error(name, agent.workers[src].name, e)
        ctx.owners.finish_creation(rec, error=e)
        del rec  # (see _on_remote)
        return [False]
    return _created(agent, ctx, rec, agent.workers[src], f is not None, value)


def _created(
    agent: Agent, ctx: RRefContext, rec: Record, creator: WorkerInfo, user: bool, value: Any
) -> list[Any]:
    early = _early_copy(agent, creator, value) if user else None
    dropped = ctx.owners.finish_creation(rec, value)
    del dropped, value  # freed here if nobody holds it
    return [True] if early is None else [True, *early]


async def _on_fetch(agent: Agent, src: WorkerInfo, rid: list[int]) -> Any:
    ctx = context_of(agent)
    return await value_of(ctx, ctx.owners.record(_rid(rid[0], rid[1])))


async def _on_invoke(agent: Agent, src: WorkerInfo, payload: list[Any]) -> list[Any]:
    """``[r0, r1, name, args, kwargs]``: call a method of an owned value.

    Replies ``[whether the method is plain, its result]``.
    """
    r0, r1, name, args, kwargs = payload
    ctx = context_of(agent)
    value = await value_of(ctx, ctx.owners.record(_rid(r0, r1)))
    check_method(agent.policy, value, name)
    fn = getattr(value, name)
    label = f"{type(value).__qualname__}.{name}"
    return [is_plain(fn), await call_user(agent, fn, label, args, kwargs)]


def call_method(r0: int, r1: int, name: str, args: Any, kwargs: Any) -> Any:
    """Call a plain method of an owned value, in a pool thread (see ``CALL_METHOD``).

    Raises:
        RpcTimeoutError: the value does not exist (yet) and did not appear in time.
        Exception: what the method raised.
    """
    agent = current_agent()
    rec = context_of(agent).owners.record(_rid(r0, r1))
    if not rec.ready.done():  # rare: proxies come here only after a first call worked
        rec.ready.wait(remaining(current_deadline.get()))
    value = rec.get()
    check_method(agent.policy, value, name)
    fn = getattr(value, name)
    label = f"{type(value).__qualname__}.{name}"
    if not is_plain(fn):  # the method changed kind: run it on the loop, from here
        coro = call_user(agent, fn, label, args, kwargs)
        return asyncio.run_coroutine_threadsafe(coro, agent.loop).result()
    return _call(fn, label, args, kwargs)


async def _on_has_attr(agent: Agent, src: WorkerInfo, payload: list[Any]) -> str:
    """``[r0, r1, name]``: ``""`` if the owned value has attribute ``name``, else its type's name."""
    r0, r1, name = payload
    ctx = context_of(agent)
    value = await value_of(ctx, ctx.owners.record(_rid(r0, r1)))
    return "" if has_attr(value, name) else type(value).__qualname__


def has_attr(value: Any, name: str) -> bool:
    """``name`` is a method or attribute of ``value``'s type or instance (no getters run)."""
    return hasattr(type(value), name) or name in getattr(value, "__dict__", ())


def owner_handlers() -> dict[str, Any]:
    """The owner's internal methods, by name."""
    return {REMOTE: _on_remote, FETCH: _on_fetch, INVOKE: _on_invoke, HAS_ATTR: _on_has_attr}
