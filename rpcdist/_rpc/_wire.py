"""The per-message context the codec sees, and the agent bound to this task
or thread (the current agent, as :mod:`._context` gives it to the layers
above, is read from here)."""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import TYPE_CHECKING, Any

from .._errors import RpcTimeoutError
from .._serialization._hooks import CodecHooks
from .._transport._frames import Meta
from .._worker import WorkerInfo

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["WireContext", "bind_agent", "bound_agent", "reset_agent", "set_default_agent"]

#: The agent running the handler in this task or thread (several agents may
#: live in one process, e.g. in tests); falls back to the process default.
_current: contextvars.ContextVar[AgentView | None] = contextvars.ContextVar(
    "rpcdist_agent", default=None
)
_default: list[AgentView | None] = [None]


def set_default_agent(agent: AgentView | None) -> None:
    _default[0] = agent


def default_agent() -> AgentView | None:
    return _default[0]


def bound_agent() -> AgentView | None:
    """The agent bound to this task or thread, if any (no default)."""
    return _current.get()


def bind_agent(agent: AgentView | None) -> contextvars.Token[AgentView | None]:
    return _current.set(agent)


def reset_agent(token: contextvars.Token[AgentView | None]) -> None:
    _current.reset(token)


class WireContext:
    """What the codec's extensions (RRefs, tensors) know about one message.

    Attributes:
        agent: The local agent: an ``Agent``, which the extensions above the
            agent use as one (so typed ``Any`` here, below the agent).
        peer: The worker the message goes to or came from.
        meta: The message's named extension fields (``None``: none), e.g. the
            autograd context a call or reply travels in.
        gates: What must complete before a received call runs (for example,
            confirmations of the user RRefs among its arguments): loop
            awaitables, or ``rpcdist.Future`` objects when ``off_loop``.
        reply_meta: For a call being handled, the named fields its reply
            will carry besides ``meta`` (extensions add to it while decoding
            the arguments; see ``Registry.add_reply_field``); ``None`` for
            every other message.
        extra: Free-form state for extensions.
    """

    __slots__ = ("agent", "extra", "gates", "meta", "off_loop", "peer", "reply_meta")

    def __init__(
        self,
        agent: AgentView,
        peer: WorkerInfo,
        *,
        off_loop: bool = False,
        meta: Meta | None = None,
        reply_meta: Meta | None = None,
    ) -> None:
        self.agent: Any = agent
        self.peer = peer
        self.meta = meta
        self.reply_meta = reply_meta
        #: Decoding on a thread other than the agent loop's: ``gates`` then
        #: holds ``rpcdist.Future`` objects to wait on, not loop awaitables.
        self.off_loop = off_loop
        self.gates: list[Any] = []
        self.extra: dict[str, Any] = {}

    @property
    def codec_hooks(self) -> CodecHooks:
        """The codec hooks the agent's extensions registered (see ``_serialization._hooks``)."""
        hooks: CodecHooks = self.agent.codec_hooks
        return hooks

    def abort(self) -> None:
        """The message will not be sent: undo what extensions did while encoding it.

        Runs the callables extensions put in ``extra["undo"]`` (for example,
        forgetting RRef forks made for it); encodes with this context from now
        on are dry runs (``extra["aborted"]``), for locating an encoding error.
        Idempotent: an ``OutMessage`` whose ``undo`` this is may call it again.
        """
        self.extra["aborted"] = True
        for undo in self.extra.pop("undo", ()):
            undo()

    def wait_gates_blocking(self, deadline: float | None = None) -> None:
        """:meth:`wait_gates` for an ``off_loop`` context, blocking this thread.

        Raises:
            RpcTimeoutError: they were not all done before ``deadline``.
            Exception: what a gate failed with (e.g. its owner was lost).
        """
        gates, self.gates = self.gates, []
        for fut in gates:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                fut.wait(left)
            except RpcTimeoutError:
                if not fut.done():  # (else the gate itself failed with a timeout)
                    raise self._late() from None
                raise

    def _late(self) -> RpcTimeoutError:
        return RpcTimeoutError(
            f"a call from {self.peer.name!r} waited past its deadline for its "
            "arguments (RRefs not yet confirmed by their owners)"
        )

    async def wait_gates(self, deadline: float | None = None) -> None:
        """Wait for the gates, until ``deadline`` (the ``time.monotonic()`` clock) at most.

        Raises:
            RpcTimeoutError: they were not all done before ``deadline``.
        """
        if self.gates:
            gates, self.gates = self.gates, []
            try:
                async with asyncio.timeout_at(deadline):
                    await asyncio.gather(*gates)
            except TimeoutError:
                raise self._late() from None
