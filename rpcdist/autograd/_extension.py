"""Distributed autograd on one agent: its contexts, what it plugs into the agent,
and their release.

Installed on every agent when it is made (a built-in extension), because any
worker may receive a call made inside a context:

* a **metadata source** puts ``{"ad": context id}`` on every call and reply
  made inside a context (even with no tensor that requires grad: a parameter
  server's reply may carry one);
* a **handler scope** makes that context current around the handler of a
  call that carries it (made here on first sight), so nested calls and the
  reply carry it too;
* **internal methods**: ``autograd.reach`` (is a receive function reached
  in a pass?),
  ``autograd.release`` (free a context), ``autograd.rref_backward`` and
  ``autograd.ping`` (which of these contexts do you hold?); gradient messages are plain calls of
  ``_backward.apply_grads``.

Leaving ``with context()`` releases the context here and sends
``autograd.release`` to every worker it exchanged messages with; each frees
its copy and passes the release on to the workers *it* knows, each message
retried until acknowledged. Releases for one peer travel in batches (see
``RELEASE_DELAY``), and ride on the next call made to that peer when one
comes first (a registry rider, field ``"ar"``, acknowledged by the reply's
field ``"ar+"``): a training loop's next step carries the last one's
releases, and neither worker's event loop wakes for them. A context whose
creator is lost is freed after ``lease`` seconds, unless the creator's
rank answers that it holds it still (PyTorch leaks these:
pytorch/pytorch#26379); a restarted creator (a dynamic group) holds none of
its predecessor's, and makes other ids (``_context.IdMaker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._errors import AutogradError, ConfigError, RpcdistError
from .._rpc._context import bind_agent, reset_agent
from .._rpc._outbox import ControlOutbox
from .._rpc._registry import BaseExtension, CallInfo
from .._worker import WorkerInfo
from . import _backward
from ._codec import register_tensor_codec
from ._context import CURRENT, DistContext, IdMaker

if TYPE_CHECKING:
    from .._rpc._agent import Agent
    from .._rpc._context import WireContext

__all__ = [
    "GRADS",
    "PING",
    "REACH",
    "RELEASE",
    "RREF_BACKWARD",
    "AutogradExtension",
    "LossBackward",
    "LossHook",
    "ext",
    "install",
]

_log = logging.getLogger(__name__)

GRADS = _backward.GRADS
REACH = "autograd.reach"
RELEASE = "autograd.release"
RREF_BACKWARD = "autograd.rref_backward"
PING = "autograd.ping"
#: ``run(context_id, loss, retain_graph)``: a pass over another library's graph.
LossBackward = Callable[[int, Any, bool], None]
#: How ``RRef.backward`` runs from a loss this engine does not own: a hook
#: returns a ``LossBackward`` for the losses it knows, else ``None``
#: (``rpcdist.torch`` registers one for torch tensors on every agent; see
#: :meth:`AutogradExtension.add_loss_hook`).
LossHook = Callable[[Any], LossBackward | None]
#: Call metadata: releases riding on a call, and the reply's acknowledgement.
RIDING = "ar"
RELEASED = "ar+"
#: Seconds a context outlives the loss of its creator (lets failing passes end).
LEASE = 5.0
#: Releases for one peer wait this long (seconds) for others to travel with,
#: or until there are ``RELEASE_BATCH`` of them: a training loop of short
#: iterations then sends one release message per batch, not one per step.
RELEASE_DELAY = 0.01
RELEASE_BATCH = 16


class AutogradExtension(BaseExtension):
    """One agent's distributed autograd contexts (see the module docstring)."""

    name = "autograd"

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.ids = IdMaker(agent.rank)
        self.lease = LEASE
        self._lock = threading.Lock()
        self._contexts: dict[int, DistContext] = {}
        self._releases: set[asyncio.Task[None]] = set()
        #: Releases of contexts freed here, on their way to the peers that know them.
        self._outbox = ControlOutbox(agent, RELEASE, delay=RELEASE_DELAY, batch=RELEASE_BATCH)
        self._lease_timer: asyncio.TimerHandle | None = None
        self.released = 0
        #: Asked in order for a loss of another library (replaced whole).
        self.loss_hooks: tuple[LossHook, ...] = ()

    def add_loss_hook(self, hook: LossHook) -> None:
        """Let ``RRef.backward`` on this agent run from the losses ``hook``
        knows (idempotent)."""
        with self._lock:
            if hook not in self.loss_hooks:
                self.loss_hooks = (*self.loss_hooks, hook)

    # ------------------------------------------------------------ contexts

    def new_context(self) -> DistContext:
        ctx = DistContext(self.ids.new(), self.agent.rank)
        with self._lock:
            self._contexts[ctx.id] = ctx
        return ctx

    def context(self, context_id: int) -> DistContext:
        """Context ``context_id``, made here on first sight (any thread)."""
        ctx = self._contexts.get(context_id)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(context_id)
                if ctx is None:
                    ctx = self._contexts[context_id] = DistContext(context_id, self.agent.rank)
        return ctx

    def get(self, context_id: int, what: str) -> DistContext:
        """Raises: AutogradError: no such context on this worker."""
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise AutogradError(
                f"Could not find autograd context with id: {context_id} ({what}: it does not "
                f"exist on worker {self.agent.name!r}: never made here, or already released)"
            )
        return ctx

    def forget_send(self, context_id: int, message_id: int) -> None:
        """A message recorded in a send function was never sent (undo)."""
        ctx = self._contexts.get(context_id)
        if ctx is not None:
            with ctx.lock:
                ctx.sends.pop(message_id, None)

    # --------------------------------------------- what the agent calls

    def scope(self, call: CallInfo) -> contextlib.AbstractContextManager[None] | None:
        meta = call.meta
        if not meta:
            return None
        context_id = meta.get("ad")
        if not isinstance(context_id, int):
            return None
        self.context(context_id).touch(call.peer.id)
        return _bound(context_id)

    def source(self) -> dict[str, object] | None:
        context_id = CURRENT.get()
        if context_id is None:
            return None
        return {"ad": context_id}

    # ------------------------------------------------------------- release

    def release(self, context_id: int, src: int | None = None) -> None:
        """Free ``context_id`` here and tell the workers it knows (any thread)."""
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
        if ctx is None:
            return
        ctx.released = True
        self.released += 1
        peers = sorted(ctx.known - {self.agent.rank, src if src is not None else -1})
        _clear(ctx)
        if not peers or self.agent.closed:
            return
        for peer in peers:
            self._outbox.post(peer, context_id)

    def take_releases(self, peer: int, wire: WireContext) -> list[Any] | None:
        """The releases waiting for ``peer``, to ride on a call there (a
        registry rider): ``[token, context ids]``; given back if the call is
        never sent."""
        got = self._outbox.take(peer)
        if got is None:
            return None
        token, ids = got
        wire.extra.setdefault("undo", []).append(lambda: self._outbox.returned(token))
        return [token, ids]

    def receive_releases(
        self, agent: Agent, src: WorkerInfo, value: Any, wire: WireContext
    ) -> None:
        """Releases that rode on a call from ``src``: free them, and say so in the reply."""
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], list)):
            return  # (malformed: the sender resends them the usual way)
        token, ids = value
        if wire.reply_meta is not None:
            wire.reply_meta[RELEASED] = token
        # Freed once the reply is out: the caller waits for the reply, not for this.
        wire.extra.setdefault("after_reply", []).append(lambda: self._release_all(ids, src.id))

    def _release_all(self, ids: list[Any], src: int) -> None:
        for context_id in ids:
            if type(context_id) is int:
                self.release(context_id, src=src)

    def on_released(self, agent: Agent, src: WorkerInfo, token: Any) -> None:
        """A reply acknowledged the releases that rode under ``token``."""
        self._outbox.delivered(token)

    def peer_lost(self, rank: int) -> None:
        """Worker ``rank`` is gone: its contexts here are freed after the lease."""
        self._outbox.drop(rank)  # (its copies went with it: nothing to release there)
        orphans = [c for c in list(self._contexts.values()) if c.creator == rank]
        for ctx in orphans:
            ctx.orphan()
        if orphans and self._lease_timer is None and not self.agent.closed:
            try:
                self.agent.loop.call_soon_threadsafe(self._arm_lease)
            except RuntimeError:
                pass

    def _arm_lease(self) -> None:
        if self._lease_timer is None:
            self._lease_timer = self.agent.loop.call_later(self.lease / 4, self._expire_leases)

    def _expire_leases(self) -> None:
        self._lease_timer = None
        now = time.monotonic()
        due: dict[int, list[DistContext]] = {}
        waiting = False
        for ctx in list(self._contexts.values()):
            if ctx.orphaned_at is None:
                continue
            if now - ctx.orphaned_at >= self.lease:
                due.setdefault(ctx.creator, []).append(ctx)
            else:
                waiting = True
        for creator, contexts in due.items():
            task = self.agent.loop.create_task(self._free_if_gone(creator, contexts))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        if waiting:
            self._arm_lease()

    async def _free_if_gone(self, creator: int, contexts: list[DistContext]) -> None:
        """Free ``contexts`` unless their creator answers that it still holds
        them (a link of its may have ended for another reason: it then keeps
        them). A worker that answers for the creator's rank but does not hold
        them is a restarted one (a dynamic group): they are its predecessor's."""
        ids = [ctx.id for ctx in contexts]
        try:
            deadline = time.monotonic() + min(self.lease, 2.0)
            held = await self.agent.call(
                creator, PING, ids, deadline=deadline, meta=None, internal=True
            )
        except RpcdistError:
            held = []
        kept = set(held) if isinstance(held, list) else set()
        for ctx in contexts:
            if ctx.id in kept:
                ctx.orphaned_at = None
            elif ctx.orphaned_at is not None:
                _log.info("freeing autograd context %d: its creator was lost", ctx.id)
                self.release(ctx.id, src=ctx.creator)

    # ---------------------------------------------------------- extension

    def statistics(self) -> Mapping[str, int]:
        return {
            "autograd_contexts": len(self._contexts),
            "autograd_released": self.released,
            "autograd_releases_inflight": len(self._releases) + self._outbox.pending(),
        }

    async def drain(self) -> None:
        """Graceful shutdown: send the queued releases and let them be acknowledged."""
        await self._outbox.drain()
        if self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)

    def close(self) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()
        self._outbox.close()
        with self._lock:
            contexts, self._contexts = list(self._contexts.values()), {}
        for ctx in contexts:
            ctx.released = True
            _clear(ctx)

    def contexts(self) -> int:
        return len(self._contexts)

    def holding(self, context_ids: list[Any]) -> list[int]:
        """Those of ``context_ids`` that are live here."""
        return [c for c in context_ids if type(c) is int and c in self._contexts]


