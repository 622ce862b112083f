"""Point-to-point links for the message-passing collectives, and their helpers.

A :class:`Link` sends a byte view to a group rank and posts receives
(optionally straight into a destination buffer). :class:`AgentLink` rides
the agent's gRPC streams; tests plug in an in-memory fake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import ClosedError, CollectiveError
from .._rpc._p2p import Message as InMessage
from ._ops import Meta

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = ["AgentLink", "Link", "Sends", "recv_checked", "run_all"]


class Link(Protocol):
    """Point-to-point messaging among the ranks of one group (group ranks)."""

    rank: int
    size: int

    def send(self, dst: int, key: str, data: memoryview, header: bytes) -> asyncio.Future[None]:
        """Start sending ``data`` now; the future completes once it may be reused."""

    def post(self, src: int, key: str, out: memoryview | None) -> asyncio.Future[InMessage]:
        """Receive the message ``key`` from ``src`` (into ``out`` when given)."""


class AgentLink:
    """A :class:`Link` over the agent's gRPC streams (``p2p_send`` / mailbox)."""

    def __init__(self, agent: Agent, ranks: Sequence[int], rank: int) -> None:
        self._agent = agent
        self._ranks = tuple(ranks)
        self.rank = rank
        self.size = len(self._ranks)

    def send(self, dst: int, key: str, data: memoryview, header: bytes) -> asyncio.Future[None]:
        coro: Coroutine[Any, Any, None] = self._agent.p2p_send(
            self._ranks[dst], key, [data], header
        )
        return asyncio.ensure_future(coro)

    def post(self, src: int, key: str, out: memoryview | None) -> asyncio.Future[InMessage]:
        if self._agent.closed:
            raise ClosedError("the rpcdist agent has shut down")
        fut: asyncio.Future[InMessage] = self._agent.mailbox.post(self._ranks[src], key, out)
        return fut


async def run_all(aws: Sequence[Awaitable[Any]]) -> list[Any]:
    """Await every awaitable; on the first failure cancel the rest and raise it.

    Raises:
        BaseException: the first failure, not wrapped in a group.
    """
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Sends:
    """Sends in flight within one algorithm step; settled on the way out.

    On success the remaining sends are awaited (their errors raise); on
    failure they are cancelled, and either way no send is left unobserved.
    """

    def __init__(self) -> None:
        self._tasks: list[asyncio.Future[None]] = []

    def __call__(self, fut: asyncio.Future[None]) -> asyncio.Future[None]:
        self._tasks.append(fut)
        return fut

    async def __aenter__(self) -> Sends:
        return self

    async def __aexit__(self, kind: Any, exc: Any, tb: Any) -> None:
        tasks, self._tasks = self._tasks, []
        if kind is None:
            await run_all([t for t in tasks if not t.done()])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def recv_checked(fut: Awaitable[InMessage], meta: Meta, peer: int, where: str) -> InMessage:
    """Await a posted receive and compare the sender's metadata with ours.

    Raises:
        CollectiveError: the sizes, dtypes, shapes or calls differ.
    """
    try:
        msg = await fut
    except CollectiveError as e:  # the mailbox found a size mismatch
        raise CollectiveError(
            f"{where}: rank {peer} sent a buffer of another size ({e}); shapes or dtypes "
            "differ across ranks"
        ) from e
    meta.check(msg.header, peer, where)
    return msg
