"""The agent: one worker's lifecycle, its workers table, calls and statistics.

One agent per worker (several in one process in tests). Its event loop runs
in a daemon thread (``rpcdist-loop-<name>``) and owns every transport
object. The agent composes the pieces of this package:

* :class:`~._links.Links`: the transport and the links to peers;
* :class:`~._calls.Calls`: outgoing calls waiting for replies;
* :mod:`._dispatch`: the one path incoming calls take to their handlers;
* :class:`~._sync_pool.SyncPool`: blocking calls on connections the calling
  threads drive, :class:`~._sync_serving.SyncServing`: the threads serving
  such connections here, :class:`~._busy_poll.BusyPoll`: how both wait;
* :class:`~._registry.Registry`: what the layers above plug in;
* :class:`~._activity.Activity`: what is in flight, for graceful shutdown;
* :class:`~._liveness.Liveness`: the failure detector and the lost workers.

Graceful shutdown is in :mod:`._shutdown`; the job secret, the workers table
and the init checks in :mod:`._join`; snapshots for hang diagnosis in
:mod:`._doctor`. Each piece sees the agent as an
:class:`~._agent_view.AgentView` and never imports this module: the agent
depends on its pieces, not the reverse.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from .._deadline import UNSET, Unset, deadline_after, deadline_for, seconds_of
from .._errors import (
    ConfigError,
    NotInitializedError,
    ProtocolError,
    RpcdistError,
    SerializationError,
    WorkerLostError,
)
from .._futures import Future
from .._loop import LoopThread
from .._options import RpcOptions
from .._pool import WorkerPool
from .._serialization import encode
from .._serialization._functions import CallablePolicy, name_of
from .._serialization._hooks import CodecHooks
from .._store import parse_init_method
from .._transport import Link
from .._transport._frames import (
    CALL,
    ERROR_REPLY,
    HEARTBEAT,
    INTERNAL,
    P2P,
    REPLY,
    InMessage,
    OutMessage,
)
from .._transport._frames import Meta as Meta
from .._worker import WorkerInfo, check_worker_name
from . import _dispatch, _doctor, _join, _members, _shutdown
from ._activity import Activity
from ._busy_poll import BusyPoll
from ._calls import Calls, send_control
from ._links import Links
from ._liveness import PING, Liveness, on_ping
from ._p2p import Mailbox, send_one_way
from ._registry import BUILTIN_EXTENSIONS, Extension, Registry
from ._started import Started
from ._sync_pool import NOT_TAKEN, SyncPool, channel_limit
from ._sync_serving import SyncServing
from ._table import WorkerTable
from ._wire import WireContext

__all__ = ["AUTO", "Agent"]

T = TypeVar("T")
E = TypeVar("E", bound=Extension)


class _Auto:
    def __repr__(self) -> str:
        return "AUTO"


#: ``meta=AUTO``: ask the registry's metadata sources (user-facing calls).
AUTO: Final = _Auto()


class Agent:
    """One worker's RPC agent. Made by ``init_rpc``, ``init_process_group`` or
    ``rpcdist.testing``; :meth:`start` joins the job."""

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
        #: The default timeout, and its checked seconds (each call reads them).
        self._rpc_timeout = rpc_timeout
        self._timeout_s = seconds_of(rpc_timeout)  # validates
        self._spec = parse_init_method(init_method, rank, world_size, dynamic=True)
        self.options.check_store_host(self._spec.host, self._spec.rank)
        #: What peers may call here by name (see ``RpcOptions.callable_policy``).
        self.policy = CallablePolicy(
            self.options.callable_policy, frozenset(self.options.allowed_callables)
        )
        self.rank = self._spec.rank
        #: 0 in a dynamic group (no world size: workers join and leave, see
        #: ``_members``).
        self.world_size = self._spec.world_size
        self.dynamic = self.world_size == 0
        self.closed = False
        #: What this agent serves: "rpc" (init_rpc) and/or "collectives"
        #: (init_process_group). It shuts down when the last role is released.
        self.roles: set[str] = set()
        self.workers = WorkerTable()
        #: Host identity (hostname, boot id, /dev/shm, pid namespace) of every worker, by rank.
        self.hosts: dict[int, str] = {}
        self._store: Any = None
        self._store_server: Any = None
        #: Thread wake-ups held back to the end of the read callback that
        #: caused them (``wake_after_read``).
        self._wakeups: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.registry = Registry()
        #: What this agent's extensions taught its codec (CUDA IPC, torch edges).
        self.codec_hooks = CodecHooks()
        self.mailbox = Mailbox()
        # Threads last, so that a failure above leaves none behind.
        self.executor = WorkerPool(num_worker_threads, f"rpcdist-worker-{self.name}")
        self.executor.describe = functools.partial(_dispatch.blocked_handler, self)
        self._loop_thread = LoopThread(f"rpcdist-loop-{self.name}")
        try:
            self.loop = self._loop_thread.loop
            self.calls = Calls(self)
            self.activity = Activity(self.loop, self._no_calls)
            self.links = Links(self)
            limit = channel_limit(self)
            spin = float(self.options.busy_poll_us) * 1e-6 if limit else 0.0
            switch = self.options.gil_switch_us
            self.busy_poll = BusyPoll(
                spin,
                self.activity,
                self.loop,
                switch=None if switch is None else float(switch) * 1e-6,
            )
            self.sync = SyncPool(self, limit, self.busy_poll)
            self.sync_serving = SyncServing(self, limit, self.busy_poll)
            self.liveness = Liveness(self)
            self.registry.add_handler(PING, on_ping)
            #: A dynamic group's membership (``None``: a static job).
            self.membership = _members.install(self) if self.dynamic else None
            for path in BUILTIN_EXTENSIONS:
                module, _, factory = path.partition(":")
                getattr(importlib.import_module(module), factory)(self)
        except BaseException:
            self._stop_threads(wait=False)
            raise

    # ------------------------------------------------------------------ start

    def start(self) -> Agent:
        """Start serving and rendezvous with every worker (blocking).

        Raises:
            ConnectError: the store or a peer could not be reached in time.
            ConfigError: duplicate worker names, or inconsistent settings.
        """
        try:
            self._loop_thread.run(self._start(), "init_rpc()")
        except BaseException:
            self._loop_thread.run(_shutdown.close(self, graceful=False, leave=True), "init_rpc()")
            self._stop_threads(wait=False)
            raise
        return self

    async def _start(self) -> None:
        self.calls.start()
        # (without a token, this also sets the job's secret as the links' token)
        self._store, self._store_server = await _join.open_job_store(self, self._spec)
        if self.membership is not None:
            await _members.join(self, self.membership, await self.links.serve())
            self.liveness.start()
            return
        if self.rank == 0:
            await _members.mark_static(self)
        infos = await _join.join(self, await self.links.serve())
        self.workers = WorkerTable(WorkerInfo(i["name"], i["rank"]) for i in infos)
        self.hosts = {i["rank"]: i["host"] for i in infos}
        self.links.set_peers({i["rank"]: i["link"] for i in infos}, self.hosts)
        self.liveness.learn(infos)
        # Only with its tables filled in may a worker pass this: peers call at once.
        await _join.barrier(self, "rpc/init")
        await _join.check(self, infos)
        await _shutdown.passed_init(self)
        self.liveness.start()

    async def rename(self, name: str, timeout: float) -> None:
        """Change this worker's name, collectively (every worker calls it).

        Used when ``init_rpc`` adopts the agent ``init_process_group`` started.

        Raises:
            ConfigError: duplicate names after the change.
        """
        names = await _join.agree_names(self, check_worker_name(name), timeout)
        self.name = name
        rename = getattr(self.links.transport, "rename", None)
        if rename is not None:
            rename(name)
        self.workers = WorkerTable(WorkerInfo(n, r) for r, n in enumerate(names))
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
        self._timeout_s = seconds_of(value)
        self._rpc_timeout = value

    @property
    def store(self) -> Any:
        """The rendezvous store client (async)."""
        return self._store

    def worker(self, to: str | int | WorkerInfo) -> WorkerInfo:
        """Resolve a worker name, rank or WorkerInfo.

        Raises:
            ConfigError: no such worker.
            WorkerLostError: it left the dynamic group, or was lost and taken
                out of it.
        """
        if type(to) is str and (w := self.workers.named(to)) is not None:
            return w  # (the usual case first)
        if isinstance(to, WorkerInfo):
            w = self.workers.named(to.name)
            if w is None or w.id != to.id:
                self._check_departed(rank=to.id, name=to.name)
                raise ConfigError(f"unknown worker {to!r}; workers are {self._names()}")
            return w
        if isinstance(to, str):
            w = self.workers.named(to)
            if w is None:
                self._check_departed(name=to)
                raise ConfigError(
                    f"unknown worker name {to!r} (could not find destination); "
                    f"workers are {self._names()}"
                )
            return w
        if isinstance(to, int) and not isinstance(to, bool):
            if not self.workers.knows(to):
                self._check_departed(rank=to)
                if self.dynamic:
                    raise ConfigError(f"no worker of rank {to}; workers are {self._names()}")
                raise ConfigError(f"worker rank {to} out of range [0, {len(self.workers)})")
            return self.workers[to]
        raise ConfigError(
            f"'to' must be a worker name, rank or WorkerInfo, got {type(to).__name__}"
        )

    def _check_departed(self, *, rank: int | None = None, name: str | None = None) -> None:
        """Raises: WorkerLostError: that worker left the group or was lost."""
        why = self.workers.departed(rank=rank, name=name)
        if why is not None:
            who = f"worker {name!r}" if name is not None else f"worker of rank {rank}"
            raise WorkerLostError(
                f"{who} is no longer in the group of {self.name!r}: {why}; workers are "
                f"{self._names()}"
            )

    def _names(self) -> str:
        return ", ".join(repr(w.name) for w in self.workers)

    def check_open(self) -> None:
        """Raises: NotInitializedError: the agent has shut down."""
        if self.closed:
            raise NotInitializedError(f"the rpcdist agent {self.name!r} has shut down")

    def extension(self, name: str, make: Callable[[], E]) -> E:
        """Extension ``name`` of this agent, made on first use (see :mod:`._registry`)."""
        return self.registry.extension(name, make)

    # ----------------------------------------------------------- outgoing calls

    def function_name(self, func: Any) -> str:
        """``func``'s name on the wire (cached).

        Raises:
            SerializationError: ``func`` cannot be sent by name.
        """
        return name_of(func)

    def request(
        self,
        peer: WorkerInfo,
        method: str,
        payload: Any,
        *,
        deadline: float | None,
        meta: Meta | _Auto | None = AUTO,
        internal: bool = False,
        label: str = "",
        where: tuple[Any, Any] | None = None,
        control: bool = False,
    ) -> OutMessage:
        """Encode a request for ``peer``: ``method`` with ``payload``.

        ``meta``: named extension fields; ``AUTO`` asks the registry's
        sources (user-facing calls), ``None`` sends none (control messages).
        ``where``: ``(args, kwargs)`` inside ``payload``, to locate an
        argument that cannot be sent.

        Raises:
            SerializationError: ``payload`` cannot be sent (naming where).
        """
        self.check_open()
        auto = meta is AUTO
        if auto:
            meta = self.registry.meta()
        wire = WireContext(self, peer, meta=meta)  # type: ignore[arg-type]
        if auto and not internal and self.registry.riders:
            wire.meta = self.registry.ride(peer.id, wire, wire.meta)
        pickle = self.options.allow_pickle
        try:
            header, buffers = encode(payload, allow_pickle=pickle, context=wire)
            if buffers:
                self.check_size(header, buffers, f"the call {label or method!r}")
        except BaseException as exc:
            wire.abort()  # extensions undo their side effects (RRef forks)
            if isinstance(exc, SerializationError) and where is not None:
                # Encode each part on its own (dry runs) for a precise location.
                encode(tuple(where[0]), allow_pickle=pickle, context=wire, where="args")
                encode(where[1] or {}, allow_pickle=pickle, context=wire, where="kwargs")
            raise
        return OutMessage(
            INTERNAL if internal else CALL,
            method,
            header,
            buffers,
            deadline=deadline,
            meta=wire.meta,
            label=label,
            undo=wire.abort,
            ordered=not control,
        )

    def check_size(self, header: bytes, buffers: list[memoryview], what: str) -> None:
        """Raises: SerializationError: the message is larger than ``max_message_bytes``."""
        size = len(header) + sum(b.nbytes for b in buffers)
        if size > self.options.max_message_bytes:
            raise SerializationError(
                f"{what} would send a message of {size} bytes, more than "
                f"RpcOptions.max_message_bytes ({self.options.max_message_bytes}): the "
                "receiver would refuse it"
            )

    def call(
        self,
        to: str | int | WorkerInfo,
        method: str,
        payload: Any,
        *,
        deadline: float | None,
        meta: Meta | _Auto | None = AUTO,
        internal: bool = False,
        label: str = "",
        where: tuple[Any, Any] | None = None,
        control: bool = False,
    ) -> Future[Any]:
        """Send a request (any thread); a Future of the reply's value.

        ``method`` is a function name (``internal=False``: a user call) or
        an internal method; ``control``: an idempotent control message, not
        ordered with this agent's calls; see :meth:`request` for the rest.

        Raises:
            ConfigError: unknown worker.
            SerializationError: ``payload`` cannot be sent.
            NotInitializedError: the agent has shut down.
        """
        peer = self.worker(to)
        msg = self.request(
            peer,
            method,
            payload,
            deadline=deadline,
            meta=meta,
            internal=internal,
            label=label,
            where=where,
            control=control,
        )
        return self.calls.submit(peer.id, msg)

    def _user_call(
        self, to: Any, func: Any, args: Any, kwargs: Any, timeout: float | Unset | None
    ) -> tuple[WorkerInfo, OutMessage]:
        self.check_open()
        if not isinstance(args, tuple | list):
            raise ConfigError(f"args must be a tuple or list, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ConfigError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
        peer = self.worker(to)
        method = name_of(func)
        if timeout is UNSET:  # (the default, checked when it was set)
            deadline = deadline_after(self._timeout_s)
        else:
            deadline = deadline_for(timeout, None)
        payload = (tuple(args), kwargs or {})
        msg = self.request(peer, method, payload, deadline=deadline, where=(args, kwargs))
        return peer, msg

    def rpc_async(
        self,
        to: str | int | WorkerInfo,
        func: Callable[..., Any],
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | Unset | None = UNSET,
    ) -> Future[Any]:
        """Call ``func(*args, **kwargs)`` on ``to``; see ``rpcdist.rpc_async``."""
        peer, msg = self._user_call(to, func, args, kwargs, timeout)
        return self.calls.submit(peer.id, msg)

    def rpc_sync(
        self,
        to: str | int | WorkerInfo,
        func: Callable[..., Any],
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | Unset | None = UNSET,
    ) -> Any:
        """Call ``func(*args, **kwargs)`` on ``to`` and wait; see ``rpcdist.rpc_sync``."""
        self._loop_thread.check_not_loop_thread("rpc_sync()")
        peer, msg = self._user_call(to, func, args, kwargs, timeout)
        return self._begin(peer, msg).wait()

    def start_blocking(
        self,
        to: str | int | WorkerInfo,
        method: str,
        payload: Any,
        *,
        deadline: float | None,
        meta: Meta | _Auto | None = AUTO,
        internal: bool = False,
        label: str = "",
        where: tuple[Any, Any] | None = None,
    ) -> Started | Future[Any]:
        """:meth:`call` for a caller that will block on the reply: on a
        thread-driven link when the call qualifies (see ``_sync_pool``).
        Returns once it is sent, with something whose ``wait()`` reads the
        reply's value on the calling thread, so the caller can work meanwhile
        (``start_blocking(...).wait()`` is a blocking call). Give up a
        ``Started`` with ``_started.abandon``.

        Raises:
            WrongThreadError: called on the agent's loop thread.
        """
        self._loop_thread.check_not_loop_thread(f"a blocking call of {method!r}")
        peer = self.worker(to)
        msg = self.request(
            peer,
            method,
            payload,
            deadline=deadline,
            meta=meta,
            internal=internal,
            label=label,
            where=where,
        )
        return self._begin(peer, msg)

    def _begin(self, peer: WorkerInfo, msg: OutMessage) -> Started | Future[Any]:
        if self.sync.eligible(peer, msg):
            started = self.sync.start(peer, msg)
            if started is not NOT_TAKEN:
                return started
        return self.calls.submit(peer.id, msg)

    async def send_control(
        self, dst: int, method: str, payload: Any, *, give_up_after: float | None = None
    ) -> Any:
        """Send an idempotent internal message, retrying until acknowledged
        (on the loop); see :func:`._calls.send_control`."""
        return await send_control(self, dst, method, payload, give_up_after)

    # ------------------------------------------------------------ one-way

    async def p2p_send(
        self, dst: int, key: str, buffers: list[memoryview], header: bytes = b""
    ) -> None:
        """Send a one-way message; returns once its bytes are copied out (on the loop)."""
        self.check_open()
        await send_one_way(self.links.link(dst), next(self.calls.ids), key, buffers, header)

    async def p2p_recv(self, src: int, key: str, out: memoryview | None = None) -> InMessage:
        """Receive the next one-way message ``key`` from ``src`` (on the loop)."""
        self.check_open()
        return await self.mailbox.post(src, key, out)

    # ------------------------------------------------------------ incoming

    def on_message(self, link: Link, m: InMessage) -> None:
        """Every whole incoming message (on the loop)."""
        kind = m.kind
        if kind in (CALL, INTERNAL):
            activity = self.activity  # (inlined handler_started: every call comes here)
            with activity.lock:
                activity.inflight += 1
            activity.idle.clear()
            _dispatch.dispatch(self, link, m)
        elif kind in (REPLY, ERROR_REPLY):
            self.calls.on_reply(link, m)
        elif kind == P2P:
            if m.method != HEARTBEAT:  # a heartbeat only shows the peer is alive
                self.mailbox.deliver(link.peer_rank, m)
        else:
            raise ProtocolError(f"unexpected frame kind {kind} from {link.label}")

    def wake_after_read(self, link: Link, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)``, which wakes another thread, once ``link``'s
        current read callback ends (at once on a transport without one).

        Waking a pool or user thread while the loop still has the rest of
        the callback to run makes that thread wait for the GIL: a second
        wake-up.
        """
        if link.after_read is None:
            fn(*args)
        else:
            self._wakeups.append((fn, args))

    def flush_wakeups(self) -> None:
        """End of a read callback: run the wake-ups it held back."""
        wakeups = self._wakeups
        while wakeups:
            batch = wakeups[:]
            wakeups.clear()
            for fn, args in batch:
                try:
                    fn(*args)
                except Exception:
                    _shutdown.log.exception("error waking a thread for %r", fn)

    def peer_failed(self, dst: int, exc: RpcdistError) -> None:
        """The link to ``dst`` ended: fail what waits on it (on the loop); a
        link that ended under us makes us probe ``dst`` (:mod:`._liveness`)."""
        self.calls.fail_peer(dst, exc)
        self.mailbox.fail_all(dst, type(exc)(str(exc)))
        if isinstance(exc, WorkerLostError):
            self.liveness.probe(dst, str(exc))

    def peer_lost(self, rank: int) -> None:
        """Worker ``rank`` was declared lost (:mod:`._liveness`): tell the
        extensions, once (on the loop)."""
        for ext in list(self.registry.extensions.values()):
            try:
                ext.peer_lost(rank)
            except Exception:
                _shutdown.log.exception("extension %r on the loss of rank %d", ext.name, rank)

    def _no_calls(self) -> bool:
        return not len(self.calls) and not self.sync.inflight

    # ------------------------------------------------------------- the loop

    def run(self, coro: Coroutine[Any, Any, T], what: str = "this call") -> T:
        """Run a coroutine on the agent loop, blocking (not on the loop thread).

        Raises:
            WrongThreadError: called on the loop thread.
            NotInitializedError: the agent has shut down.
        """
        if self.closed:
            coro.close()
            self.check_open()
        return self._loop_thread.run(coro, what)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule a coroutine on the agent loop from any thread; a Future of its result."""
        return self._loop_thread.submit(coro)

    def in_loop_thread(self) -> bool:
        return self._loop_thread.in_loop_thread()

    def check_not_loop_thread(self, what: str) -> None:
        """Raises: WrongThreadError: called on the agent's loop thread."""
        self._loop_thread.check_not_loop_thread(what)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Start a tracked background task on the loop (call on the loop)."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ----------------------------------------------------------- statistics

    def statistics(self) -> dict[str, int]:
        """Counters for tests and debugging; every gauge is 0 when idle."""
        return _doctor.statistics(self)

    # --------------------------------------------------------------- shutdown

    def debug_info(self) -> dict[str, Any]:
        """What this worker has outstanding now; see ``rpcdist.debug_info``."""
        return _doctor.snapshot(self)

    def shutdown(self, graceful: bool = True, timeout: float | None = None) -> list[WorkerInfo]:
        """Shut this agent down; see ``rpcdist.shutdown``. Returns the workers a
        graceful shutdown went on without (lost before or during it).

        Raises:
            RpcTimeoutError: a graceful shutdown did not finish within ``timeout``.
            WrongThreadError: called on the agent's loop thread.
        """
        if self.closed:
            return []
        self._loop_thread.check_not_loop_thread("shutdown()")
        clean = False
        try:
            if self.membership is not None:
                how = _members.shutdown(self, self.membership, graceful, timeout)
            else:
                how = _shutdown.shutdown(self, graceful, timeout)
            skipped = self._loop_thread.run(how, "shutdown()")
            clean = graceful
            return skipped
        finally:
            # After a timeout, do not wait for handlers still running user code
            # (they cannot be interrupted); the caller asked for a bound.
            self._stop_threads(wait=clean)

    def _stop_threads(self, wait: bool) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=not wait)
        # (idempotent; a start that failed has not closed them)
        for part in ("sync", "sync_serving", "busy_poll"):
            closing = getattr(self, part, None)
            if closing is not None:
                closing.close()
        serving = getattr(self, "sync_serving", None)
        if serving is not None:
            serving.join(None if wait else 1.0)
            self.busy_poll.stop_watching()
        self._loop_thread.stop()
