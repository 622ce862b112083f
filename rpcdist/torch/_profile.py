"""RPC calls under torch's legacy profiler, as PyTorch RPC records them.

Under ``torch.autograd.profiler_legacy.profile()`` (PyTorch's RPC profiling
works with the legacy profiler only; under ``torch.profiler`` no RPC range
is recorded, as in PyTorch), each ``rpc_sync``/``rpc_async``/``remote`` is a
range named ``rpc_async#qualname(caller -> callee)`` (a builtin operator by
its ``aten::`` name), ending when the call completes, and the callee
profiles the function it runs with the caller's settings (shapes, memory):
its events come back with the reply and join the caller's profile as
remote events, named ``<range>#remote_op: <event>``, with the callee's rank
as ``node_id`` (nested calls nest the prefixes). The request and the events
travel in the call's and reply's metadata (``_profile_ext``); with no
profiler running, a call pays one check.

Where PyTorch's behaviour is not reproduced: an ``async def`` function
(run on rpcdist's event loop, which serves every call) sends back no
events; an ``@async_execution`` function sends
its body's events (it runs on a pool thread) and its calls', not those of
the callbacks that complete its Future later; and a call made inside a
profiled function through rpcdist's own API (not ``rpcdist.torch.rpc``)
ends that function's profile early.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.autograd.profiler_legacy
import torch.autograd.profiler_util

from .._errors import RpcdistError
from .._futures import Future
from .._rpc._context import current_agent
from .._rref._rref import RRef
from .._worker import WorkerInfo
from ._profile_ext import NAME, REPLY, REQUEST, ProfileExtension
from ._profile_ext import install as _install_ext

if TYPE_CHECKING:
    from .._rpc._agent import Agent
    from .._rpc._registry import CallInfo
    from .._transport._frames import Meta

__all__ = [
    "after",
    "enabled",
    "install",
    "keep_profiling_future",
    "profiled",
    "profiling_future",
    "serving",
    "set_node_id",
]

T = TypeVar("T")

#: What the current thread's or task's next call or reply carries.
_STATE: contextvars.ContextVar[_Request | _Serving | _Deferred | None] = contextvars.ContextVar(
    "rpcdist_torch_profile", default=None
)
_lock = threading.Lock()
_tokens = itertools.count(1)
#: token -> the call it was sent with, until its reply (or failure) arrives.
_pending: dict[int, _Pending] = {}
#: thread id -> remote events received for the legacy profile running there.
_sessions: dict[int, _Session] = {}
#: thread id -> (record_shapes, profile_memory) of the legacy profile running there.
_configs: dict[int, tuple[bool, bool]] = {}
#: remote()'s RRefs -> when their range has ended (``RRef._get_profiling_future``).
_rref_futures: weakref.WeakKeyDictionary[Any, torch.futures.Future[None]] = (
    weakref.WeakKeyDictionary()
)
_REMOTE_OP = "#remote_op: "
#: torch's (untyped) legacy profiler module and event class.
_legacy: Any = torch.autograd.profiler_legacy
_FunctionEvent: Any = torch.autograd.profiler_util.FunctionEvent
_builtins: Any = torch.jit._builtins
_LEGACY = torch._C._profiler.ActiveProfilerType.LEGACY


def enabled() -> bool:
    """Whether torch's legacy profiler is recording on this thread."""
    return bool(
        torch.autograd._profiler_enabled()  # type: ignore[attr-defined]
        and torch._C._autograd._profiler_type() == _LEGACY  # type: ignore[attr-defined]
    )


# --------------------------------------------------------------- caller


class _Session:
    """Remote events received for one thread's legacy profile."""

    __slots__ = ("batches", "closed")

    def __init__(self) -> None:
        self.batches: list[tuple[str, float, int, list[Any]]] = []
        self.closed = False


