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

Where PyTorch's behaviour is not reproduced: the callee profiles a function
run on a pool thread (plain functions, ``remote`` of one); an ``async def``
or ``@async_execution`` function (which rpcdist runs on its event loop or
across threads) sends no events back. A call made inside a profiled
function through rpcdist's own API (not ``rpcdist.torch.rpc``) ends that
function's profile early.
"""

from __future__ import annotations

import asyncio
import contextvars
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
from .._worker import WorkerInfo
from ._profile_ext import NAME, REPLY, REQUEST, ProfileExtension
from ._profile_ext import install as _install_ext

if TYPE_CHECKING:
    from .._rpc._agent import Agent
    from .._rpc._registry import CallInfo
    from .._rref._rref import RRef
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
_STATE: contextvars.ContextVar[_Request | _Serving | None] = contextvars.ContextVar(
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
    __slots__ = ("anchor", "key", "session")

    def __init__(self, session: _Session, key: str, anchor: float) -> None:
        self.session, self.key, self.anchor = session, key, anchor


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
        if pending is None or pending.session.closed:
            return
        pending.session.batches.append((pending.key, pending.anchor, src.id, rows))


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
        ext = _install_ext(agent)
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
    with _lock:
        session = _sessions.setdefault(ident, _Session())
        _pending[token] = _Pending(session, key, time.time_ns() / 1000)
    with torch.autograd.profiler.record_function(key) as rf:
        reset = _STATE.set(_Request(token, shapes, memory))
        try:
            out = call()
        except BaseException:
            _forget(token)
            raise
        finally:
            _STATE.reset(reset)
        fut = None if until is None else until(out)
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

    def copy(_: Any) -> None:
        exc = fut.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(fut.value())

    profiling.add_done_callback(copy)
    return out


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
        self.prof.__exit__(None, None, None)
        rank = self.agent.rank
        rows = []
        for e in self.prof.function_events or ():
            r = e.time_range
            node = e.node_id if e.node_id >= 0 else rank
            shapes = [list(s) for s in e.input_shapes] if e.input_shapes else []
            mem, seq = e.cpu_memory_usage, e.sequence_nr
            rows.append(
                [e.name, r.start, r.end, e.thread, node, shapes, mem, seq, bool(e.is_async)]
            )
        return rows

    def __enter__(self) -> _Serving:
        self.prof.__enter__()
        self.reset = _STATE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.rows is None:  # (failed: no reply carries them)
            self.rows = []
            self.prof.__exit__(None, None, None)
        if self.reset is not None:
            _STATE.reset(self.reset)


def serving(ext: ProfileExtension, call: CallInfo, request: Any) -> _Serving | None:
    """The handler scope for a call that asks for the callee's events: a
    legacy profile around its function, on the thread running it; ``None``
    where the function runs elsewhere (on the event loop: ``async``
    functions, ``@async_execution``) or a profile already runs here."""
    if asyncio._get_running_loop() is not None or torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        return None
    ext.activate(_source, _on_reply)
    token, shapes, memory = request
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
        ranges = [s for s in starts.get(key, ()) if s <= at]
        if ranges:  # (after its range's start, whatever the clocks say)
            at = max(at, max(ranges) + 1)
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


def _rref_profiling_future(self: Any) -> torch.futures.Future[None]:
    return profiling_future(self)


def set_node_id(rank: int) -> None:
    """Mark this process's profiler events with its rank, as PyTorch's
    ``init_rpc`` does (where torch's build has its RPC module)."""
    setter = getattr(getattr(torch._C, "_distributed_rpc", None), "_set_profiler_node_id", None)
    if setter is not None:
        setter(rank)


def install() -> None:
    """Let torch's legacy profiler take in remote events, and give RRefs
    ``_get_profiling_future`` (idempotent)."""
    from .._rref._rref import RRef

    _legacy._parse_legacy_records = _parse_with_remote
    _legacy.profile._start_trace = _start_trace_noting_config
    RRef._get_profiling_future = _rref_profiling_future  # type: ignore[attr-defined]
