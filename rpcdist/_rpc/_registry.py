"""What the layers above the agent plug into it: extensions, internal
handlers, handler scopes and call metadata.

Each agent has one :class:`Registry`. The layers above RPC (RRefs,
collectives, distributed autograd) are *extensions*: objects with a name,
statistics and shutdown steps, registered on the agent, which add

* **internal handlers**: control methods (``"rref.fork_request"``) run on
  the agent loop as ``await handler(agent, src, payload)``;
* **handler scopes**: context managers the agent enters around every
  incoming call's user function and the encoding of its reply, on whichever
  thread runs it (``scope(call) -> context manager | None``); an autograd
  context or a trace span is bound here;
* **metadata sources**: ``source() -> dict | None``, asked for named fields
  to attach to each outgoing call and reply made from this thread or task
  (an autograd context id travels this way). They are not asked for
  control messages;
* **reply fields**: named fields a handled call's reply carries back to its
  caller besides those (``WireContext.reply_meta``, filled while its
  arguments are decoded), each handed to ``handler(agent, src, value)`` on
  whichever thread reads the reply, late replies included: the owner of an
  RRef passed back to it confirms the sender's fork this way, saving a
  control message and its acknowledgement per call;
* **riders**: items an extension would otherwise send one peer in a control
  message, which travel instead in the next call made to that peer
  (``take(peer, wire)`` is asked as the call is encoded, and is told of a
  call that is never sent through ``wire``'s undo list); the callee hands
  them to ``receive(agent, src, value, wire)`` as the call arrives, before
  its arguments are decoded, and acknowledges them with a reply field.
  Distributed autograd sends context releases this way: a training loop's
  next call carries them, and neither worker's loop wakes for them.

The contract on timing: a worker may receive an extension's messages as soon
as any peer can send them, so an extension whose handlers, scopes or codec
entries a peer may need is registered before this agent can be reached
(when the agent is made: RRefs, autograd), or before a collective step
that every peer passes before sending it anything (collectives register
theirs before their setup's store barrier). A message naming an unknown
internal method is answered with ``ProtocolError``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .._errors import ConfigError
from .._transport._frames import Meta
from .._worker import WorkerInfo

__all__ = [
    "BUILTIN_EXTENSIONS",
    "BaseExtension",
    "CallInfo",
    "Extension",
    "HandlerScope",
    "InternalHandler",
    "MetaSource",
    "Registry",
    "ReplyField",
    "RiderReceive",
    "RiderTake",
]

E = TypeVar("E", bound="Extension")

#: Extensions every agent installs when it is made, as ``"module:callable"``
#: called with the agent, in the manner of entry points: the RPC layer names
#: the layers above it but never imports them at module level.
BUILTIN_EXTENSIONS = (
    "rpcdist._rref._extension:install",
    "rpcdist.autograd._extension:install",
    "rpcdist._rpc._devices:install",
    "rpcdist.torch._extension:install",
    "rpcdist.torch._extension:install_profiling",
)

# The registry sits below the agent and hands what it is given through: in
# these signatures the first ``Any`` is the ``Agent`` and ``wire`` arguments
# are ``WireContext`` objects (each plug-in declares its own parameter types).
InternalHandler = Callable[[Any, WorkerInfo, Any], Awaitable[Any]]
MetaSource = Callable[[], "Meta | None"]
ReplyField = Callable[[Any, WorkerInfo, Any], None]
RiderTake = Callable[[int, Any], Any]
RiderReceive = Callable[[Any, WorkerInfo, Any, Any], None]


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a handler scope knows of the incoming call it wraps.

    Attributes:
        agent: The agent running the call (an ``Agent``).
        peer: The caller.
        method: The function name or internal method.
        meta: The call's named extension fields (``None``: none).
        deadline: Its absolute deadline (``time.monotonic()``), if any.
    """

    agent: Any
    peer: WorkerInfo
    method: str
    meta: Meta | None
    deadline: float | None


HandlerScope = Callable[[CallInfo], "AbstractContextManager[Any] | None"]


class Extension(Protocol):
    """A per-agent layer above RPC (see the module docstring)."""

    #: Key under which the agent keeps it, and prefix of its statistics.
    name: str

    def statistics(self) -> Mapping[str, int]:
        """Gauges (0 when idle) and counters, merged into the agent's."""

    async def drain(self) -> None:
        """Graceful shutdown, on the loop, before the agent waits for quiet:
        finish this layer's own traffic (collective: every worker runs it)."""

    def check(self) -> None:
        """After a graceful shutdown closed the agent: raise what ``drain``
        found wrong (for example, leaked RRefs)."""

    def close(self) -> None:
        """The agent closed, gracefully or not (any thread)."""

    def peer_lost(self, rank: int) -> None:
        """Worker ``rank`` was declared lost (``_liveness``): it died, shut
        down without us, hung, or the network to it failed. Called once per
        worker, on the loop; the agent has already failed its pending calls
        and it stays lost."""


class BaseExtension:
    """An :class:`Extension` with nothing to count, drain, check or close."""

    name = ""

    def statistics(self) -> Mapping[str, int]:
        return {}

    async def drain(self) -> None:
        return None

    def check(self) -> None:
        return None

    def close(self) -> None:
        return None

    def peer_lost(self, rank: int) -> None:
        return None