class _Pending:
    __slots__ = ("anchor", "arrived", "key", "session")

    def __init__(self, session: _Session, key: str, anchor: float) -> None:
        self.session, self.key, self.anchor = session, key, anchor
        #: Completed when the reply's events arrive (for a call nothing else waits on).
        self.arrived: Future[None] | None = None


class _Request:
    """The caller's ask, in the context while its call is encoded."""

    __slots__ = ("meta_fields",)

    def __init__(self, token: int, shapes: bool, memory: bool) -> None:
        self.meta_fields: Meta = {REQUEST: [token, shapes, memory]}

    def meta(self) -> Meta | None:
        return self.meta_fields


def _source() -> Meta | None:
    state = _STATE.get()
    return None if state is None else state.meta()


def _on_reply(agent: Agent, src: WorkerInfo, value: Any) -> None:
    """A reply brought the callee's events (any thread, before it completes the call)."""
    token, rows = value
    with _lock:
        pending = _pending.pop(token, None)
        if pending is None:
            return
        if not pending.session.closed:
            pending.session.batches.append((pending.key, pending.anchor, src.id, rows))
    if pending.arrived is not None and not pending.arrived.done():
        pending.arrived.set_result(None)


def _arrival(token: int, failed: Future[Any] | None) -> Future[None] | None:
    """A Future completed when call ``token``'s events arrive (``None``: they
    have), or when ``failed`` fails (then none will)."""
    arrived: Future[None] = Future()
    with _lock:
        pending = _pending.get(token)
        if pending is None:
            return None
        pending.arrived = arrived

    def check(f: Future[Any]) -> None:
        if f.exception() is not None and not arrived.done():
            arrived.set_result(None)

    if failed is not None:
        failed.add_done_callback(check)
    return arrived


def _func_name(func: Any) -> str:
    """PyTorch's name for ``func`` in a range: an operator's ``aten::`` name,
    else its ``__qualname__``."""
    try:
        builtin = _builtins._find_builtin(func)
    except Exception:  # (unhashable callables)
        builtin = None
    if builtin is not None:
        return str(builtin)
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or func)


def _extension(agent: Agent) -> ProfileExtension:
    ext = agent.registry.extensions.get(NAME)
    if not isinstance(ext, ProfileExtension):
        ext = _install_ext(agent, serving)
    ext.activate(_source, _on_reply)
    return ext


def profiled(
    kind: str,
    to: str | int | WorkerInfo,
    func: Any,
    call: Callable[[], T],
    until: Callable[[T], Future[Any] | None] | None = None,
) -> tuple[T, torch.futures.Future[None] | None]:
    """``call()`` inside a profiler range named for ``kind``, ``func`` and the
    workers, asking the callee for its events.

    Returns ``call()``'s result and, with ``until``, a torch Future completed
    once the range has ended: when the Future ``until(result)`` gives
    completes (at once when it gives ``None``).
    """
    agent = current_agent()
    try:
        dst = agent.worker(to).name
    except RpcdistError:  # the call itself says why it cannot be sent
        dst = str(to)
    key = f"{kind}#{_func_name(func)}({agent.name} -> {dst})"
    _extension(agent)
    ident = threading.get_ident()
    shapes, memory = _configs.get(ident, (False, False))
    token = next(_tokens)
    deferred = _STATE.get()
    with torch.autograd.profiler.record_function(key) as rf:
        start = time.time_ns() / 1000  # (after the range's start: the callee's events follow it)
        with _lock:
            if isinstance(deferred, _Deferred):  # (made by a profiled async_execution body)
                session = deferred.session
            else:
                session = _sessions.setdefault(ident, _Session())
                deferred = None
            _pending[token] = _Pending(session, key, start)
        reset = _STATE.set(_Request(token, shapes, memory))
        try:
            out = call()
        except BaseException:
            _forget(token)
            raise
        finally:
            _STATE.reset(reset)
        fut = None if until is None else until(out)
        if fut is None and isinstance(out, RRef):  # (made here: its reply brings the events)
            fut = _arrival(token, out.to_here_async())
        if fut is None:
            _forget(token)
            if until is None:
                return out, None
            done: torch.futures.Future[None] = torch.futures.Future()
            done.set_result(None)
            return out, done
        end: torch.futures.Future[None] = torch.futures.Future()

        def ended(_: Future[Any]) -> None:
            _forget(token)
            if deferred is not None:  # (its range's end is recorded past the body's profile)
                with _lock:
                    deferred.calls.append((key, start, time.time_ns() / 1000, ident))
            end.set_result(None)

        profiling = rf._call_end_callbacks_on_future(end)
        fut.add_done_callback(ended)
    return out, profiling