def _clear(ctx: DistContext) -> None:
    with ctx.lock:
        ctx.sends.clear()
        ctx.recvs.clear()
        ctx.grads.clear()
        ctx.passes.clear()
        ctx.extras.clear()


class _bound:
    """Context ``context_id`` is current inside."""

    __slots__ = ("_id", "_token")

    def __init__(self, context_id: int) -> None:
        self._id = context_id
        self._token: contextvars.Token[int | None] | None = None

    def __enter__(self) -> None:
        self._token = CURRENT.set(self._id)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            CURRENT.reset(self._token)


# ----------------------------------------------------------------- handlers


async def _on_release(agent: Agent, src: WorkerInfo, context_ids: list[int]) -> None:
    e = ext(agent)
    for context_id in context_ids:  # (a batch: see ControlOutbox)
        if type(context_id) is int:
            e.release(context_id, src=src.id)


async def _on_ping(agent: Agent, src: WorkerInfo, payload: Any) -> list[int]:
    """Which of the contexts ``payload`` names (ids this worker's rank made)
    this worker holds (a restarted worker holds none of its predecessor's)."""
    return ext(agent).holding(payload) if isinstance(payload, list) else []


def _check_loss(loss: Any) -> None:
    """Raises: ConfigError: ``loss`` is not a tensor (torch's text first)."""
    if not callable(getattr(loss, "backward", None)):
        raise ConfigError(
            "RRef should contain a tensor for .backward(), got a "
            f"{type(loss).__name__} (RRef.backward runs a pass from the tensor it holds)"
        )


