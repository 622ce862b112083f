"""The agent: worker table, outgoing calls, dispatch of incoming ones, shutdown.

One agent per worker. Its event loop runs in a daemon thread (``rpcdist-loop``)
and owns every grpc.aio object. User threads hand work to the loop with
``call_soon_threadsafe``; handlers that are plain functions run in a bounded
thread pool, ``async def`` handlers on the loop itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc.aio
import msgpack

from .._deadline import UNSET, Unset, current_deadline, deadline_for
from .._errors import (
    ClosedError,
    ConfigError,
    NotInitializedError,
    ProtocolError,
    RpcdistError,
    RpcTimeoutError,
    SerializationError,
    TransportError,
    WorkerLostError,
)
from .._futures import Future
from .._loop import LoopThread
from .._options import RpcOptions
from .._pool import WorkerPool
from .._serialization import decode, encode, exception_from_wire, function_name
from .._store._rendezvous import open_store, parse_init_method
from .._transport import _grpc, _tcp
from .._transport._conn import BaseConnection
from .._transport._frames import (
    CALL,
    ERROR_REPLY,
    INTERNAL,
    P2P,
    REPLY,
    InMessage,
    OutMessage,
)
from .._transport._shm import SegmentWriter, shm_available
from .._worker import WorkerInfo, check_worker_name
from . import _dispatch
from ._context import WireContext
from ._p2p import Mailbox
from ._sync_calls import NOT_TAKEN, SyncCalls

__all__ = ["Agent", "internal_handler"]

_log = logging.getLogger(__name__)

#: Internal (control) methods: name -> ``async handler(agent, src, payload)``.
INTERNAL_HANDLERS: dict[str, Callable[[Agent, WorkerInfo, Any], Awaitable[Any]]] = {}
#: Hooks run by a graceful shutdown before the agent quiesces.
SHUTDOWN_HOOKS: list[Callable[[Agent], Awaitable[None]]] = []
#: Checks run after a graceful shutdown closed the agent; they raise to report
#: what the hooks found wrong (for example, leaked RRefs).
SHUTDOWN_CHECKS: list[Callable[[Agent], None]] = []


def internal_handler(
    name: str,
) -> Callable[
    [Callable[[Agent, WorkerInfo, Any], Awaitable[Any]]],
    Callable[[Agent, WorkerInfo, Any], Awaitable[Any]],
]:
    """Register an internal control method under ``name`` (at import time)."""

    def register(
        fn: Callable[[Agent, WorkerInfo, Any], Awaitable[Any]],
    ) -> Callable[[Agent, WorkerInfo, Any], Awaitable[Any]]:
        INTERNAL_HANDLERS[name] = fn
        return fn

    return register


#: Calls up to this size may be sent from the calling thread (``_call_now``).
_DIRECT_CALL_BYTES = 64 << 10
#: How often the loop arms the timers of calls user threads sent themselves.
_ARM_PERIOD = 0.25
#: A directly sent call whose deadline is nearer than this wakes the loop to
#: arm its timer at once; later deadlines wait for the next sweep.
_ARM_AT_ONCE = 4 * _ARM_PERIOD


@dataclass(eq=False, slots=True)
class _Pending:
    fut: Future[Any]
    dst: int
    method: str
    deadline: float | None
    timer: asyncio.TimerHandle | None
    started: float


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class Agent:
    """One worker's RPC agent. Created by ``init_rpc`` or ``rpcdist.testing``."""

    def __init__(
        self,
        name: str,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        init_method: str | None = None,
        rpc_timeout: float | None = 60.0,
        num_worker_threads: int = 16,
        options: RpcOptions | None = None,
    ) -> None:
        self.name = check_worker_name(name)
        if not isinstance(num_worker_threads, int) or num_worker_threads < 1:
            raise ConfigError(f"num_worker_threads must be an int >= 1, got {num_worker_threads!r}")
        if options is not None and not isinstance(options, RpcOptions):
            raise ConfigError(
                f"options must be an rpcdist.RpcOptions, got {type(options).__name__}"
            )
        self.options = (options or RpcOptions()).validated()
        deadline_for(rpc_timeout, None)  # validates
        self._rpc_timeout = rpc_timeout
        self._spec = parse_init_method(init_method, rank, world_size)
        self.rank = self._spec.rank
        self.world_size = self._spec.world_size
        self._num_threads = num_worker_threads
        self.closed = False
        self._closing = False
        #: What this agent serves: "rpc" (init_rpc) and/or "collectives"
        #: (init_process_group). It shuts down when the last role is released.
        self.roles: set[str] = set()
        self.workers: list[WorkerInfo] = []
        self._by_name: dict[str, WorkerInfo] = {}
        self.addresses: dict[int, str] = {}
        self.hosts: dict[int, str] = {}
        self._out: dict[int, BaseConnection] = {}
        self._out_tasks: dict[int, asyncio.Task[None]] = {}
        self._calls: dict[int, Any] = {}
        self._in: set[BaseConnection] = set()
        self._pending: dict[int, _Pending] = {}
        #: Calls user threads handed to the loop that it has not sent yet.
        self._submits_queued = 0
        self._submit_lock = threading.Lock()
        self.call_ids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._inflight = 0
        #: Guards ``_inflight`` and ``calls_handled``: pool threads that send
        #: their own replies account for them too.
        self.count_lock = threading.Lock()
        self._idle = asyncio.Event()
        #: Calls user threads sent themselves whose timers the loop has not
        #: armed yet (see ``_call_now``); drained every ``_ARM_PERIOD``.
        self._to_arm: collections.deque[int] = collections.deque()
        self._sweeper: asyncio.TimerHandle | None = None
        #: Thread wake-ups held back to the end of the read callback that
        #: caused them (``wake_after_read``).
        self._wakeups: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        #: Set while a graceful shutdown waits for ``_idle``: only then do
        #: threads that finish work off the loop wake it to re-check.
        self._quiescing = False
        self.calls_sent = 0
        self.calls_handled = 0
        self.mailbox = Mailbox()
        self.extensions: dict[str, Any] = {}
        self._fn_names: dict[Any, str] = {}
        self.segments: SegmentWriter | None = (
            SegmentWriter() if self.options.payload_shm_threshold and shm_available() else None
        )
        #: Abstract Unix socket names of same-host peers (``local_sockets``).
        self._unix_names: dict[int, str] = {}
        self._store: Any = None
        self._store_server: Any = None
        self._server: _grpc.Server | _tcp.TcpServer | None = None
        self._lt = LoopThread(f"rpcdist-loop-{self.name}")
        self.loop = self._lt.loop
        self.executor = WorkerPool(num_worker_threads, f"rpcdist-worker-{self.name}")
        self.sync = SyncCalls(self)

    # ------------------------------------------------------------------ start

    def start(self) -> Agent:
        """Start serving and rendezvous with every worker (blocking).

        Raises:
            ConnectError: the store or a peer could not be reached in time.
            ConfigError: duplicate worker names, or inconsistent settings.
        """
        try:
            self._lt.run(self._start(), "init_rpc()")
        except BaseException:
            self._lt.run(self._close(ClosedError("init_rpc failed"), leave=True), "init_rpc()")
            self._stop_threads(wait=False)
            self.closed = True
            raise
        return self

    async def _start(self) -> None:
        self._idle.set()
        self._sweeper = self.loop.call_later(_ARM_PERIOD, self._sweep)
        timeout = self.options.init_timeout
        self._store, self._store_server = await open_store(
            self._spec, token=self.options.token, timeout=timeout
        )
        if self.options.data_transport == "tcp":
            self._server = _tcp.TcpServer(self.options, self._refusal, self._on_tcp_connection)
        else:
            self._server = _grpc.Server(self.options, self._on_stream)
        port = await self._server.start()
        host = self.options.peer_host()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        me = {
            "name": self.name,
            "rank": self.rank,
            "addr": address,
            "host": _host_id(),
            "transport": self.options.data_transport,
            "unix": getattr(self._server, "unix_name", None),
        }
        await self._store.set(f"rpc/worker/{self.rank}", msgpack.packb(me))
        entries = await asyncio.gather(
            *(self._store.get(f"rpc/worker/{r}", timeout) for r in range(self.world_size))
        )
        infos = [msgpack.unpackb(e) for e in entries]
        self.workers = [WorkerInfo(i["name"], i["rank"]) for i in infos]
        self._by_name = {w.name: w for w in self.workers}
        self.addresses = {i["rank"]: i["addr"] for i in infos}
        self.hosts = {i["rank"]: i["host"] for i in infos}
        me_host = self.hosts[self.rank]
        self._unix_names = {
            i["rank"]: i["unix"]
            for i in infos
            if i.get("unix") and i["host"] == me_host and self.options.unix_sockets
        }
        # After this barrier every worker has its table (so may be called) and
        # has read every entry (so rank 0 may stop the store on failure).
        await self._store.barrier("rpc/init", self.world_size, timeout)
        seen: dict[str, int] = {}
        for info in infos:
            if info["name"] in seen:
                raise ConfigError(
                    f"worker name {info['name']!r} is used by both rank {seen[info['name']]} "
                    f"and rank {info['rank']}: names must be unique"
                )
            seen[info["name"]] = info["rank"]
        kinds = {i.get("transport") for i in infos}
        if len(kinds) > 1:
            mine = self.options.data_transport
            other = next(i for i in infos if i.get("transport") != mine)
            raise ConfigError(
                f"worker {other['name']!r} uses transport {other.get('transport')!r} but "
                f"{self.name!r} uses {mine!r}: every worker needs the same RpcOptions.transport"
            )

    async def rename(self, name: str, timeout: float) -> None:
        """Change this worker's name, collectively (every worker calls it).

        Used when ``init_rpc`` adopts the agent ``init_process_group`` started.

        Raises:
            ConfigError: duplicate names after the change.
        """
        check_worker_name(name)
        await self._store.set(f"rpc/name/{self.rank}", name.encode())
        got = await asyncio.gather(
            *(self._store.get(f"rpc/name/{r}", timeout) for r in range(self.world_size))
        )
        names = [g.decode() for g in got]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ConfigError(f"worker name {dup!r} is used more than once: names must be unique")
        self.name = name
        self.workers = [WorkerInfo(n, r) for r, n in enumerate(names)]
        self._by_name = {w.name: w for w in self.workers}
        await self._store.barrier("rpc/rename", self.world_size, timeout)

    # ----------------------------------------------------------------- lookups

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(self.name, self.rank)

    @property
    def rpc_timeout(self) -> float | None:
        return self._rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, value: float | None) -> None:
        deadline_for(value, None)
        self._rpc_timeout = value

    def worker(self, to: str | int | WorkerInfo) -> WorkerInfo:
        """Resolve a worker name, rank or WorkerInfo.

        Raises:
            ConfigError: no such worker.
        """
        if isinstance(to, WorkerInfo):
            w = self._by_name.get(to.name)
            if w is None or w.id != to.id:
                raise ConfigError(f"unknown worker {to!r}; workers are {self._names()}")
            return w
        if isinstance(to, str):
            w = self._by_name.get(to)
            if w is None:
                raise ConfigError(f"unknown worker name {to!r}; workers are {self._names()}")
            return w
        if isinstance(to, int) and not isinstance(to, bool):
            if not 0 <= to < len(self.workers):
                raise ConfigError(f"worker rank {to} out of range [0, {len(self.workers)})")
            return self.workers[to]
        raise ConfigError(
            f"'to' must be a worker name, rank or WorkerInfo, got {type(to).__name__}"
        )

    def _names(self) -> str:
        return ", ".join(repr(w.name) for w in self.workers)

    def _check_open(self) -> None:
        if self.closed:
            raise NotInitializedError(f"the rpcdist agent {self.name!r} has shut down")

    # ----------------------------------------------------------- outgoing calls

    def function_name(self, func: Any) -> str:
        try:
            return self._fn_names[func]
        except (KeyError, TypeError):
            pass
        name = function_name(func)
        try:
            self._fn_names[func] = name
        except TypeError:
            pass
        return name

    def encode_call(
        self, args: Any, kwargs: Any, peer: WorkerInfo
    ) -> tuple[bytes, list[memoryview]]:
        """Encode ``(args, kwargs)`` for ``peer``, naming the bad argument on failure.

        Raises:
            SerializationError: an argument cannot be sent.
        """
        if not isinstance(args, tuple | list):
            raise ConfigError(f"args must be a tuple or list, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ConfigError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
        ctx = WireContext(self, peer)
        try:
            return encode(
                (tuple(args), kwargs or {}), allow_pickle=self.options.allow_pickle, context=ctx
            )
        except BaseException as exc:
            ctx.abort()  # extensions undo their side effects (RRef forks)
            if isinstance(exc, SerializationError):
                # Encode each part on its own (dry runs) for a precise location.
                encode(
                    tuple(args), allow_pickle=self.options.allow_pickle, context=ctx, where="args"
                )
                encode(
                    kwargs or {},
                    allow_pickle=self.options.allow_pickle,
                    context=ctx,
                    where="kwargs",
                )
            raise

    def call_message(
        self,
        to: str | int | WorkerInfo,
        func: Callable[..., Any],
        args: Any,
        kwargs: Any,
        timeout: float | Unset | None,
    ) -> tuple[WorkerInfo, OutMessage]:
        """The CALL message for ``func(*args, **kwargs)`` on ``to``, and the callee.

        Raises:
            ConfigError: unknown worker or bad arguments.
            SerializationError: ``func`` or an argument cannot be sent.
        """
        self._check_open()
        peer = self.worker(to)
        method = self.function_name(func)
        deadline = deadline_for(timeout, self._rpc_timeout)
        header, buffers = self.encode_call(args, kwargs, peer)
        return peer, OutMessage(CALL, method, header, buffers, deadline=deadline)

    def rpc_async(
        self,
        to: str | int | WorkerInfo,
        func: Callable[..., Any],
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | Unset | None = UNSET,
    ) -> Future[Any]:
        """Call ``func(*args, **kwargs)`` on ``to``; see ``rpcdist.rpc_async``."""
        peer, msg = self.call_message(to, func, args, kwargs, timeout)
        return self.submit_call(peer.id, msg, msg.method)

    def rpc_sync(
        self,
        to: str | int | WorkerInfo,
        func: Callable[..., Any],
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | Unset | None = UNSET,
    ) -> Any:
        """Call ``func(*args, **kwargs)`` on ``to`` and wait; see ``rpcdist.rpc_sync``."""
        self._lt.check_not_loop_thread("rpc_sync()")
        peer, msg = self.call_message(to, func, args, kwargs, timeout)
        if self.sync.eligible(msg):
            got = self.sync.call(peer, msg, msg.method)
            if got is not NOT_TAKEN:
                return got
        return self.submit_call(peer.id, msg, msg.method).wait()

    def has_queued_calls(self) -> bool:
        """Whether calls of this agent's are in flight on the loop's links (any thread)."""
        return bool(self._pending or self._submits_queued)

    def submit_call(self, dst: int, msg: OutMessage, label: str) -> Future[Any]:
        """Send a request from any thread; the Future gets its reply."""
        fut: Future[Any] = Future()
        if self._lt.in_loop_thread():
            self._start_call(dst, msg, fut, label)
        elif not self._call_now(dst, msg, fut, label):
            with self._submit_lock:
                self._submits_queued += 1
            try:
                self.loop.call_soon_threadsafe(self._start_call, dst, msg, fut, label, True)
            except RuntimeError as e:
                with self._submit_lock:
                    self._submits_queued -= 1
                raise NotInitializedError(f"the rpcdist agent {self.name!r} has shut down") from e
        return fut

    def _call_now(self, dst: int, msg: OutMessage, fut: Future[Any], label: str) -> bool:
        """From a user thread: send a small call straight onto an idle link.

        Saves the hop to the loop; the loop arms the call's timer afterwards
        (:meth:`_arm`). Only for a call made while none is in flight (under
        load, one write per call would cost more than the hop saves: measured
        -40% calls/s with 64 in flight); never while calls this agent handed
        to the loop are still unsent (so one thread's calls keep their
        order), under fault injection, or above 64 KiB.
        Returns False, having done nothing, when not taken.
        """
        conn = self._out.get(dst)
        if (
            conn is None
            or self._submits_queued
            or self._pending  # calls in flight: the loop's writes coalesce them
            or self.options.faults is not None
            or self.closed
            or len(msg.header) + msg.payload_bytes > _DIRECT_CALL_BYTES
        ):
            return False
        call_id = msg.id = next(self.call_ids)
        now = time.monotonic()
        self._pending[call_id] = _Pending(fut, dst, label, msg.deadline, None, now)
        if not conn.try_send_now(msg):
            # Not sent; True if the link failed meanwhile and the loop has
            # already failed the call (its Future holds the error).
            return self._pending.pop(call_id, None) is None
        with self.count_lock:
            self.calls_sent += 1
        if msg.deadline is None:
            pass  # no timer to arm
        elif msg.deadline - now > _ARM_AT_ONCE:
            self._to_arm.append(call_id)  # the sweep arms it: no wake-up now
        else:
            try:
                self.loop.call_soon_threadsafe(self._arm, call_id)
            except RuntimeError:
                pass  # the loop is gone: handled just below
        if self.closed:  # shut down meanwhile: _close may have missed this call
            p = self._pending.pop(call_id, None)
            if p is not None:
                fut.set_exception(ClosedError(f"agent {self.name!r} shut down"))
        return True

    def _arm(self, call_id: int) -> None:
        """On the loop, after :meth:`_call_now`: start the call's timer."""
        p = self._pending.get(call_id)
        if p is not None and p.timer is None and p.deadline is not None:  # not answered yet
            p.timer = self.loop.call_at(p.deadline, self._expire, call_id)

    def _sweep(self) -> None:
        """Every ``_ARM_PERIOD`` on the loop: arm the timers of direct calls."""
        while self._to_arm:
            self._arm(self._to_arm.popleft())
        if not self.closed:
            self._sweeper = self.loop.call_later(_ARM_PERIOD, self._sweep)

    def _start_call(
        self, dst: int, msg: OutMessage, fut: Future[Any], label: str, queued: bool = False
    ) -> None:
        if queued:
            with self._submit_lock:
                self._submits_queued -= 1
        if self.closed:
            fut.set_exception(NotInitializedError(f"the rpcdist agent {self.name!r} has shut down"))
            return
        call_id = msg.id = next(self.call_ids)
        timer = None
        if msg.deadline is not None:
            timer = self.loop.call_at(msg.deadline, self._expire, call_id)
        self._pending[call_id] = _Pending(fut, dst, label, msg.deadline, timer, time.monotonic())
        self._idle.clear()
        with self.count_lock:
            self.calls_sent += 1
        try:
            self._send(dst, msg, label)
        except RpcdistError as e:
            self._finish(call_id, exc=e)

    def _expire(self, call_id: int) -> None:
        p = self._pending.get(call_id)
        if p is not None:
            waited = time.monotonic() - p.started
            self._finish(
                call_id,
                exc=RpcTimeoutError(
                    f"call {p.method!r} to worker {self.workers[p.dst].name!r} timed out "
                    f"after {waited:.3g} s"
                ),
            )

    def _finish(
        self,
        call_id: int,
        *,
        value: Any = None,
        exc: BaseException | None = None,
        conn: BaseConnection | None = None,
    ) -> None:
        """Complete call ``call_id``; ``conn``: the reply came in on it."""
        p = self._pending.pop(call_id, None)
        if p is None:
            return
        if p.timer is not None:
            p.timer.cancel()
        if self._inflight == 0 and self._no_calls():
            self._idle.set()
        if conn is not None and not p.fut._has_callbacks():
            # Only threads wait on it: wake them when the read callback ends.
            self.wake_after_read(conn, p.fut._complete, value, exc)
        else:
            p.fut._complete(value, exc)

    def _send(self, dst: int, msg: OutMessage, label: str) -> None:
        faults = self.options.faults
        if faults is not None and (d := faults.decide(label)) is not None:
            action, delay = d
            if action == "drop":
                return
            if action == "fail":
                raise TransportError(f"injected failure sending {label!r} to worker {dst}")
            self.loop.call_later(delay, self._send_later, dst, msg, label)
            return
        self._connection(dst).send(msg)

    def _send_later(self, dst: int, msg: OutMessage, label: str) -> None:
        try:
            if not self.closed:
                self._connection(dst).send(msg)
        except RpcdistError as e:
            self._finish(msg.id, exc=e)

    def _connection(self, dst: int) -> BaseConnection:
        conn = self._out.get(dst)
        if conn is not None and conn.closed is None:
            return conn
        if self._closing and self.closed:
            raise ClosedError(f"agent {self.name!r} is shutting down")
        address = self.addresses[dst]
        label = self.peer_label(dst)
        if self.options.data_transport == "tcp":
            conn = _tcp.TcpConnection(
                self.loop,
                peer_rank=dst,
                label=label,
                on_message=self._on_message,
                options=self.options,
                segments=self.segments_for(dst),
                after_read=self._flush_wakeups,
            )
            run = self._run_outgoing_tcp(conn, address)
        else:
            channel = _grpc.open_channel(self.options, address)
            call = _grpc.connect(
                channel, options=self.options, my_rank=self.rank, my_name=self.name
            )
            conn = _grpc.Connection(
                peer_rank=dst,
                label=label,
                write=call.write,
                read=call.read,
                on_message=self._on_message,
                options=self.options,
                segments=self.segments_for(dst),
            )
            self._calls[dst] = call
            run = self._run_outgoing_grpc(conn, call, channel)
        self._out[dst] = conn
        # A clean context: the stream outlives the call that opened it, so it
        # must not inherit that call's deadline (or anything else).
        task = self.loop.create_task(
            self._run_outgoing(dst, conn, run), context=contextvars.Context()
        )
        self._out_tasks[dst] = task
        return conn

    async def _run_outgoing_grpc(
        self, conn: _grpc.Connection, call: Any, channel: grpc.aio.Channel
    ) -> None:
        try:
            await _grpc.handshake(call)
            await conn.run()
        finally:
            try:
                await channel.close()
            except BaseException:
                pass

    async def _run_outgoing_tcp(self, conn: _tcp.TcpConnection, address: str) -> None:
        conn.attach(await self.dial(conn.peer_rank, conn.label))
        await conn.run()

    async def dial(self, dst: int, label: str, *, sync: bool = False) -> socket.socket:
        """Connect to worker ``dst``'s TCP server (on the loop): its same-host
        Unix socket first, if any, then TCP. ``sync``: for blocking calls
        (``_sync_calls``).

        Raises:
            ConnectError: it cannot be reached, or refused us.
        """
        unix = self._unix_names.get(dst)
        while True:
            try:
                return await _tcp.tcp_connect(
                    self.addresses[dst],
                    label,
                    options=self.options,
                    my_rank=self.rank,
                    my_name=self.name,
                    unix=unix,
                    sync=sync,
                )
            except _tcp.Unreachable as e:  # e.g. another network namespace
                _log.debug("dialling %s over TCP: %s", label, e)
                unix = None

    def peer_label(self, dst: int) -> str:
        return f"worker {self.workers[dst].name!r} at {self.addresses[dst]}"

    async def _run_outgoing(self, dst: int, conn: BaseConnection, run: Any) -> None:
        exc: RpcdistError
        cancelled = False
        try:
            await run
            exc = WorkerLostError(f"{conn.label} ended its stream (it shut down)")
        except asyncio.CancelledError:
            cancelled = True
            exc = ClosedError(f"agent {self.name!r} shut down")
        except BaseException as e:
            exc = _grpc.translate_rpc_error(e, conn.label, reached=conn.received_any)
        conn.closed = exc
        if self._out.get(dst) is conn:
            del self._out[dst]
            self._calls.pop(dst, None)
            self._out_tasks.pop(dst, None)
        self._fail_peer(dst, exc)
        if cancelled:
            raise asyncio.CancelledError

    def segments_for(self, rank: int) -> SegmentWriter | None:
        """The /dev/shm writer for a peer on this host, else None."""
        if self.segments is not None and self.hosts.get(rank) == self.hosts.get(self.rank):
            return self.segments
        return None

    def _fail_peer(self, dst: int, exc: RpcdistError) -> None:
        for call_id, p in list(self._pending.items()):
            if p.dst == dst:
                e = type(exc)(f"call {p.method!r} failed: {exc}")
                self._finish(call_id, exc=e)
        self.mailbox.fail_all(dst, type(exc)(str(exc)))

    # ------------------------------------------------------------ incoming

    async def _on_stream(self, rank: int, name: str, context: Any) -> None:
        if not 0 <= rank < len(self.workers) or self.workers[rank].name != name:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"worker {name!r} (rank {rank}) is not part of this job",
            )
        conn = _grpc.Connection(
            peer_rank=rank,
            label=f"worker {name!r}",
            write=context.write,
            read=context.read,
            on_message=self._on_message,
            options=self.options,
            alloc=self._p2p_alloc(rank),
            segments=self.segments_for(rank),
        )
        self._in.add(conn)
        try:
            await conn.run()
        except ProtocolError as e:
            _log.warning("closing stream from %s: %s", conn.label, e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (grpc.aio.AioRpcError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            conn.closed = WorkerLostError(f"stream from {conn.label} ended")
            self._in.discard(conn)

    def _p2p_alloc(self, rank: int) -> Callable[[int, str, int], memoryview | None]:
        """Where an incoming message from ``rank`` lands: a posted P2P receive, else fresh."""

        def alloc(kind: int, key: str, total: int) -> memoryview | None:
            return self.mailbox.alloc(rank, key, total) if kind == P2P else None

        return alloc

    def _refusal(self, rank: int, name: str) -> str | None:
        if not 0 <= rank < len(self.workers) or self.workers[rank].name != name:
            return f"worker {name!r} (rank {rank}) is not part of this job"
        return None

    async def _on_tcp_connection(self, rank: int, name: str, sock: Any, sync: bool) -> None:
        if sync and self.sync.serve(rank, name, sock):
            return  # a thread of its own serves it
        conn = _tcp.TcpConnection(
            self.loop,
            peer_rank=rank,
            label=f"worker {name!r}",
            on_message=self._on_message,
            options=self.options,
            alloc=self._p2p_alloc(rank),
            segments=self.segments_for(rank),
            after_read=self._flush_wakeups,
        )
        conn.attach(sock)
        self._in.add(conn)
        try:
            await conn.run()
        except RpcdistError:
            pass
        finally:
            conn.closed = conn.closed or WorkerLostError(f"stream from {conn.label} ended")
            self._in.discard(conn)

    def adopt_late(self, conn: _tcp.TcpConnection) -> None:
        """On the loop: serve a thread-driven connection whose call timed out.

        Half-closed, so the callee ends it once it has answered (or at once,
        dropping the reply, if it has not started the answer); a reply that
        still comes is handled as any late reply.
        """
        if self.closed:
            conn.close_threaded()
            return
        conn._on_message = self._on_message
        conn.after_read = self._flush_wakeups
        conn.hand_to_loop()
        conn.shutdown_write()
        self.spawn(self._serve_late(conn))

    async def _serve_late(self, conn: _tcp.TcpConnection) -> None:
        try:
            await conn.run()
        except RpcdistError:
            pass

    def on_message(self, conn: BaseConnection, m: InMessage) -> None:
        """Handle a message read off the loop by a thread (on the loop)."""
        try:
            self._on_message(conn, m)
        except ProtocolError as e:
            _log.warning("dropping a message from %s: %s", conn.label, e)

    def handler_started_threadsafe(self) -> None:
        """Account for a call a thread other than the loop's starts handling."""
        with self.count_lock:
            self._inflight += 1

    def _on_message(self, conn: BaseConnection, m: InMessage) -> None:
        kind = m.kind
        if kind in (REPLY, ERROR_REPLY):
            self._on_reply(conn, m)
        elif kind in (CALL, INTERNAL):
            with self.count_lock:
                self._inflight += 1
            self._idle.clear()
            _dispatch.dispatch(self, conn, m)
        elif kind == P2P:
            self.mailbox.deliver(conn.peer_rank, m)
        else:
            raise ProtocolError(f"unexpected frame kind {kind} from {conn.label}")

    def wake_after_read(self, conn: BaseConnection, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)``, which wakes another thread, once ``conn``'s
        current read callback ends (at once on a transport without one).

        Waking a pool or user thread while the loop still has the rest of
        the callback to run makes that thread wait for the GIL: a second
        wake-up, measured at several us each on the benchmark machine.
        """
        if conn.after_read is None:
            fn(*args)
        else:
            self._wakeups.append((fn, args))

    def _flush_wakeups(self) -> None:
        wakeups = self._wakeups
        while wakeups:
            batch = wakeups[:]
            wakeups.clear()
            for fn, args in batch:
                try:
                    fn(*args)
                except Exception:
                    _log.exception("error waking a thread for %r", fn)

    @property
    def inflight_handlers(self) -> int:
        """Handlers running now (read from any thread; a hint, not a lock)."""
        return self._inflight

    def handler_done(self) -> None:
        """Account for a finished handler (on the loop)."""
        with self.count_lock:
            self._inflight -= 1
            self.calls_handled += 1
        if self._inflight == 0 and self._no_calls():
            self._idle.set()

    def handler_done_threadsafe(self) -> None:
        """:meth:`handler_done` from a pool thread, before it sends the reply itself."""
        with self.count_lock:
            self._inflight -= 1
            self.calls_handled += 1
            idle = self._inflight == 0
        if idle:
            self.woke_idle_threadsafe()

    def woke_idle_threadsafe(self) -> None:
        """From a thread that finished some work off the loop: a graceful
        shutdown waiting for idleness re-checks (else nobody waits: the loop
        is spared the wake-up)."""
        if self._quiescing:
            try:
                self.loop.call_soon_threadsafe(self._check_idle)
            except RuntimeError:  # the loop is gone
                pass

    def _no_calls(self) -> bool:
        return not self._pending and not self.sync.inflight

    def _check_idle(self) -> None:
        if self._inflight == 0 and self._no_calls():
            self._idle.set()
        else:
            self._idle.clear()  # user threads add calls without touching the loop

    def _on_reply(self, conn: BaseConnection, m: InMessage) -> None:
        p = self._pending.get(m.id)
        ctx = WireContext(self, self.workers[conn.peer_rank])
        if p is None:
            # A late reply to a call that timed out or was failed: decode it
            # anyway, so that RRef forks it carries are registered and released.
            try:
                decode(m.header, m.buffers, allow_pickle=self.options.allow_pickle, context=ctx)
            except RpcdistError:
                pass
            return
        try:
            value = decode(m.header, m.buffers, allow_pickle=self.options.allow_pickle, context=ctx)
        except SerializationError as e:
            self._finish(m.id, exc=e, conn=conn)
            return
        if m.kind == REPLY:
            self._finish(m.id, value=value, conn=conn)
        else:
            self._finish(m.id, exc=exception_from_wire(value), conn=conn)

    # --------------------------------------------------- internal & control

    async def call_internal(
        self, dst: int, method: str, payload: Any, *, timeout: float | Unset | None = UNSET
    ) -> Any:
        """Call an internal method on worker ``dst`` (on the loop)."""
        self._check_open()
        deadline = deadline_for(timeout, self._rpc_timeout)
        header, buffers = encode(
            payload,
            allow_pickle=self.options.allow_pickle,
            context=WireContext(self, self.workers[dst]),
        )
        msg = OutMessage(INTERNAL, method, header, buffers, deadline=deadline)
        return await self.submit_call(dst, msg, method)

    async def send_control(
        self, dst: int, method: str, payload: Any, *, give_up_after: float | None = None
    ) -> Any:
        """Send an idempotent control message, retrying until acknowledged.

        Retries after ``control_retry_interval`` without a reply and after
        transport errors, until ``give_up_after`` seconds (default: the agent's
        rpc timeout, else 60 s) have passed; then raises the last error.
        """
        limit = give_up_after if give_up_after is not None else (self._rpc_timeout or 60.0)
        end = time.monotonic() + limit
        interval = self.options.control_retry_interval
        token = current_deadline.set(None)
        try:
            while True:
                left = end - time.monotonic()
                try:
                    return await self.call_internal(
                        dst, method, payload, timeout=min(interval, max(left, 1e-3))
                    )
                except (RpcTimeoutError, TransportError) as e:
                    if time.monotonic() >= end or self.closed:
                        raise
                    if not isinstance(e, RpcTimeoutError):
                        await asyncio.sleep(min(interval, max(end - time.monotonic(), 0)))
        finally:
            current_deadline.reset(token)

    async def p2p_send(
        self, dst: int, key: str, buffers: list[memoryview], header: bytes = b""
    ) -> None:
        """Send a one-way message; returns once its bytes are copied out (on the loop)."""
        self._check_open()
        done: asyncio.Future[None] = self.loop.create_future()

        def packed() -> None:
            if not done.done():
                done.set_result(None)

        msg = OutMessage(P2P, key, header, buffers, on_packed=packed)
        msg.id = next(self.call_ids)
        self._send(dst, msg, "p2p")
        conn = self._out.get(dst)
        if conn is None:
            return
        # Fail the wait if the stream dies before our bytes went out.
        while not done.done():
            if conn.closed is not None:
                raise conn.closed
            await asyncio.wait([done], timeout=0.5)

    async def p2p_recv(self, src: int, key: str, out: memoryview | None = None) -> InMessage:
        """Receive the next one-way message ``key`` from ``src`` (on the loop)."""
        self._check_open()
        return await self.mailbox.post(src, key, out)

    def run(self, coro: Any, what: str = "this call") -> Any:
        """Run a coroutine on the agent loop, blocking (not on the loop thread)."""
        self._check_open()
        return self._lt.run(coro, what)

    def check_not_loop_thread(self, what: str) -> None:
        self._lt.check_not_loop_thread(what)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Start a tracked background task on the loop (call on the loop)."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def store(self) -> Any:
        return self._store

    # ----------------------------------------------------------- statistics

    def statistics(self) -> dict[str, int]:
        """Counters for tests and debugging; every gauge is 0 when idle."""
        stats = {
            "pending_calls": len(self._pending) + self.sync.inflight,
            "inflight_handlers": self._inflight,
            "queued_frames": sum(c.queued() for c in list(self._out.values())),
            "outgoing_streams": len(self._out),
            "incoming_streams": len(self._in),
            "calls_sent": self.calls_sent,
            "calls_handled": self.calls_handled,
            "direct_sync_calls": self.sync.calls,
        }
        stats.update(self.mailbox.statistics())
        for ext in list(self.extensions.values()):
            fn = getattr(ext, "statistics", None)
            if fn is not None:
                stats.update(fn())
        return stats

    # --------------------------------------------------------------- shutdown

    def shutdown(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Shut this agent down; see ``rpcdist.shutdown``.

        Raises:
            RpcTimeoutError: a graceful shutdown did not finish within ``timeout``.
            WrongThreadError: called on the agent's loop thread.
        """
        if self.closed:
            return
        self._lt.check_not_loop_thread("shutdown()")
        self._closing = True
        clean = False
        try:
            self._lt.run(self._shutdown(graceful, timeout), "shutdown()")
            clean = graceful
        finally:
            # After a timeout, do not wait for handlers still running user code
            # (they cannot be interrupted); the caller asked for a bound.
            self._stop_threads(wait=clean)

    async def _shutdown(self, graceful: bool, timeout: float | None) -> None:
        err: BaseException | None = None
        if graceful:
            limit = timeout if timeout is not None else self.options.shutdown_timeout
            try:
                async with asyncio.timeout(limit):
                    for hook in SHUTDOWN_HOOKS:
                        await hook(self)
                    await self._quiesce(limit)
            except TimeoutError:
                err = RpcTimeoutError(
                    f"graceful shutdown of {self.name!r} did not finish within {limit} s "
                    f"({len(self._pending)} calls pending, {self._inflight} handlers running)"
                )
            except RpcdistError as e:
                err = e
        ok = graceful and err is None
        await self._close(ClosedError(f"agent {self.name!r} shut down"), graceful=ok, leave=ok)
        if err is not None:
            raise err
        if ok:
            for check in SHUTDOWN_CHECKS:
                check(self)

    async def _quiesce(self, limit: float) -> None:
        """Wait until no worker has work in flight (two stable rounds)."""
        previous: tuple[int, int] | None = None
        pause = 0.002
        # From here on, threads finishing work wake the loop (see
        # handler_done_threadsafe); what finished before is checked now.
        self._quiescing = True
        for round_no in itertools.count():
            self._check_idle()
            await self._idle.wait()
            report = [self.calls_sent, self.calls_handled, int(self._idle.is_set())]
            await self._store.set(f"rpc/quiesce/{round_no}/{self.rank}", msgpack.packb(report))
            got = await asyncio.gather(
                *(
                    self._store.get(f"rpc/quiesce/{round_no}/{r}", limit)
                    for r in range(self.world_size)
                )
            )
            reports = [msgpack.unpackb(g) for g in got]
            sent = sum(r[0] for r in reports)
            handled = sum(r[1] for r in reports)
            idle = all(r[2] for r in reports)
            if idle and sent == handled and previous == (sent, handled):
                return
            previous = (sent, handled) if idle and sent == handled else None
            if previous is None:
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.1)

    async def _close(
        self, exc: RpcdistError, *, graceful: bool = False, leave: bool = False
    ) -> None:
        self._closing = True
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.sync.close()
        for call_id in list(self._pending):
            self._finish(call_id, exc=type(exc)(str(exc)))
        self.mailbox.fail_all(None, ClosedError(str(exc)))
        for call in list(self._calls.values()):
            await _grpc.close_call(call)
        for conn in list(self._out.values()):
            if isinstance(conn, _tcp.TcpConnection):
                conn.shutdown_write()
        for task in list(self._out_tasks.values()):
            task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._out_tasks.values(), *self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(0.5 if graceful else 0)
        if self.segments is not None:
            self.segments.cleanup()
        if self._store is not None:
            try:
                if leave:
                    await self._leave_store()
            except RpcdistError as e:
                _log.debug("store leave on %s: %s", self.name, e)
            await self._store.close()
        if self._store_server is not None:
            await self._store_server.stop(1.0)

    async def _leave_store(self) -> None:
        """Rank 0 serves the store: it stops only after the others are done with it."""
        if self.rank != 0:
            await self._store.set(f"rpc/left/{self.rank}", b"1")
        else:
            keys = [f"rpc/left/{r}" for r in range(1, self.world_size)]
            if keys:
                await self._store.wait(keys, 5.0)

    def _stop_threads(self, wait: bool) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=not wait)
        self.sync.join(None if wait else 1.0)
        self._lt.stop()