def _forget(token: int) -> None:
    with _lock:
        _pending.pop(token, None)


def after(fut: Future[Any], profiling: torch.futures.Future[None]) -> Future[Any]:
    """A Future completed as ``fut`` once ``profiling`` (the range's end) has."""
    out: Future[Any] = Future()
    profiling.add_done_callback(lambda _: _copy(fut, out))
    return out


def _copy(fut: Future[Any], out: Any) -> None:
    """Complete ``out`` (an rpcdist or torch Future) as completed ``fut``."""
    exc = fut.exception()
    if exc is not None:
        out.set_exception(exc)
    else:
        out.set_result(fut.value())


def keep_profiling_future(rref: RRef[Any], profiling: torch.futures.Future[None]) -> None:
    _rref_futures[rref] = profiling


def profiling_future(rref: RRef[Any]) -> torch.futures.Future[None]:
    """``RRef._get_profiling_future()``: completed once ``remote()``'s range
    has ended and the owner's events joined the profile.

    Raises:
        RuntimeError: the RRef was not made by a profiled ``remote()``.
    """
    fut = _rref_futures.get(rref)
    if fut is None:
        raise RuntimeError("this RRef was not created by remote() under the profiler")
    return fut


# --------------------------------------------------------------- callee


class _Serving:
    """The legacy profile of one incoming call, on the thread running it."""

    __slots__ = ("agent", "prof", "reset", "rows", "token")

    def __init__(self, agent: Agent, token: int, prof: Any) -> None:
        self.agent, self.token, self.prof = agent, token, prof
        self.rows: list[Any] | None = None
        self.reset: contextvars.Token[Any] | None = None

    def meta(self) -> Meta | None:
        """The reply's events (the function has returned: its reply is encoded)."""
        if self.rows is None:
            self.rows = self._finish()
        return {REPLY: [self.token, self.rows]}

    def _finish(self) -> list[Any]:
        if self.prof is None:
            return []
        self.prof.__exit__(None, None, None)
        return _rows(self.prof, self.agent.rank)

    def __enter__(self) -> _Serving:
        if self.prof is not None:
            self.prof.__enter__()
        self.reset = _STATE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.rows is None:  # (failed: no reply carries them)
            self.rows = []
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
        if self.reset is not None:
            _STATE.reset(self.reset)


def _rows(prof: Any, rank: int) -> list[Any]:
    """A finished profile's events as a reply carries them."""
    rows = []
    for e in prof.function_events or ():
        r = e.time_range
        # (the serving agent's rank for its own events: the profiler's node id
        # is process-wide, and a process may hold more than one agent)
        node = e.node_id if e.is_remote and e.node_id >= 0 else rank
        shapes = [list(s) for s in e.input_shapes] if e.input_shapes else []
        mem, seq = e.cpu_memory_usage, e.sequence_nr
        rows.append([e.name, r.start, r.end, e.thread, node, shapes, mem, seq, bool(e.is_async)])
    return rows


