"""Installing RRef support on an agent (a built-in extension, see ``_rpc._registry``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._context import ACCEPTS, RRefContext, control_handlers
from ._owner import owner_handlers
from ._rref import accepts_in_reply  # (importing it registers the RRef codec extension)

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = ["install"]


def install(agent: Agent) -> RRefContext:
    """Give ``agent`` its RRef tables and the protocol's internal methods."""

    def make() -> RRefContext:
        for method, handler in {**control_handlers(), **owner_handlers()}.items():
            agent.registry.add_handler(method, handler)
        agent.registry.add_reply_field(ACCEPTS, accepts_in_reply)
        return RRefContext(agent)

    return agent.extension("rref", make)