async def _on_rref_backward(agent: Agent, src: WorkerInfo, payload: list[Any]) -> None:
    rref, context_id, retain_graph = payload
    loss = rref.local_value()
    _check_loss(loss)
    for hook in ext(agent).loss_hooks:
        run = hook(loss)
        if run is not None:  # a loss of another library's: its own pass
            await agent.loop.run_in_executor(
                agent.executor, _as_agent, agent, run, context_id, loss, retain_graph
            )
            return
    token = CURRENT.set(context_id)
    try:
        await agent.loop.run_in_executor(
            agent.executor, _backward.backward_blocking, agent, context_id, [loss], retain_graph
        )
    finally:
        CURRENT.reset(token)


def _as_agent(
    agent: Agent, run: LossBackward, context_id: int, loss: Any, retain_graph: bool
) -> None:
    token = bind_agent(agent)
    try:
        run(context_id, loss, retain_graph)
    finally:
        reset_agent(token)


def ext(agent: Agent) -> AutogradExtension:
    """The distributed autograd extension of ``agent``.

    Raises:
        AutogradError: the agent has none (made without built-in extensions).
    """
    found = agent.registry.extensions.get("autograd")
    if not isinstance(found, AutogradExtension):
        raise AutogradError(f"the rpcdist agent {agent.name!r} has no distributed autograd")
    return found


def install(agent: Agent) -> AutogradExtension:
    """Give ``agent`` distributed autograd (a built-in extension, see ``_rpc._registry``)."""
    register_tensor_codec()

    def make() -> AutogradExtension:
        e = AutogradExtension(agent)
        registry = agent.registry
        registry.add_handler(REACH, _backward.on_reach)
        registry.add_handler(RELEASE, _on_release)
        registry.add_handler(RREF_BACKWARD, _on_rref_backward)
        registry.add_handler(PING, _on_ping)
        registry.add_scope(e.scope, with_meta_only=True)
        registry.add_source(e.source)
        registry.add_rider(RIDING, e.take_releases, e.receive_releases)
        registry.add_reply_field(RELEASED, e.on_released)
        return e

    return agent.extension("autograd", make)
