"""What a device extension uses of the agent it is installed on.

The device package sits below the RPC layer, so it names the agent only by
these protocols; the agent satisfies them, and installs the extensions
itself (see the package docstring).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .._options import RpcOptions
from .._serialization._hooks import CodecHooks
from .._worker import WorkerInfo

__all__ = ["Handler", "Host", "Outbox"]

#: An internal handler: ``await handler(host, src, payload)`` on the loop.
Handler = Callable[[Any, WorkerInfo, Any], Awaitable[Any]]


class Outbox(Protocol):
    """Idempotent control items for peers, sent in batches (the agent's
    ``ControlOutbox``)."""

    def post(self, peer: int, item: Any) -> None: ...

    def drop(self, peer: int) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


class _Peer(Protocol):
    @property
    def same_host(self) -> bool: ...


class _Links(Protocol):
    def peer(self, rank: int) -> _Peer: ...


class _Registry(Protocol):
    def add_handler(self, method: str, handler: Handler) -> None: ...

    def install(self, ext: Any) -> None: ...


class _Workers(Protocol):
    def __getitem__(self, rank: int) -> WorkerInfo: ...


class Host(Protocol):
    """The agent, as a device extension sees it."""

    @property
    def rank(self) -> int: ...
    @property
    def options(self) -> RpcOptions: ...
    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...
    @property
    def workers(self) -> _Workers: ...
    @property
    def links(self) -> _Links: ...
    @property
    def registry(self) -> _Registry: ...
    @property
    def codec_hooks(self) -> CodecHooks: ...

    async def send_control(self, dst: int, method: str, payload: Any) -> Any: ...
