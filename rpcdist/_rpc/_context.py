"""Which agent is current, for the layers above the agent.

The per-message context the codec sees (:class:`~._wire.WireContext`) and
the binding of an agent to a task live in :mod:`._wire`, below the agent;
this module adds what needs the :class:`~._agent.Agent` type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from .._errors import NotInitializedError
from . import _wire
from ._wire import WireContext, bind_agent, reset_agent, set_default_agent

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = [
    "WireContext",
    "bind_agent",
    "current_agent",
    "default_agent",
    "reset_agent",
    "set_default_agent",
]


def default_agent() -> Agent | None:
    """The process's default agent (the one ``init_rpc`` made), if any."""
    return cast("Agent | None", _wire.default_agent())


def current_agent() -> Agent:
    """The agent calls made from here go out through.

    Raises:
        NotInitializedError: no agent is current and none was initialised.
    """
    agent = _wire.bound_agent() or _wire.default_agent()
    if agent is None or agent.closed:
        raise NotInitializedError(
            "RPC has not been initialized (Current RPC agent is not set! Did you initialize "
            "the RPC framework?): rpcdist is not initialised in this process: "
            "call rpcdist.init_rpc() first"
            + (" (the agent has shut down)" if agent is not None else "")
        )
    return cast("Agent", agent)