class _Deferred:
    """The profile of an incoming call handled on the event loop (an
    ``@async_execution`` function, ``remote`` of one): the body of
    ``rpcdist.torch``'s ``async_execution`` function, profiled on the pool
    thread that runs it (:meth:`run`), and the calls it made, gathered as
    they complete, until the reply leaves."""

    __slots__ = ("agent", "calls", "memory", "reset", "rows", "session", "shapes", "t0", "token")

    def __init__(self, agent: Agent, token: int, shapes: bool, memory: bool) -> None:
        self.agent, self.token, self.shapes, self.memory = agent, token, shapes, memory
        self.session = _Session()
        self.rows: list[Any] = []
        #: (range name, start, end, thread) of each profiled call the body made.
        self.calls: list[tuple[str, float, float, int]] = []
        self.t0 = time.time_ns() / 1000
        self.reset: contextvars.Token[Any] | None = None

    def run(self, body: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``body(*args, **kwargs)`` under a legacy profile of this thread."""
        if torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
            return body(*args, **kwargs)
        prof = _legacy.profile(record_shapes=self.shapes, profile_memory=self.memory)
        self.t0 = time.time_ns() / 1000
        prof.__enter__()
        try:
            return body(*args, **kwargs)
        finally:
            prof.__exit__(None, None, None)
            self.rows = _rows(prof, self.agent.rank)

    def meta(self) -> Meta | None:
        """The reply's events: the body's, its calls' ranges and what their
        callees sent back, relative to the body's start."""
        rank, t0 = self.agent.rank, self.t0
        rows = list(self.rows)
        with _lock:
            calls, batches = list(self.calls), list(self.session.batches)
        for key, start, end, thread in calls:
            rows.append([key, start - t0, end - t0, thread, rank, [], 0, -1, False])
        for key, anchor, node, batch in batches:
            base = min((r[1] for r in batch), default=0.0)
            at = anchor - t0
            for name, s, e, thread, row_node, *rest in batch:
                full = f"{key}{_REMOTE_OP}{name}"
                rows.append([full, at + s - base, at + e - base, thread, row_node, *rest])
                if row_node < 0:
                    rows[-1][4] = node
        return {REPLY: [self.token, rows]}

    def __enter__(self) -> _Deferred:
        self.reset = _STATE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            self.session.closed = True
        if self.reset is not None:
            _STATE.reset(self.reset)


def run_async_body(body: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``rpcdist.torch``'s ``async_execution`` body: profiled when its call asked."""
    state = _STATE.get()
    if isinstance(state, _Deferred):
        return state.run(body, args, kwargs)
    return body(*args, **kwargs)


def serving(ext: ProfileExtension, call: CallInfo, request: Any) -> _Serving | _Deferred | None:
    """The handler scope for a call that asks for the callee's events: a
    legacy profile around its function, on the thread running it; on the
    event loop (the function runs elsewhere), a :class:`_Deferred`; where a
    profile already runs on this thread, one that answers with no events."""
    token, shapes, memory = request
    if asyncio._get_running_loop() is not None:
        ext.activate(_source, _on_reply)
        return _Deferred(call.agent, int(token), bool(shapes), bool(memory))
    ext.activate(_source, _on_reply)
    if torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        return _Serving(call.agent, int(token), None)  # (answers with no events)
    prof = _legacy.profile(record_shapes=bool(shapes), profile_memory=bool(memory))
    return _Serving(call.agent, int(token), prof)


# --------------------------------------------------------------- torch's profiler


def _remote_events(session: _Session, records: Any, local: list[Any]) -> list[Any]:
    """The session's remote events as FunctionEvents of the profile whose
    ``records`` are parsed (times relative to its start)."""
    start = next(
        (r.start_us() for rs in records for r in rs if r.name() == "__start_profile"), None
    )
    if start is None:
        return []
    starts: dict[str, list[float]] = {}
    for e in local:
        starts.setdefault(e.name, []).append(e.time_range.start)
    events: list[Any] = []
    for key, anchor, node, rows in session.batches:
        at = anchor - start
        ranges = starts.get(key)
        if ranges:  # (just after its range's start, whatever the clocks say)
            at = max(at, min(ranges, key=lambda s: abs(s - at)) + 1)
        base = min((row[1] for row in rows), default=0.0)
        for name, s, e, thread, row_node, shapes, mem, seq, is_async in rows:
            full = f"{key}{_REMOTE_OP}{name}"
            events.append(
                _FunctionEvent(
                    id=-len(events) - 1,
                    name=full,
                    trace_name=full,
                    thread=thread,
                    start_us=at + s - base,
                    end_us=at + e - base,
                    input_shapes=shapes,
                    cpu_memory_usage=mem,
                    is_async=is_async,
                    is_remote=True,
                    sequence_nr=seq,
                    node_id=row_node if row_node >= 0 else node,
                    is_legacy=True,
                )
            )
    return events


_parse: Any = _legacy._parse_legacy_records
_start_trace: Any = _legacy.profile._start_trace


def _parse_with_remote(records: Any) -> list[Any]:
    functions: list[Any] = _parse(records)
    ident = threading.get_ident()
    with _lock:
        _configs.pop(ident, None)
        session = _sessions.pop(ident, None)
        if session is not None:
            session.closed = True
    if session is not None and session.batches:
        functions.extend(_remote_events(session, records, functions))
        functions.sort(key=lambda e: [e.time_range.start, -e.time_range.end])
    return functions


def _start_trace_noting_config(self: Any) -> None:
    _configs[threading.get_ident()] = (bool(self.record_shapes), bool(self.profile_memory))
    _start_trace(self)


_end_on_future: Any = torch.autograd.profiler.record_function._call_end_callbacks_on_future


def _end_on_any_future(self: Any, fut: Any) -> Any:
    """``record_function._call_end_callbacks_on_future`` taking an rpcdist
    Future too (what ``rpc_async`` returns), as PyTorch programs pass it."""
    if isinstance(fut, Future):
        fut = _as_torch_future(fut)
    return _end_on_future(self, fut)


def _as_torch_future(fut: Future[Any]) -> torch.futures.Future[Any]:
    out: torch.futures.Future[Any] = torch.futures.Future()
    fut.add_done_callback(lambda f: _copy(f, out))
    return out


def _rref_profiling_future(self: Any) -> torch.futures.Future[None]:
    return profiling_future(self)


def set_node_id(rank: int) -> None:
    """Mark this process's profiler events with its rank, as PyTorch's
    ``init_rpc`` does (where torch's build has its RPC module)."""
    setter = getattr(getattr(torch._C, "_distributed_rpc", None), "_set_profiler_node_id", None)
    if setter is not None:
        setter(rank)


def install() -> None:
    """Let torch's legacy profiler take in remote events and
    ``record_function`` end on rpcdist Futures, and give RRefs
    ``_get_profiling_future`` (idempotent)."""
    from .._rref._rref import RRef

    _legacy._parse_legacy_records = _parse_with_remote
    _legacy.profile._start_trace = _start_trace_noting_config
    record_function: Any = torch.autograd.profiler.record_function
    record_function._call_end_callbacks_on_future = _end_on_any_future
    RRef._get_profiling_future = _rref_profiling_future  # type: ignore[attr-defined]
    if not hasattr(_typeof_owner, "plain"):
        _typeof_owner.plain = RRef._typeof_owner  # type: ignore[attr-defined]
        RRef._typeof_owner = _typeof_owner  # type: ignore[method-assign,assignment]


def _typeof_owner(rref: RRef[Any], timeout: Any) -> Future[Any]:
    """``RRef._get_type``'s ask of the owner, profiled as torch's
    (``rpc_async#_rref_typeof_on_owner(caller -> owner)``)."""
    plain: Any = _typeof_owner.plain  # type: ignore[attr-defined]
    if not enabled():
        return plain(rref, timeout)  # type: ignore[no-any-return]
    from .._rref._rref import _rref_typeof_on_owner

    call = functools.partial(plain, rref, timeout)
    fut, profiling = profiled("rpc_async", rref.owner(), _rref_typeof_on_owner, call, _same)
    assert profiling is not None
    return after(fut, profiling)


def _same(fut: Future[Any]) -> Future[Any]:
    return fut
