"""Which agent is current, and the per-message context the codec sees."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from ._errors import NotInitializedError, RpcTimeoutError
from ._worker import WorkerInfo

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["WireContext", "current_agent", "set_default_agent"]

#: The agent running the handler in this task or thread (several agents may
#: live in one process, e.g. in tests); falls back to the process default.
_current: contextvars.ContextVar[Agent | None] = contextvars.ContextVar(
    "rpcdist_agent", default=None
)
_default: list[Agent | None] = [None]


def set_default_agent(agent: Agent | None) -> None:
    _default[0] = agent


def default_agent() -> Agent | None:
    return _default[0]


def current_agent() -> Agent:
    """The agent calls made from here go out through.

    Raises:
        NotInitializedError: no agent is current and none was initialised.
    """
    agent = _current.get() or _default[0]
    if agent is None or agent.closed:
        raise NotInitializedError(
            "rpcdist is not initialised in this process: call rpcdist.init_rpc() first"
            + (" (the agent has shut down)" if agent is not None else "")
        )
    return agent


def bind_agent(agent: Agent | None) -> contextvars.Token[Agent | None]:
    return _current.set(agent)


def reset_agent(token: contextvars.Token[Agent | None]) -> None:
    _current.reset(token)


class WireContext:
    """What the codec's extensions (RRefs, tensors) know about one message.

    Attributes:
        agent: The local agent.
        peer: The worker the message goes to or came from.
        gates: Awaitables that must complete before a received call runs
            (for example, confirmations of the user RRefs among its arguments).
        extra: Free-form state for extensions.
    """

    __slots__ = ("agent", "extra", "gated", "gates", "peer")

    def __init__(self, agent: Agent, peer: WorkerInfo, *, gated: bool = True) -> None:
        self.agent = agent
        self.peer = peer
        #: Whether decoding adds ``gates`` (only a received call waits on
        #: them; a reply decoded off the loop must not create loop futures).
        self.gated = gated
        self.gates: list[Awaitable[Any]] = []
        self.extra: dict[str, Any] = {}

    def abort(self) -> None:
        """The message will not be sent: undo what extensions did while encoding it.

        Runs the callables extensions put in ``extra["undo"]`` (for example,
        forgetting RRef forks made for it); encodes with this context from now
        on are dry runs (``extra["aborted"]``), for locating an encoding error.
        """
        self.extra["aborted"] = True
        for undo in self.extra.pop("undo", ()):
            undo()

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
                raise RpcTimeoutError(
                    f"a call from {self.peer.name!r} waited past its deadline for its "
                    "arguments (RRefs not yet confirmed by their owners)"
                ) from None
