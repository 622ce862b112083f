"""An agent's links to its peers: the transport, outgoing and incoming links.

Worker A's requests to B and B's replies to A travel on the link A opened.
An outgoing link is made on first use and queues at once while the
transport dials; when it ends, every call pending on that peer and every
point-to-point receive from it fail with the reason. Incoming links are
accepted from the transport once the peer's hello and token check out.

A link ending under us (the peer closed it or the connection broke), or a
peer that cannot be dialled once the job is up, means the peer is lost
(:mod:`._liveness`), except for links a peer's blocking calls drive, which
it closes at will (a timed-out call): their end only makes us watch the peer.
A link closed for a protocol error loses only that link.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from typing import TYPE_CHECKING, Any

from .._errors import (
    ClosedError,
    ConnectError,
    ProtocolError,
    RpcdistError,
    TransportError,
    WorkerLostError,
)
from .._transport import Hooks, Link, LinkFactory, Peer, Transport, make_transport
from .._transport._frames import P2P, OutMessage
from . import _members

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["Links"]

_log = logging.getLogger(__name__)
#: How long a refused link gets to end (a dynamic group's unknown peer).
_REFUSED_WAIT = 1.0


class Links:
    """One agent's transport and links (see the module docstring)."""

    def __init__(self, agent: AgentView) -> None:
        self._agent = agent
        self._loop = agent.loop
        self.transport: Transport = make_transport(
            agent.loop, agent.options, rank=agent.rank, name=agent.name
        )
        #: The outgoing link to each peer (made on first use), and the tasks
        #: that run them.
        self._dialled: dict[int, Link] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        #: The links peers opened to us.
        self._accepted: set[Link] = set()
        #: Incoming links of a peer's blocking calls that the loop serves (not
        #: watched: the peer's thread reads only replies on them).
        self._accepted_sync: set[Link] = set()
        self._late: set[asyncio.Task[None]] = set()
        #: What each peer's transport published at rendezvous, and its host.
        self._info: dict[int, dict[str, Any]] = {}
        self._hosts: dict[int, str] = {}

    # ------------------------------------------------------------ setup

    async def serve(self) -> dict[str, Any]:
        """Start listening; what peers need to reach us (published at rendezvous)."""
        return await self.transport.serve(self._refusal, self._accept)

    def set_peers(self, infos: dict[int, dict[str, Any]], hosts: dict[int, str]) -> None:
        self._info = infos
        self._hosts = hosts

    def add_peer(self, rank: int, info: dict[str, Any], host: str) -> None:
        """A worker joined the dynamic group (on the loop)."""
        self._info = {**self._info, rank: info}
        self._hosts = {**self._hosts, rank: host}

    def release(self, rank: int) -> None:
        """Worker ``rank`` left the group: half-close our link to it, so that
        it sees the end of what we sent (on the loop)."""
        link = self._dialled.get(rank)
        if link is not None and link.closed is None:
            self._agent.spawn(link.aclose_write())

    def address(self, rank: int) -> str:
        return str(self._info[rank].get("addr", "?"))

    def peer(self, rank: int) -> Peer:
        me = self._agent.rank
        return Peer(
            rank=rank,
            label=self.label(rank),
            info=self._info[rank],
            same_host=self._hosts.get(rank) == self._hosts.get(me),
        )

    def label(self, rank: int) -> str:
        return f"worker {self._agent.workers[rank].name!r} at {self.address(rank)}"

    def _refusal(self, rank: int, name: str) -> str | None:
        agent = self._agent
        workers = agent.workers
        if not workers.knows(rank) or workers[rank].name != name:
            if agent.dynamic and not agent.closed:
                return None  # a joining worker: _accept looks for its entry
            return f"worker {name!r} (rank {rank}) is not part of this job"
        why = agent.liveness.lost.get(rank)
        if why is not None:
            return f"worker {name!r} (rank {rank}) was declared lost by {agent.name!r}: {why}"
        return None

    def watched(self) -> list[Link]:
        """The links the failure detector watches (on the loop)."""
        return [
            *self._dialled.values(),
            *(link for link in self._accepted if link not in self._accepted_sync),
        ]

    def drop(self, rank: int, exc: RpcdistError) -> None:
        """End every link with worker ``rank`` now, with ``exc`` (on the loop)."""
        for link in [self._dialled.get(rank), *self._accepted]:
            if link is not None and link.peer_rank == rank and link.closed is None:
                try:
                    link.abort(exc)
                except NotImplementedError:
                    pass

    # --------------------------------------------------------- outgoing

    def get(self, dst: int) -> Link | None:
        """The open link to ``dst``, if any (any thread; a hint)."""
        link = self._dialled.get(dst)
        return link if link is not None and link.closed is None else None

    def send(self, dst: int, msg: OutMessage) -> None:
        """Queue ``msg`` on the link to ``dst``, opening it if needed (on the loop).

        Raises:
            RpcdistError: the link is closed, the agent is shutting down, or a
                fault rule failed the message.
        """
        link = self._dialled.get(dst)
        if link is None or link.closed is not None:
            link = self.link(dst)
        link.send(msg)

    def link(self, dst: int) -> Link:
        """The link to ``dst``, opened on first use (on the loop).

        Raises:
            ClosedError: the agent is shutting down.
        """
        link = self._dialled.get(dst)
        if link is not None and link.closed is None:
            return link
        agent = self._agent
        if agent.closed:
            raise ClosedError(f"agent {agent.name!r} is shutting down")
        if dst in agent.liveness.lost:
            raise agent.liveness.error(dst)
        hooks = Hooks(on_message=agent.on_message, after_read=agent.flush_wakeups)
        link, run = self.transport.link(self.peer(dst), hooks)
        self._dialled[dst] = link
        # A clean context: the link outlives the call that opened it, so it
        # must not inherit that call's deadline (or anything else).
        task = self._loop.create_task(self._run(dst, link, run), context=contextvars.Context())
        self._tasks[dst] = task
        return link

    async def _run(self, dst: int, link: Link, run: Any) -> None:
        exc: RpcdistError
        cancelled = False
        try:
            await run
            exc = WorkerLostError(
                f"{link.label} closed the connection (its process exited, was killed or shut down)"
            )
        except asyncio.CancelledError:
            cancelled = True
            exc = ClosedError(f"agent {self._agent.name!r} shut down")
        except ConnectError as e:
            # Every worker listened before the job started: one that cannot be
            # reached or refuses us now is gone for us.
            exc = WorkerLostError(f"cannot reach {link.label} any more: {e}")
            link.closed = exc
            if self._dialled.get(dst) is link:
                del self._dialled[dst]
                self._tasks.pop(dst, None)
            self._agent.calls.fail_peer(dst, exc)
            self._agent.liveness.declare(dst, str(exc))
            return
        except RpcdistError as e:
            exc = e
        except Exception as e:
            exc = TransportError(f"link to {link.label} failed: {type(e).__name__}: {e}")
        if link.closed is None or not isinstance(link.closed, WorkerLostError):
            link.closed = exc
        if self._dialled.get(dst) is link:
            del self._dialled[dst]
            self._tasks.pop(dst, None)
        self._agent.peer_failed(dst, exc)
        if cancelled:
            raise asyncio.CancelledError

    # --------------------------------------------------------- incoming

    async def _accept(self, rank: int, name: str, sync: bool, make: LinkFactory) -> None:
        """A peer connected and passed the handshake (on the loop)."""
        agent = self._agent
        if not await self._admitted(rank, name, make):
            return
        same_host = self._hosts.get(rank) == self._hosts.get(agent.rank)
        if sync and agent.sync_serving.serve(rank, name, make, same_host):
            return  # a thread of its own serves it
        mailbox = agent.mailbox

        def alloc(kind: int, key: str, total: int) -> memoryview | None:
            return mailbox.alloc(rank, key, total) if kind == P2P else None

        hooks = Hooks(on_message=agent.on_message, alloc=alloc, after_read=agent.flush_wakeups)
        link = make(hooks, same_host=same_host)
        self._accepted.add(link)
        if sync:
            self._accepted_sync.add(link)
        broken = False
        try:
            await link.run()
        except ProtocolError:
            broken = True  # only this link: the peer sent something malformed
            raise
        finally:
            link.closed = link.closed or WorkerLostError(f"stream from {link.label} ended")
            self._accepted.discard(link)
            self._accepted_sync.discard(link)
            # A killed process's sockets close cleanly too: the end of a
            # peer's own link (while we run) means it is gone or going.
            if not agent.closed and not broken:
                agent.liveness.probe(rank, str(link.closed))

    async def _admitted(self, rank: int, name: str, make: LinkFactory) -> bool:
        """Whether to serve a link from ``rank``/``name``: a member, or in a
        dynamic group a joining worker (its entry is in the store)."""
        agent = self._agent
        workers = agent.workers
        if not agent.dynamic or (workers.knows(rank) and workers[rank].name == name):
            return True
        if await _members.admit_link(agent, rank, name):
            return True
        refused = make(Hooks(on_message=agent.on_message))
        refused.abort(ConnectError(f"worker {name!r} (rank {rank}) is not in the group"))
        with contextlib.suppress(RpcdistError, TimeoutError):
            await asyncio.wait_for(refused.run(), _REFUSED_WAIT)
        return False

    def adopt_late(self, link: Link) -> None:
        """On the loop: serve a thread-driven link whose call timed out.

        Half-closed, so the callee ends it once it has answered (or at once,
        dropping the reply, if it has not started the answer); a reply that
        still comes is handled as any late reply.
        """
        agent = self._agent
        if agent.closed:
            link.close_threaded()  # type: ignore[attr-defined]
            return
        link.rebind(Hooks(on_message=agent.on_message, after_read=agent.flush_wakeups))
        link.hand_to_loop()  # type: ignore[attr-defined]
        link.close_write()
        task = self._loop.create_task(self._serve_late(link))
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    async def _serve_late(self, link: Link) -> None:
        try:
            await link.run()
        except RpcdistError:
            pass

    # ---------------------------------------------------------- closing

    async def close(self, grace: float) -> None:
        """Half-close every outgoing link, end the rest, stop the transport (on the loop)."""
        await asyncio.gather(
            *(link.aclose_write() for link in list(self._dialled.values())), return_exceptions=True
        )
        tasks = [*self._tasks.values(), *self._late]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.transport.stop(grace)

    def statistics(self) -> dict[str, int]:
        return {
            "queued_frames": sum(link.queued() for link in list(self._dialled.values())),
            "outgoing_streams": len(self._dialled),
            "incoming_streams": len(self._accepted),
        }