class Registry:
    """One agent's extensions and what they registered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.handlers: dict[str, InternalHandler] = {}
        #: Tuples, replaced whole, so readers on other threads need no lock.
        self.scopes: tuple[HandlerScope, ...] = ()
        #: Scopes for every call, and scopes only for calls with named fields.
        self.any_scopes: tuple[HandlerScope, ...] = ()
        self.meta_scopes: tuple[HandlerScope, ...] = ()
        self.sources: tuple[MetaSource, ...] = ()
        #: Replaced whole, like the tuples.
        self.reply_fields: dict[str, ReplyField] = {}
        self.riders: dict[str, tuple[RiderTake, RiderReceive]] = {}
        self.extensions: dict[str, Extension] = {}

    def add_handler(self, method: str, handler: InternalHandler) -> None:
        """Serve internal ``method`` with ``handler``.

        Raises:
            ConfigError: another handler serves ``method``.
        """
        with self._lock:
            if method in self.handlers and self.handlers[method] is not handler:
                raise ConfigError(f"internal method {method!r} is already registered")
            self.handlers[method] = handler

    def add_scope(self, scope: HandlerScope, *, with_meta_only: bool = False) -> None:
        """Enter ``scope`` around every incoming call's handler; with
        ``with_meta_only``, only around calls that carry named fields (a
        call with none then pays nothing for it)."""
        with self._lock:
            if with_meta_only:
                self.meta_scopes = (*self.meta_scopes, scope)
            else:
                self.any_scopes = (*self.any_scopes, scope)
            self.scopes = (*self.any_scopes, *self.meta_scopes)

    def add_source(self, source: MetaSource) -> None:
        with self._lock:
            self.sources = (*self.sources, source)

    def add_reply_field(self, name: str, handler: ReplyField) -> None:
        """Hand field ``name`` of every reply's metadata to ``handler``.

        Raises:
            ConfigError: another handler takes ``name``.
        """
        with self._lock:
            if self.reply_fields.get(name, handler) is not handler:
                raise ConfigError(f"reply field {name!r} is already registered")
            self.reply_fields = {**self.reply_fields, name: handler}

    def add_rider(self, name: str, take: RiderTake, receive: RiderReceive) -> None:
        """Carry field ``name`` in calls: ``take(peer, wire)`` gives the value
        for the next call to ``peer`` (``None``: nothing), ``receive`` takes it
        at the callee (see the module docstring).

        Raises:
            ConfigError: another rider takes ``name``.
        """
        with self._lock:
            if name in self.riders and self.riders[name] != (take, receive):
                raise ConfigError(f"rider {name!r} is already registered")
            self.riders = {**self.riders, name: (take, receive)}

    def ride(self, peer: int, wire: Any, meta: Meta | None) -> Meta | None:
        """``meta`` with what the riders have for ``peer`` (a call's, any thread)."""
        for name, (take, _) in self.riders.items():
            value = take(peer, wire)
            if value is not None:
                meta = {**meta, name: value} if meta else {name: value}
        return meta

    def on_call(self, agent: Any, peer: WorkerInfo, meta: Meta | None, wire: Any) -> None:
        """A call from ``peer`` arrived with ``meta`` (any thread, before its
        arguments are decoded): hand the riders' fields to their receivers."""
        if meta:
            for name, (_, receive) in self.riders.items():
                value = meta.get(name)
                if value is not None:
                    receive(agent, peer, value, wire)

    def on_reply(self, agent: Any, peer: WorkerInfo, meta: Meta | None) -> None:
        """A reply from ``peer`` arrived with ``meta`` (any thread, before it
        is decoded): run the handlers of the reply fields it carries."""
        if meta:
            for name, handler in self.reply_fields.items():
                value = meta.get(name)
                if value is not None:
                    handler(agent, peer, value)

    def extension(self, name: str, make: Callable[[], E]) -> E:
        """The extension ``name``, made (and so registered) on first use."""
        ext = self.extensions.get(name)
        if ext is None:
            with self._lock:
                ext = self.extensions.get(name)
            if ext is None:
                made = make()  # registers its handlers (takes the lock itself)
                with self._lock:
                    ext = self.extensions.setdefault(name, made)
        return ext  # type: ignore[return-value]

    def install(self, ext: Extension) -> None:
        """Register ``ext`` (already made) under its name.

        Raises:
            ConfigError: an extension of that name is installed.
        """
        with self._lock:
            if ext.name in self.extensions:
                raise ConfigError(f"extension {ext.name!r} is already installed")
            self.extensions[ext.name] = ext

    def remove(self, name: str) -> None:
        """Forget extension ``name`` (its handlers stay; they find it gone)."""
        with self._lock:
            self.extensions.pop(name, None)

    def meta(self) -> Meta | None:
        """The named fields this thread or task's next call or reply carries."""
        sources = self.sources
        if len(sources) == 1:  # the usual case (distributed autograd): no merging
            return sources[0]()
        if not sources:
            return None
        meta: Meta | None = None
        for source in sources:
            got = source()
            if got:
                meta = got if meta is None else {**meta, **got}
        return meta

    def wants_scopes(self, meta: Meta | None) -> bool:
        """Whether a call with ``meta`` has any scope to enter (cheap)."""
        return bool(self.any_scopes) or (meta is not None and bool(self.meta_scopes))

    def enter_scopes(self, call: CallInfo) -> AbstractContextManager[Any] | None:
        """Enter every handler scope for ``call``; ``None`` when none applies.

        Returns what to exit (with the exception, if any) once the handler
        has run and its reply is encoded: the one scope entered, or a stack
        of several.
        """
        scopes = self.scopes if call.meta is not None else self.any_scopes
        if not scopes:
            return None
        entered: list[AbstractContextManager[Any]] = []
        try:
            for scope in scopes:
                cm = scope(call)
                if cm is not None:
                    cm.__enter__()
                    entered.append(cm)
        except BaseException as e:
            for cm in reversed(entered):
                cm.__exit__(type(e), e, e.__traceback__)
            raise
        if not entered:
            return None
        if len(entered) == 1:
            return entered[0]
        stack = contextlib.ExitStack()
        for cm in entered:
            stack.push(cm)
        return stack
