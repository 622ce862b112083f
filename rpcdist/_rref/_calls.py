"""Calls from an RRef's holder to its owner, and ``remote()``'s creation of values.

Requests go out as INTERNAL messages (``rref.remote``, ``rref.fetch``,
``rref.invoke``, ``rref.has_attr``; see :mod:`._rref_owner`), or, for plain
functions and methods known to be plain, as plain calls that take the
dispatcher's pool fast path; each reply completes an ``rpcdist.Future``.
Nothing here imports the :class:`RRef` class itself: an RRef is seen as an
:class:`~._handle.RRefHandle`, and :func:`create` is handed its factory.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from .._deadline import Unset, deadline_for
from .._errors import (
    ConfigError,
    ConnectError,
    OwnerLostError,
    RpcTimeoutError,
    RRefCreationError,
    WorkerLostError,
)
from .._futures import Future
from .._rpc._agent import AUTO
from .._rpc._context import WireContext
from .._rpc._started import abandon
from .._serialization import decode
from .._worker import WorkerInfo
from ._context import CONFIRMED, FAILED, FAILED_ABANDON, PENDING, RELEASED, RRefContext
from ._owner import CREATE, FETCH, REMOTE
from ._protocol import Record

if TYPE_CHECKING:
    from ._handle import RRefHandle

__all__ = [
    "OwnerCall",
    "call_owner",
    "check_args",
    "create",
    "lost",
    "start_owner_call",
    "to_here_after_creation",
]

R = TypeVar("R", bound="RRefHandle")


def call_owner(
    rref: RRefHandle,
    method: str,
    payload: Any,
    deadline: float | None,
    what: str,
    args: Any = (),
    kwargs: Any = None,
    internal: bool = True,
    meta: Any = AUTO,
    blocking: bool = False,
) -> Future[Any]:
    """Send ``method`` (an internal method, or a function for ``internal=False``)
    to the owner of ``rref``, with ``deadline``; a Future of the reply.
    ``meta``: the call's named fields (default: this thread's or task's).
    ``blocking``: the caller waits for the reply anyway: a confirmed RRef's
    call is :func:`start_owner_call`'s, waited for on this thread, and the
    Future returned is complete (a failure is raised at once).

    The reply's transport failures become OwnerLostError; a pending ``rref``
    that fails meanwhile (remote() timed out, owner lost) fails it at once.
    """
    ctx = rref._ctx
    agent = ctx.agent
    if ctx.is_lost(rref._owner):
        raise ctx.lost_error(rref._owner, f"{what} on {rref!r}")
    confirmed = rref._confirmed
    if blocking and (confirmed is None or confirmed.done()):
        # A failure is raised from here, not kept in the Future: a frame of
        # its traceback (a caller's) would hold that Future, a cycle.
        value = start_owner_call(
            rref, method, payload, deadline, what, args, kwargs, internal, meta
        ).wait()
        done: Future[Any] = Future()
        done.set_result(value)
        return done
    reply = agent.call(
        rref._owner,
        method,
        payload,
        deadline=deadline,
        internal=internal,
        where=(args, kwargs),
        meta=meta,
    )
    # The reply's callback holds ``rref`` (so its fork) alive until the reply.
    hold = [rref]
    out = reply.then(
        functools.partial(_from_owner, ctx, rref._owner, f"{what} on RRef {rref._rid}", hold)
    )
    confirmed = rref._confirmed
    if confirmed is not None and not confirmed.done():
        # Fail at once if the RRef fails meanwhile (its remote() timed out, owner lost).
        out, reply = Future(), out
        box = [out]  # whichever finishes first takes it (the other no longer refers to it)
        reply.add_done_callback(functools.partial(_first, box))
        confirmed.add_done_callback(functools.partial(_guard, box, hold))
    return out


class OwnerCall:
    """A call to an RRef's owner already sent from this thread, whose reply
    :meth:`wait` reads here (see :func:`start_owner_call`)."""

    __slots__ = ("_call", "_ctx", "_hold", "_owner", "_what")

    def __init__(self, call: Any, ctx: RRefContext, owner: int, what: str, hold: list[Any]) -> None:
        self._call = call
        self._ctx = ctx
        self._owner = owner
        self._what = what
        self._hold = hold  # the RRef (so its fork) stays alive until the reply

    def wait(self) -> Any:
        try:
            return self._call.wait()
        except BaseException as e:
            _raise_from_owner(self._ctx, self._owner, self._what, e)
        finally:
            self._hold.clear()
            self = None  # type: ignore[assignment]  # (it holds the reply, which may hold the error)

    def abandon(self) -> None:
        abandon([self._call])
        self._hold.clear()


def start_owner_call(
    rref: RRefHandle,
    method: str,
    payload: Any,
    deadline: float | None,
    what: str,
    args: Any,
    kwargs: Any,
    internal: bool,
    meta: Any = AUTO,
) -> Any:
    """:func:`call_owner` with ``blocking``, split: the call leaves now (on a
    thread-driven link when it qualifies) and ``wait()`` on what this returns
    reads the reply on the calling thread, the caller working meanwhile. An
    RRef whose creation is not yet confirmed takes :func:`call_owner`'s path
    (its Future also has ``wait()``)."""
    ctx = rref._ctx
    confirmed = rref._confirmed
    if confirmed is not None and not confirmed.done():
        return call_owner(rref, method, payload, deadline, what, args, kwargs, internal)
    owner = rref._owner
    if ctx.is_lost(owner):
        raise ctx.lost_error(owner, f"{what} on {rref!r}")
    what = f"{what} on RRef {rref._rid}"
    try:
        call = ctx.agent.start_blocking(
            owner,
            method,
            payload,
            deadline=deadline,
            internal=internal,
            where=(args, kwargs),
            meta=meta,
        )
    except BaseException as e:
        _raise_from_owner(ctx, owner, what, e)
    return OwnerCall(call, ctx, owner, what, [rref])


def _guard(box: list[Future[Any]], hold: list[Any], confirmed: Future[None]) -> None:
    if confirmed.exception() is not None:
        hold.clear()  # no need to keep it alive for the reply any more
        _first(box, confirmed)


def _first(box: list[Future[Any]], fut: Future[Any]) -> None:
    try:
        out = box.pop()
    except IndexError:
        return
    _copy(out, fut)


def _copy(out: Future[Any], fut: Future[Any]) -> None:
    exc = fut.exception()
    out.set_result(fut.value()) if exc is None else out.set_exception(exc)


def to_here_after_creation(rref: RRefHandle, deadline: float | None, what: str) -> Future[Any]:
    """``to_here`` on a creator RRef whose ``remote()`` has not replied yet.

    The reply may bring a small copy of the value (made when it was created,
    so right for a ``to_here`` issued before it); otherwise fetch it then.
    """
    out: Future[Any] = Future()
    assert rref._confirmed is not None and rref._creator is not None
    # The fetch leaves from a callback: it carries this caller's fields (an
    # autograd context), taken now.
    meta = rref._ctx.agent.registry.meta()
    done = functools.partial(_after_creation, rref, out, deadline, what, meta)
    rref._confirmed.add_done_callback(done)
    if deadline is None or rref._creator <= deadline:
        return out  # the creation fails by itself first; a fetch has ``deadline``
    return rref._ctx.bounded(out, deadline, what)


def _after_creation(
    rref: RRefHandle,
    out: Future[Any],
    deadline: float | None,
    what: str,
    meta: Any,
    confirmed: Future[None],
) -> None:
    exc = confirmed.exception()
    if exc is not None:  # (not raised here: this frame would join its traceback, and hold ``rref``)
        out.set_exception(exc)
        return
    try:
        early = rref._early
        # (a to_here() whose call carries metadata, a distributed autograd
        # context, fetches: the early copy was encoded outside its context)
        if early is None or meta:
            fetch = call_owner(rref, FETCH, [*rref._rid], deadline, what, meta=meta)
            fetch.add_done_callback(functools.partial(_copy, out))
            return
        agent = rref._ctx.agent
        ctx = WireContext(agent, rref.owner())
        value = decode(early[0], early[1:], allow_pickle=agent.options.allow_pickle, context=ctx)
    except BaseException as e:
        out.set_exception(e)
    else:
        out.set_result(value)


def lost(exc: BaseException) -> bool:
    """A transport failure seen here (not an error raised by the owner's code)."""
    return (
        isinstance(exc, WorkerLostError | ConnectError)
        and not isinstance(exc, OwnerLostError)
        and not getattr(exc, "remote_traceback", "")
    )


def _from_owner(ctx: RRefContext, owner: int, what: str, hold: list[Any], fut: Future[Any]) -> Any:
    hold.clear()
    exc = fut.exception()
    if exc is None:
        return fut.value()
    _raise_from_owner(ctx, owner, what, exc)


def _raise_from_owner(ctx: RRefContext, owner: int, what: str, exc: BaseException) -> NoReturn:
    """Raise ``exc``, an owner call's failure; a transport failure (the owner
    lost) marks the owner lost and becomes its typed error."""
    if lost(exc):
        ctx.mark_lost(owner)
        raise ctx.lost_error(owner, what, exc) from exc
    try:
        raise exc
    finally:
        exc = None  # type: ignore[assignment]  # (its traceback keeps this frame)


def check_args(args: Any, kwargs: Any) -> None:
    if not isinstance(args, tuple | list):
        raise ConfigError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")


def create(
    make: Callable[..., R],
    ctx: RRefContext,
    owner: WorkerInfo,
    target: Any,
    args: Any,
    kwargs: Any,
    timeout: float | Unset | None,
    what: str,
    keep: Any = None,
    plain: bool = False,
) -> R:
    """Send ``rref.remote`` to ``owner``; return the new RRef (from ``make``, called
    as ``make(ctx, rid, fork, owner, record, state)``) at once.

    ``target`` is a function name (``plain``: a plain function, not ``async def``
    nor ``@async_execution``) or ``[r0, r1, method name]``; ``keep`` is held
    until the reply (the RRef whose method is called).
    """
    agent = ctx.agent
    ctx.check_open(f"remote {what}")
    check_args(args, kwargs)
    deadline = deadline_for(timeout, agent.rpc_timeout)
    rid = ctx.ids.new()
    fork = None
    rec = None
    if owner.id == agent.rank:
        rec = ctx.owners.record(rid)
        rref = make(ctx, rid, None, owner.id, rec, CONFIRMED)
    else:
        if ctx.is_lost(owner.id):
            raise ctx.lost_error(owner.id, f"remote {what}")
        fork = ctx.ids.new()
        rref = make(ctx, rid, fork, owner.id, None, PENDING)
        rref._creator = math.inf if deadline is None else deadline
        ctx.users.add_pending(fork, rref, None)
    f = None if fork is None else fork[1]
    payload: Any
    if plain:  # a plain call (the pool fast path), still labelled rref.remote
        method = CREATE
        payload = ((agent.rank, rid[1], f, target, list(args), kwargs or {}), {})
    else:
        method = REMOTE
        payload = [rid[1], f, target, list(args), kwargs or {}]
    try:
        fut = agent.call(
            owner.id,
            method,
            payload,
            deadline=deadline,
            internal=not plain,
            label=REMOTE,
            where=(args, kwargs),
        )
    except BaseException:
        if fork is not None:
            ctx.users.settle(fork, RELEASED)
        raise
    user = None if fork is None else rref
    fut.add_done_callback(functools.partial(_created, ctx, owner, fork, rec, user, what, keep))
    return rref


def _created(
    ctx: RRefContext,
    owner: WorkerInfo,
    fork: tuple[int, int] | None,
    rec: Record | None,
    rref: RRefHandle | None,
    what: str,
    keep: Any,
    fut: Future[Any],
) -> None:
    exc = fut.exception()
    if exc is None:
        if fork is not None and rref is not None:
            reply = fut.value()
            rref._early = reply[1:] if len(reply) > 1 else None  # for to_here()s waiting
            ctx.settle(fork, CONFIRMED)
            rref._early = None
        return
    state = FAILED
    if lost(exc):
        err: BaseException = ctx.lost_error(owner.id, f"remote {what}", exc)
    else:
        err = RRefCreationError(f"RRef creation by remote {what} on {owner.name!r} failed: {exc}")
        if isinstance(exc, RpcTimeoutError) and not getattr(exc, "remote_traceback", ""):
            state = FAILED_ABANDON  # the owner may still create it: tell it when dropped
    err.__cause__ = exc
    if fork is not None:
        ctx.settle(fork, state, err)
    elif rec is not None:
        ctx.owners.finish_creation(rec, error=err)
    if lost(exc):
        ctx.mark_lost(owner.id)
