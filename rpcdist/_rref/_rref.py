"""Remote references: :class:`RRef`, :func:`remote`, and their wire form.

An RRef travels only inside an RPC (arguments or results, nested anywhere):
the codec extension below turns it into a fork descriptor
``[owner, r0, r1, child fork counter]`` and back, doing the protocol's
bookkeeping on both ends (``docs/rref.md``, flows 2-4).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._deadline import UNSET, Unset, deadline_for
from .._errors import (
    AutogradError,
    ClosedError,
    ConfigError,
    RpcTimeoutError,
    RRefError,
    SerializationError,
    WrongThreadError,
)
from .._futures import Future
from .._rpc._context import WireContext, current_agent
from .._rpc._doctor import summary
from .._serialization import register_extension
from .._worker import WorkerInfo
from ._calls import call_owner, create, start_owner_call, to_here_after_creation
from ._context import (
    ACCEPTS,
    CHILD_ACCEPT,
    CONFIRMED,
    FAILED_ABANDON,
    FAILED_DELETE,
    FORK_REQUEST,
    PENDING,
    RELEASED,
    USER_DELETE,
    RRefContext,
    accept_children,
    context_of,
    gate,
)
from ._owner import CALL_METHOD, FETCH, HAS_ATTR, INVOKE, has_attr, is_plain
from ._protocol import Record
from ._proxy import RRefProxy

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = ["RRef", "accepts_in_reply", "remote"]

T = TypeVar("T")
#: The owner's internal method (served by its distributed autograd extension).
_RREF_BACKWARD = "autograd.rref_backward"
RREF_CODE = 32  # codec extension code of fork descriptors


class RRef(Generic[T]):
    """A reference to a value that lives on one worker, its owner.

    ``RRef(value)`` makes a local owner RRef; :func:`rpcdist.remote` returns a
    user RRef at once while the owner creates the value. RRefs may be sent in
    any RPC's arguments or results (nested in containers, in any direction);
    the owner keeps the value alive while any RRef to it exists anywhere.
    An RRef cannot be pickled, and cannot be used after its agent shut down.
    """

    __module__ = "rpcdist"
    __slots__ = (
        "__weakref__",
        "_attrs",
        "_confirmed",
        "_creator",
        "_ctx",
        "_early",
        "_error",
        "_fork",
        "_owner",
        "_plain",
        "_record",
        "_rid",
        "_state",
        "_type",
    )

    def __init__(self, value: T) -> None:
        """Make a local owner RRef of ``value``.

        Raises:
            NotInitializedError: no agent runs in this process.
        """
        ctx = context_of(current_agent())
        ctx.check_open("RRef()")
        rid = ctx.ids.new()
        self._set(ctx, rid, None, ctx.agent.rank, ctx.owners.local(rid, value), CONFIRMED)

    def _set(
        self,
        ctx: RRefContext,
        rid: tuple[int, int],
        fork: tuple[int, int] | None,
        owner: int,
        record: Record | None,
        state: int,
    ) -> None:
        self._ctx = ctx
        self._rid = rid
        self._fork = fork  # None on the owner
        self._owner = owner
        self._record = record  # the owner's slot; None on users
        self._state = state
        self._error: BaseException | None = None
        self._confirmed: Future[None] | None = Future() if state == PENDING else None
        # Made by remote() here, whose reply confirms it: its deadline (inf: none).
        self._creator: float | None = None
        self._early: list[Any] | None = None  # a copy of the value, while that reply settles
        self._attrs: set[str] | None = None  # attributes known to exist (remote() proxies)
        self._plain: set[str] | None = None  # methods known to be plain functions
        self._type: Future[Any] | None = None  # the value's class, once asked (_get_type)

    @classmethod
    def _make(
        cls,
        ctx: RRefContext,
        rid: tuple[int, int],
        fork: tuple[int, int] | None,
        owner: int,
        record: Record | None,
        state: int,
    ) -> RRef[Any]:
        self: RRef[Any] = cls.__new__(cls)
        self._set(ctx, rid, fork, owner, record, state)
        return self

    def __del__(self) -> None:
        try:
            state = self._state
            if (
                self._fork is not None
                and state in (CONFIRMED, FAILED_DELETE, FAILED_ABANDON)
                and not self._ctx.agent.closed
            ):
                item = [*self._rid, *self._fork, int(state == FAILED_ABANDON)]
                self._ctx.post(self._owner, USER_DELETE, item)
        except Exception:  # never raise from a finaliser (or during interpreter exit)
            pass

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RRefError(
            f"Can not pickle rref in python pickler: {self!r} cannot be pickled or copied: "
            "an RRef can only be sent as an argument "
            "or result of an RPC (rpc_sync, rpc_async, remote)"
        )

    def __str__(self) -> str:
        """torch's form: ``OwnerRRef(GloballyUniqueId(created_on=0, local_id=0))``,
        ``UserRRef(RRefId = ..., ForkId = ...)``."""
        try:
            if self._fork is None:
                return f"OwnerRRef({_gid(self._rid)})"
            return f"UserRRef(RRefId = {_gid(self._rid)}, ForkId = {_gid(self._fork)})"
        except Exception:
            return "RRef(<uninitialised>)"

    def __repr__(self) -> str:
        try:
            where = "owner" if self._fork is None else f"fork={self._fork}"
            pending = ", unconfirmed" if self._state == PENDING else ""
            return f"RRef(owner={self.owner_name()!r}, id={self._rid}, {where}{pending})"
        except Exception:
            return "RRef(<uninitialised>)"

    # ------------------------------------------------------------- queries

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._record is not None

    def owner(self) -> WorkerInfo:
        """The owner's :class:`WorkerInfo`."""
        return self._ctx.worker(self._owner)

    def owner_name(self) -> str:
        """The owner's worker name."""
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this RRef (always true on the owner)."""
        return self._record is not None or self._state == CONFIRMED

    def _check(self, what: str) -> None:
        ctx = self._ctx
        if ctx.closed or ctx.agent.closed:  # (torch's words first: programs match them)
            ctx.check_open(f"Cannot call {what} on it after deletion. {what} on {self!r}")
        if self._error is not None:
            raise self._error
        if self._state == RELEASED:
            raise ClosedError(f"{what} on {self!r}: it was released by rpcdist.shutdown()")

    # -------------------------------------------------------------- values

    def local_value(self) -> T:
        """The value itself; only on the owner.

        Raises:
            RRefError: this is a user RRef (the message names this worker and the owner).
            RpcTimeoutError: the value, still being created, did not appear within
                the agent's default timeout.
            Exception: what the function creating the value raised.
        """
        self._check("local_value()")
        rec = self._record
        if rec is None:
            me, owner = self._ctx.agent.info, self.owner()
            raise RRefError(  # (torch's words first: programs match them)
                f"For UserRRef(rref_id={_gid(self._rid)}, fork_id={_gid(self._fork)}), "
                f"can't call localValue() on user WorkerInfo(id={me.id}, name={me.name}). "
                f"Call it on owner WorkerInfo(id={owner.id}, name={owner.name}): "
                f"local_value() called on a user RRef on worker {self._ctx.agent.name!r}: "
                f"the value lives on its owner {self.owner_name()!r}; use to_here() or "
                "rref.rpc_sync().method()"
            )
        if not rec.ready.done():
            agent = self._ctx.agent
            agent.check_not_loop_thread("RRef.local_value() before its value exists")
            try:
                rec.ready.wait(agent.rpc_timeout)
            except RpcTimeoutError:
                info = agent.debug_info()
                raise RpcTimeoutError(
                    f"local_value() on {self!r}: the value was not created within "
                    f"{agent.rpc_timeout} s; {summary(info)}",
                    snapshot=info,
                ) from None
        return rec.get()  # type: ignore[no-any-return]

    def to_here(self, timeout: float | Unset | None = UNSET) -> T:
        """A copy of the value (on the owner: the value itself), blocking.

        Raises:
            RpcTimeoutError: no value within ``timeout`` (default: the agent's).
            OwnerLostError: the owner is gone.
            RRefCreationError: the ``remote()`` that was to create it failed.
            ClosedError: the agent has shut down.
            WrongThreadError: called on the agent's loop thread (use ``to_here_async``).
            Exception: what the function creating the value raised (same type).
        """
        self._ctx.agent.check_not_loop_thread("RRef.to_here()")
        return self.to_here_async(timeout).wait()

    def to_here_async(self, timeout: float | Unset | None = UNSET) -> Future[T]:
        """Like :meth:`to_here`, returning a Future (``await`` it on any loop).

        Raises:
            OwnerLostError, RRefCreationError, ClosedError: as for :meth:`to_here`.
        """
        self._check("to_here()")
        rec = self._record
        deadline = deadline_for(timeout, self._ctx.agent.rpc_timeout)
        if rec is None:
            confirmed = self._confirmed
            if self._creator is not None and confirmed is not None and not confirmed.done():
                return to_here_after_creation(self, deadline, "to_here()")
            return call_owner(self, FETCH, [*self._rid], deadline, "to_here()")
        out: Future[T] = Future()
        if rec.ready.done():
            try:
                out.set_result(rec.get())
            except BaseException as e:
                out.set_exception(e)
            return out
        waited = self._ctx.bounded(rec.ready, deadline, f"to_here() on {self!r}")
        return waited.then(lambda f: (f.value(), rec.get())[1])

    def backward(self, context_id: int = -1, retain_graph: bool = False) -> None:
        """Run ``rpcdist.autograd.backward(context_id, [value])`` on the owner,
        for an RRef to a scalar loss computed in that context (blocking); a
        torch loss takes ``rpcdist.torch.autograd.backward``.

        Without ``context_id`` (``-1``, as in torch) the owner's own RRef runs
        a local pass, ``value.backward(retain_graph=...)``, into ``.grad``;
        another worker's RRef needs the context id.

        Raises:
            AutogradError: the owner has no such context, the pass failed, or
                no context id for another worker's RRef.
            ConfigError: the value is not a scalar tensor that requires grad.
            OwnerLostError: the owner is gone.
            WrongThreadError: called on the agent's loop thread.
        """
        if context_id == -1:
            self._local_backward(retain_graph)
            return
        self._check("backward()")
        agent = self._ctx.agent
        agent.check_not_loop_thread("RRef.backward()")
        deadline = deadline_for(UNSET, agent.rpc_timeout)
        payload = [self, context_id, retain_graph]
        call_owner(self, _RREF_BACKWARD, payload, deadline, "backward()").wait()

    def _local_backward(self, retain_graph: bool) -> None:
        if not self.is_owner():
            raise AutogradError(
                "User RRefs require 'dist_autograd_ctx_id' to be specified (this RRef's value "
                f"is on {self.owner().name!r}: pass the distributed autograd context id)"
            )
        value: Any = self.local_value()
        if not callable(getattr(value, "backward", None)):
            raise ConfigError(
                f"RRef should contain a tensor for .backward(), got a {type(value).__name__}"
            )
        value.backward(retain_graph=retain_graph)

    def _get_type(self, timeout: float | Unset | None = UNSET, blocking: bool = True) -> Any:
        """The value's class (torch's ``RRef._get_type``), asked of the owner
        once and then remembered; ``blocking=False``: a Future of it, the
        same Future on every call (as torch's). ``timeout`` as for
        :meth:`to_here` (torch's ``-1`` too: the default); a failed ask is
        not remembered.

        Raises:
            SerializationError: the class has no name to travel by (it was
                defined inside a function).
            OwnerLostError, RpcTimeoutError, RRefCreationError: as for :meth:`to_here`.
        """
        if timeout == -1:
            timeout = UNSET
        fut = self._type
        if fut is None:
            if self._record is not None:
                fut = Future()
                try:
                    fut.set_result(type(self.local_value()))
                except BaseException as e:
                    fut.set_exception(e)
            else:
                self._check("_get_type()")
                fut = self._typeof_owner(timeout)
            self._type = fut
            fut.add_done_callback(functools.partial(_forget_failed_type, self))
        return fut.wait() if blocking else fut

    def _typeof_owner(self, timeout: float | Unset | None) -> Future[Any]:
        """Ask the owner for the value's class (``rpcdist.torch`` profiles
        this call under torch's name for it)."""
        return self._ctx.agent.rpc_async(
            self.owner(), _rref_typeof_on_owner, (self,), None, timeout
        )

    # ------------------------------------------------------------- proxies

    def rpc_sync(self, timeout: float | Unset | None = UNSET) -> Any:
        """A proxy: ``rref.rpc_sync().m(*a)`` runs ``value.m(*a)`` on the owner, blocking."""
        return RRefProxy(self, "sync", timeout)

    def rpc_async(self, timeout: float | Unset | None = UNSET) -> Any:
        """A proxy whose method calls return Futures."""
        return RRefProxy(self, "async", timeout)

    def remote(self, timeout: float | Unset | None = UNSET) -> Any:
        """A proxy whose method calls return RRefs of their results (on the same owner).

        A method the value lacks raises ``AttributeError`` at the call.
        """
        return RRefProxy(self, "remote", timeout)

    def _invoke(
        self,
        name: str,
        args: Any,
        kwargs: Any,
        timeout: float | Unset | None,
        blocking: bool = False,
    ) -> Future[Any]:
        self._check(f"proxy call {name}()")
        deadline = deadline_for(timeout, self._ctx.agent.rpc_timeout)
        what = f"{name}()"
        if self._plain is not None and name in self._plain:  # the pool fast path
            call: Any = ((*self._rid, name, list(args), kwargs), {})
            return call_owner(
                self, CALL_METHOD, call, deadline, what, args, kwargs, False, blocking=blocking
            )
        payload = [*self._rid, name, list(args), kwargs]
        reply = call_owner(self, INVOKE, payload, deadline, what, args, kwargs, blocking=blocking)
        return reply.then(functools.partial(_invoked, self, name))

    def _start_invoke(
        self, name: str, args: Any, kwargs: Any, timeout: float | Unset | None
    ) -> Any:
        """``rpc_sync()``'s call of method ``name``, split: it leaves now, and
        ``wait()`` on what this returns reads its value here (the caller
        works meanwhile; give it up with ``_started.abandon``). A method
        not yet known to be plain takes :meth:`_invoke`'s path."""
        if self._plain is None or name not in self._plain:
            return self._invoke(name, args, kwargs, timeout)
        self._check(f"proxy call {name}()")
        deadline = deadline_for(timeout, self._ctx.agent.rpc_timeout)
        call: Any = ((*self._rid, name, list(args), kwargs), {})
        return start_owner_call(self, CALL_METHOD, call, deadline, f"{name}()", args, kwargs, False)

    def _remote_method(
        self, name: str, args: Any, kwargs: Any, timeout: float | Unset | None
    ) -> RRef[Any]:
        self._check(f"rref.remote().{name}()")
        self._check_attr(name, timeout)
        target = [*self._rid, name]
        return create(
            RRef._make, self._ctx, self.owner(), target, args, kwargs, timeout, f"{name}()", self
        )

    def _check_attr(self, name: str, timeout: float | Unset | None) -> None:
        """Raise AttributeError now if the value lacks ``name`` (blocking, cached)."""
        if self._attrs is not None and name in self._attrs:
            return
        try:
            self._ctx.agent.check_not_loop_thread("")
        except WrongThreadError:
            return  # cannot wait here; a missing method surfaces from to_here()
        if self._record is not None:
            value = self.local_value()
            missing = "" if has_attr(value, name) else type(value).__qualname__
        else:
            payload = [*self._rid, name]
            deadline = deadline_for(timeout, self._ctx.agent.rpc_timeout)
            missing = call_owner(self, HAS_ATTR, payload, deadline, f"{name}()").wait()
        if missing:
            raise AttributeError(
                f"'{missing}' object has no attribute '{name}' "
                f"(the value of {self!r} on {self.owner_name()!r})"
            )
        self._attrs = (self._attrs or set()) | {name}


def _gid(rid: Any) -> str:
    """An RRefId or ForkId as torch prints it."""
    return f"GloballyUniqueId(created_on={rid[0]}, local_id={rid[1]})"


def _invoked(rref: RRef[Any], name: str, reply: Future[list[Any]]) -> Any:
    plain, result = reply.value()
    if plain:  # later calls of this method take the pool fast path
        rref._plain = (rref._plain or set()) | {name}
    return result


def remote(
    to: str | int | WorkerInfo,
    func: Any,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | Unset | None = UNSET,
) -> RRef[Any]:
    """Run ``func(*args, **kwargs)`` on ``to`` and return an RRef to its result at once.

    The value is created and owned on ``to``. If ``func`` raises, the error
    is kept there and raised by every ``to_here()`` and proxy call; if the
    call times out, later use raises :class:`RRefCreationError`.

    Raises:
        NotInitializedError: no agent is running.
        ConfigError: unknown worker or bad arguments.
        SerializationError: ``func`` or an argument cannot be sent.
        OwnerLostError: ``to`` is known to be gone.
    """
    agent = current_agent()
    name = agent.function_name(func)
    ctx = context_of(agent)
    what = f"{name}()"
    return create(
        RRef._make, ctx, agent.worker(to), name, args, kwargs, timeout, what, None, is_plain(func)
    )


# -------------------------------------------------------------------- the codec


def _encode_rref(rref: RRef[Any], wctx: Any) -> list[int]:
    if not isinstance(wctx, WireContext):
        raise RRefError(
            f"{rref!r} can only be sent as an argument or result of an RPC (rpc_sync, "
            "rpc_async, remote); it cannot be serialised on its own"
        )
    ctx = rref._ctx
    if wctx.agent is not ctx.agent:
        raise RRefError(
            f"{rref!r} belongs to worker {ctx.agent.name!r} but is being sent by "
            f"{wctx.agent.name!r}"
        )
    r0, r1 = rref._rid
    if wctx.extra.get("aborted"):
        return [rref._owner, r0, r1, 0]  # a dry run: the message is not sent
    rref._check("sending an RRef")
    child = ctx.ids.new()
    if rref._record is not None:  # the owner registers the child at once
        ctx.owners.add_fork(rref._record, child, wctx.peer.id)
        undo: Any = functools.partial(ctx.owners.remove_fork, rref._rid, child)
    else:  # a user holds its RRef until the owner confirms the child (G2)
        ctx.users.add_child(child, rref)
        undo = functools.partial(ctx.users.accept_child, child)
    wctx.extra.setdefault("undo", []).append(undo)
    return [rref._owner, r0, r1, child[1]]


def _decode_rref(desc: Any, wctx: Any) -> RRef[Any]:
    if not isinstance(wctx, WireContext):  # bad input for the codec: SerializationError
        raise SerializationError("an RRef can only be received as part of an RPC")
    owner, r0, r1, c = desc
    agent = wctx.agent
    ctx = context_of(agent)
    rid = (r0, r1)
    sender = wctx.peer.id
    child = (sender, c)
    if owner == agent.rank:  # back at its owner: the value itself
        rec = ctx.owners.record(rid)
        rref = RRef._make(ctx, rid, None, owner, rec, CONFIRMED)
        if sender == owner:
            ctx.owners.remove_fork(rid, child)  # a fork only while in transit
        elif wctx.reply_meta is not None:  # a call's argument: its reply says so
            _accept_in_reply(ctx, wctx, c)
        else:
            ctx.post(sender, CHILD_ACCEPT, [c])
        if not rec.ready.done():
            _gate(wctx, rec.ready)
        return rref
    if sender == owner:  # the owner registered the fork before sending it
        rref = RRef._make(ctx, rid, child, owner, None, CONFIRMED)
        ctx.users.add_confirmed(child, rref)
        return rref
    rref = RRef._make(ctx, rid, child, owner, None, PENDING)
    ctx.users.add_pending(child, rref, sender)
    ctx.post(owner, FORK_REQUEST, [r0, r1, sender, c])
    assert rref._confirmed is not None
    _gate(wctx, rref._confirmed)
    return rref


def _accept_in_reply(ctx: RRefContext, wctx: WireContext, child: int) -> None:
    """Confirm the sender's fork ``child`` in the reply to the call being
    decoded (its field ``ACCEPTS``) instead of a control message of its own;
    if that reply is never sent, the confirmation goes as a control message."""
    assert wctx.reply_meta is not None
    accepts = wctx.reply_meta.get(ACCEPTS)
    if accepts is None:
        accepts = wctx.reply_meta[ACCEPTS] = []
        # (not ``wctx`` itself: the undo list is its own, and a cycle would
        # outlive the call until the garbage collector ran)
        undo = functools.partial(_post_accepts, ctx, wctx.reply_meta, wctx.peer.id)
        wctx.extra.setdefault("undo", []).append(undo)
    assert isinstance(accepts, list)
    accepts.append(child)


def _post_accepts(ctx: RRefContext, reply_meta: dict[str, Any], peer: int) -> None:
    accepts = reply_meta.pop(ACCEPTS, None)
    assert accepts is None or isinstance(accepts, list)
    for child in accepts or ():
        ctx.post(peer, CHILD_ACCEPT, [child])


def accepts_in_reply(agent: Agent, src: WorkerInfo, children: Any) -> None:
    """The ``ACCEPTS`` field of a reply from ``src``, the owner: it confirmed
    these forks this worker sent it (any thread)."""
    if isinstance(children, list):  # (else malformed: nothing to settle)
        accept_children(agent, [c for c in children if type(c) is int])


def _gate(wctx: WireContext, fut: Future[Any]) -> None:
    """A received call must not run before ``fut`` completes (a confirmation)."""
    wctx.gates.append(fut if wctx.off_loop else gate(wctx.agent, fut))


register_extension(RRef, RREF_CODE, _encode_rref, _decode_rref)


def _rref_typeof_on_owner(rref: RRef[Any]) -> type:
    """The class of ``rref``'s value (run on its owner, for ``RRef._get_type``;
    torch's name for it, which its profiler shows)."""
    return type(rref.local_value())


def _forget_failed_type(rref: RRef[Any], fut: Future[Any]) -> None:
    if fut.exception() is not None and rref._type is fut:
        rref._type = None
