"""The agent extension behind RPC profiling (a built-in one; torch-free).

A caller profiling its calls with torch's legacy profiler asks the callee,
in the call's metadata (field ``tpq``), to profile the function it runs;
the callee's events come back in the reply's metadata (field ``tpr``) and
join the caller's profile (:mod:`rpcdist.torch._profile`). Every agent
installs this extension when it is made, so that a request is understood
from the first call: until one is made or served it registers only a
handler scope for calls that carry fields, which returns at once for
calls without the request, and it imports torch only when one arrives.
Its metadata source and reply field are registered on first use, so an
agent that never profiles pays nothing on its calls.

This module knows nothing of torch's profiler: the extension is handed the
function that serves a request (``_profile.serving``, loaded on the first
request by ``_extension.install_profiling``, the built-in installer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from .._rpc._registry import BaseExtension, CallInfo

if TYPE_CHECKING:
    from .._rpc._agent import Agent
    from .._transport._frames import Meta
    from .._worker import WorkerInfo

__all__ = ["NAME", "REPLY", "REQUEST", "ProfileExtension", "Serve", "install"]

NAME = "torch_profile"
#: The caller's request: ``[token, record_shapes, profile_memory]``.
REQUEST = "tpq"
#: The callee's events: ``[token, rows]``.
REPLY = "tpr"


#: ``serve(ext, call, request)``: the handler scope for a call asking for
#: the callee's events (``_profile.serving``).
Serve = Callable[["ProfileExtension", CallInfo, Any], "AbstractContextManager[Any] | None"]


class ProfileExtension(BaseExtension):
    """Profiles incoming calls that ask for it; see the module docstring."""

    name = NAME

    def __init__(self, agent: Agent, serve: Serve) -> None:
        self.agent = agent
        self._serve = serve
        self._lock = threading.Lock()
        self._active = False

    def activate(
        self,
        source: Callable[[], Meta | None],
        on_reply: Callable[[Agent, WorkerInfo, Any], None],
    ) -> None:
        """Register the metadata source and the reply field (once)."""
        if self._active:
            return
        with self._lock:
            if not self._active:
                self.agent.registry.add_source(source)
                self.agent.registry.add_reply_field(REPLY, on_reply)
                self._active = True

    def scope(self, call: CallInfo) -> AbstractContextManager[Any] | None:
        request = call.meta.get(REQUEST) if call.meta else None
        if request is None:
            return None
        return self._serve(self, call, request)


def install(agent: Agent, serve: Serve) -> ProfileExtension:
    """Give ``agent`` RPC profiling, serving requests with ``serve``."""

    def make() -> ProfileExtension:
        ext = ProfileExtension(agent, serve)
        agent.registry.add_scope(ext.scope, with_meta_only=True)
        return ext

    return agent.registry.extension(NAME, make)
