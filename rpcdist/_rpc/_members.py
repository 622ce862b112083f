"""Dynamic membership: workers join a running group and leave it.

``init_rpc`` without a world size (none given, none in ``init_method``'s
query, no ``WORLD_SIZE``) starts or joins a *dynamic group*, as PyTorch's
TensorPipe agent does. Rank 0 starts the group: it serves the store, as in
a static job, and keeps the membership, which it changes one worker at a
time (on its loop, under a lock):

* **join.** A joiner opens the store (its token is checked there and on
  every link, as any worker's), counts itself in (``rpc/dyn/announced``),
  publishes its entry (``rpc/dyn/<rank>/<name>``: what its transport needs
  to be dialled), reads rank 0's entry from ``rpc/mode`` (a static job's
  rank 0 writes ``"static"`` there: mixing is refused) and asks rank 0 to
  let it in. Rank 0 checks the entry (rank and name free, same transport and
  wire protocol), tells every member (they add it to their tables), watches
  it (a link with heartbeats), and answers with every member's entry.
  ``init_rpc`` returns once every member knows the joiner, so either side
  may call the other at once. A link that comes from a worker not yet in the
  table is accepted once its entry is in the store (the token was checked in
  the handshake): a member that heard of the joiner may call it before the
  joiner has read rank 0's answer.
* **leave.** ``shutdown()`` of a member tells rank 0, which tells the
  others: they take it out of their tables (a call to it then raises
  ``WorkerLostError`` saying it left) and half-close their links to it; the
  leaver waits until it is idle and the links to it ended, and closes. No
  failure detector speaks: a worker that left is not lost.
* **loss.** A member killed or hung is declared lost by the failure
  detector (``_liveness``) of whoever talks to it, and by rank 0, which
  watches every member; rank 0 then takes it out of the group and tells the
  others. A worker may join again with the same rank and name (a restarted
  trainer): the one before it must be gone, and rank 0 probes it first.
* **rank 0's own shutdown** ends the group: it waits until every other
  member has left or was lost, no announced joiner is still on its way (one
  that never asks is waited for ``init_timeout``) and the group has not
  changed for ``_LINGER`` seconds (the workers of a job start within
  seconds of each other, not at one instant: one that starts as another
  leaves still finds the group), then stops the store. If nobody ever
  joined, it waits up to ``init_timeout`` for a first worker; its
  ``timeout`` bounds all this (members still there then: an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import msgpack

from .._errors import ConfigError, ConnectError, RpcdistError, RpcTimeoutError, WorkerLostError
from .._store import MIXED
from .._worker import WorkerInfo
from . import _join, _shutdown
from ._liveness import PING
from ._registry import BaseExtension

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["Membership", "admit_link", "install", "join", "mark_static", "shutdown"]

log = logging.getLogger(__name__)

#: Internal methods: a joiner's and a leaver's request to rank 0, and rank
#: 0's news for the members.
JOIN = "rpc.member_join"
LEAVE = "rpc.member_leave"
UPDATE = "rpc.member_update"
_MODE = "rpc/mode"
_ANNOUNCED = "rpc/dyn/announced"
#: How long a member's ``accept`` waits for an unknown peer's entry in the store.
_ENTRY_WAIT = 5.0
#: How often rank 0's shutdown looks at the store's count of joiners, and a
#: leaver at its links.
_POLL = 0.05
#: How long rank 0's shutdown waits, once the group is empty, for a change
#: (a worker joining): workers of one job rarely start at the same instant.
_LINGER = 3.0
#: How long a leaver waits for the members' links to it to end.
_LINKS_WAIT = 2.0


def _entry_key(rank: int, name: str) -> str:
    return f"rpc/dyn/{rank}/{name}"


async def mark_static(agent: AgentView) -> None:
    """Rank 0 of a static job: say so, so that a dynamic joiner is refused."""
    await agent.store.set(_MODE, msgpack.packb({"mode": "static"}))


class Membership(BaseExtension):
    """One dynamic agent's view of the group: every member's entry, and on
    rank 0 what the coordination needs."""

    name = "membership"

    def __init__(self, agent: AgentView) -> None:
        self._agent = agent
        self.entries: dict[int, dict[str, Any]] = {}
        #: Each worker that departed (left or lost): rank -> its incarnation,
        #: whose links are refused (a lost worker stays lost; a restarted one
        #: has a new incarnation).
        self.gone: dict[int, str] = {}
        self.incarnation = secrets.token_hex(8)
        #: Rank 0: joins and leaves are applied one at a time.
        self._lock: asyncio.Lock | None = None
        #: Rank 0: joiners that asked (let in or refused), and whether it leaves.
        self.settled = 0
        #: Rank 0: workers let in so far, and when the group last changed.
        self.joined = 0
        self.changed_at = time.monotonic()
        self.closing = False
        self._changed: asyncio.Event | None = None

    # ------------------------------------------------------------ extension

    def statistics(self) -> dict[str, int]:
        return {"members": len(self.entries)}

    def peer_lost(self, rank: int) -> None:
        """A member was declared lost: out of the group (rank 0 tells the others)."""
        agent = self._agent
        entry = self.entries.pop(rank, None)
        if entry is not None:
            self.gone[rank] = entry["incarnation"]
        agent.workers.remove(rank, f"it was lost: {agent.liveness.lost.get(rank, '?')}")
        self._notify_changed()
        if agent.rank == 0 and entry is not None and not agent.closed:
            why = agent.liveness.lost.get(rank, "")
            news = {"lost": rank, "incarnation": entry["incarnation"], "why": why}
            agent.spawn(self._broadcast_locked(news))

    # ------------------------------------------------------------- the table

    def learn(self, entry: dict[str, Any]) -> None:
        """Add ``entry``'s worker to this agent's tables (on the loop)."""
        agent = self._agent
        rank = int(entry["rank"])
        old = self.entries.get(rank)
        if old is not None and old["incarnation"] != entry["incarnation"]:
            agent.liveness.declare(rank, "a new worker joined with its rank")
        agent.liveness.forget(rank)
        self.entries[rank] = entry
        agent.workers.add(WorkerInfo(entry["name"], rank))
        agent.hosts[rank] = entry["host"]
        agent.links.add_peer(rank, entry["link"], entry["host"])
        agent.liveness.learn([entry])
        self._notify_changed()

    def depart(self, rank: int, why: str) -> None:
        """Worker ``rank`` left the group (on the loop): out of the tables,
        and our link to it half-closed, so that it sees us done."""
        agent = self._agent
        entry = self.entries.pop(rank, None)
        if entry is not None:
            self.gone[rank] = entry["incarnation"]
        if agent.workers.remove(rank, why) is not None:
            agent.links.release(rank)
            agent.peer_lost(rank)  # the layers above free what it held
        self._notify_changed()

    def _notify_changed(self) -> None:
        self.changed_at = time.monotonic()
        if self._changed is not None:
            self._changed.set()

    # ---------------------------------------------------------- rank 0's part

    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def admit(self, src: WorkerInfo, entry: dict[str, Any]) -> list[dict[str, Any]]:
        """Rank 0: let ``entry``'s worker in, tell the members; every entry.

        Raises:
            ConfigError: the group is closing, its rank or name is taken by a
                live worker, or its rpcdist or transport differs.
        """
        agent = self._agent
        async with self._locked():
            try:
                if src.id != entry.get("rank") or src.name != entry.get("name"):
                    raise ConfigError(
                        f"worker {src.name!r} (rank {src.id}) asked to join as "
                        f"{entry.get('name')!r} (rank {entry.get('rank')})"
                    )
                if self.closing or agent.closed:
                    raise ConfigError(
                        f"worker {src.name!r} cannot join: rank 0 ({agent.name!r}) is "
                        "shutting the group down"
                    )
                await self._make_room(entry)
                await _join.check(agent, [*self.entries.values(), entry])
                others = [r for r in self.entries if r != agent.rank]
                self.learn(entry)
                self.joined += 1
                await self._broadcast(others, {"join": entry})
                agent.liveness.watch(src.id)
                return list(self.entries.values())
            finally:
                self.settled += 1

    async def _make_room(self, entry: dict[str, Any]) -> None:
        """Raises: ConfigError: ``entry``'s rank or name is a live member's."""
        agent = self._agent
        rank, name = int(entry["rank"]), str(entry["name"])
        same = [r for r, e in self.entries.items() if r == rank or e["name"] == name]
        for r in same:
            other = self.entries[r]
            if r != agent.rank:
                # A restarted worker? Its predecessor must be gone: ask it.
                deadline = time.monotonic() + agent.liveness.window(r)
                try:
                    await agent.call(r, PING, None, deadline=deadline, meta=None, internal=True)
                except (WorkerLostError, ConnectError, RpcTimeoutError) as e:
                    why = f"worker {name!r} (rank {rank}) joined in its place, and a ping failed"
                    agent.liveness.declare(r, f"{why}: {e}")
                    continue
            raise ConfigError(
                f"worker name {name!r} / rank {rank} is taken: worker {other['name']!r} "
                f"(rank {r}) is a live member of the group (names and ranks must be unique)"
            )

    async def release(self, src: WorkerInfo) -> None:
        """Rank 0: ``src`` leaves; tell the others."""
        async with self._locked():
            entry = self.entries.get(src.id)
            if entry is None or entry["name"] != src.name:
                return
            self.depart(src.id, "it left the group (shut down)")
            others = [r for r in self.entries if r != self._agent.rank]
            await self._broadcast(others, {"leave": src.id, "incarnation": entry["incarnation"]})

    async def _broadcast_locked(self, news: dict[str, Any]) -> None:
        async with self._locked():
            others = [r for r in self.entries if r != self._agent.rank]
            await self._broadcast(others, news)

    async def _broadcast(self, ranks: list[int], news: dict[str, Any]) -> None:
        """Tell ``ranks`` the news and wait for each (one that fails is lost)."""
        agent = self._agent
        deadline = time.monotonic() + agent.options.init_timeout

        async def tell(rank: int) -> None:
            try:
                await agent.call(rank, UPDATE, news, deadline=deadline, meta=None, internal=True)
            except RpcdistError as e:
                if not agent.closed:
                    agent.liveness.probe(rank, f"it did not take the group's news: {e}")

        await asyncio.gather(*(tell(r) for r in ranks))

    async def wait_empty(self, timeout: float | None) -> None:
        """Rank 0's shutdown: wait until the group is over (see the module
        docstring): no other member, no announced joiner on its way, and
        nothing changed for ``_LINGER`` seconds (or, if nobody ever joined,
        ``init_timeout`` passed).

        Raises:
            RpcTimeoutError: members are still in the group after ``timeout``.
        """
        agent = self._agent
        start = time.monotonic()
        end = None if timeout is None else start + timeout
        announced = 0
        self._changed = asyncio.Event()
        while True:
            self._changed.clear()
            count = await agent.store.add(_ANNOUNCED, 0)
            if count != announced:
                announced, self.changed_at = count, time.monotonic()
            now = time.monotonic()
            others = [r for r in self.entries if r != agent.rank]
            quiet = now - self.changed_at
            late = quiet > agent.options.init_timeout  # an announced joiner that never asked
            if not others and (self.settled >= announced or late):
                if self.joined and quiet >= _LINGER:
                    break
                if not self.joined and now - start >= agent.options.init_timeout:
                    break
            if end is not None and now >= end:
                if not others:
                    break
                names = ", ".join(repr(self.entries[r]["name"]) for r in others)
                raise RpcTimeoutError(
                    f"graceful shutdown of {agent.name!r} (rank 0 of a dynamic group) did not "
                    f"finish within {timeout} s: members {names} have not left"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), _POLL)
        self.closing = True


# ------------------------------------------------------------------ handlers


async def _on_join(agent: Any, src: WorkerInfo, payload: Any) -> list[dict[str, Any]]:
    return await _membership(agent).admit(src, dict(payload))


async def _on_leave(agent: Any, src: WorkerInfo, payload: Any) -> None:
    await _membership(agent).release(src)


async def _on_update(agent: Any, src: WorkerInfo, payload: Any) -> None:
    """Rank 0's news: a worker joined, left or was lost (only rank 0 sends it)."""
    if src.id != 0:
        raise ConfigError(f"worker {src.name!r} (rank {src.id}) sent group news; only rank 0 may")
    ms = _membership(agent)
    news = dict(payload)
    if "join" in news:
        ms.learn(dict(news["join"]))
        return
    rank = int(news["leave"] if "leave" in news else news.get("lost", -1))
    entry = ms.entries.get(rank)
    if entry is None or entry["incarnation"] != news.get("incarnation"):
        return  # news of a worker already replaced
    if "leave" in news:
        ms.depart(rank, "it left the group (shut down)")
    else:
        agent.liveness.declare(rank, f"rank 0 found it lost: {news.get('why', '')}")


def _membership(agent: Any) -> Membership:
    ms = agent.membership
    if ms is None:
        raise ConfigError(f"worker {agent.name!r} is not in a dynamic group")
    assert isinstance(ms, Membership)
    return ms


def install(agent: AgentView) -> Membership:
    """Make a dynamic agent's membership and serve its internal methods."""
    ms = Membership(agent)
    agent.registry.install(ms)
    agent.registry.add_handler(JOIN, _on_join)
    agent.registry.add_handler(LEAVE, _on_leave)
    agent.registry.add_handler(UPDATE, _on_update)
    return ms


# ---------------------------------------------------------------- join, leave


async def join(agent: AgentView, ms: Membership, published: dict[str, Any]) -> None:
    """Start (rank 0) or join a dynamic group; returns once every member knows us.

    Raises:
        ConfigError: the group is static (:data:`MIXED`), or rank 0 refused us.
        RpcTimeoutError: rank 0 did not start or answer within ``init_timeout``.
    """
    store, timeout = agent.store, agent.options.init_timeout
    me = {**_join.entry(agent, published), "dynamic": True, "incarnation": ms.incarnation}
    if agent.rank == 0:
        ms.learn(me)
        await store.set(_MODE, msgpack.packb({"mode": "dynamic", "root": me}))
        return
    await store.add(_ANNOUNCED, 1)
    await store.set(_entry_key(agent.rank, agent.name), msgpack.packb(me))
    mode = msgpack.unpackb(await _join.watching_refusals(agent, store.get(_MODE, timeout)))
    if mode.get("mode") != "dynamic":
        raise ConfigError(
            f"{MIXED} (rpcdist: {agent.name!r} (rank {agent.rank}) was started without a world "
            "size, but rank 0 started a static group with one: pass the same world_size to "
            "every worker, or none to any)"
        )
    ms.learn(me)
    ms.learn(mode["root"])
    deadline = time.monotonic() + timeout
    try:
        entries = await agent.call(0, JOIN, me, deadline=deadline, meta=None, internal=True)
    except RpcTimeoutError as e:
        raise RpcTimeoutError(f"rank 0 did not let {agent.name!r} join in time: {e}") from e
    for entry in entries:
        if int(entry["rank"]) != agent.rank:
            ms.learn(dict(entry))


async def admit_link(agent: AgentView, rank: int, name: str) -> bool:
    """A link came from ``rank``/``name``, not (yet) in our table: accept it
    if that worker published its entry (it is joining; on the loop)."""
    try:
        entry = msgpack.unpackb(await agent.store.get(_entry_key(rank, name), _ENTRY_WAIT))
    except RpcdistError as e:
        log.warning("%s: refused a link from %r (rank %d): %s", agent.name, name, rank, e)
        return False
    if _membership(agent).gone.get(rank) == entry.get("incarnation"):
        log.warning(
            "%s: refused a link from %r (rank %d): it left or was lost", agent.name, name, rank
        )
        return False
    agent.workers.hear(WorkerInfo(name, rank))
    return True


async def shutdown(
    agent: AgentView, ms: Membership, graceful: bool, timeout: float | None
) -> list[WorkerInfo]:
    """Shut a dynamic agent down (on its loop): a graceful shutdown leaves
    the group first (:func:`_leave`). Returns ``[]`` (nobody is waited for
    who could be lost).

    Raises:
        RpcTimeoutError: a graceful shutdown did not finish within ``timeout``.
        RpcdistError: an extension found something wrong (leaked RRefs).
    """
    err: RpcdistError | None = None
    if graceful:
        try:
            await _leave(agent, ms, timeout)
        except RpcdistError as e:
            err = e
    ok = graceful and err is None
    await _shutdown.close(agent, graceful=ok, leave=False)
    if err is not None:
        raise err
    if ok:
        for _, ext in sorted(agent.registry.extensions.items()):
            ext.check()
    return []


async def _leave(agent: AgentView, ms: Membership, timeout: float | None) -> None:
    """Leave the group, finish what is in flight here. Rank 0 first waits
    for the group to empty.

    Raises:
        RpcTimeoutError: not done within ``timeout`` (the drain: within
            ``RpcOptions.shutdown_timeout``).
    """
    limit = timeout if timeout is not None else agent.options.shutdown_timeout
    agent.liveness.leaving = True
    if agent.rank == 0:
        await ms.wait_empty(timeout)
    elif not agent.liveness.is_lost(0):
        deadline = time.monotonic() + limit
        try:
            await agent.call(0, LEAVE, None, deadline=deadline, meta=None, internal=True)
        except RpcdistError as e:
            log.info("%s: left without telling rank 0: %s", agent.name, e)
    try:
        async with asyncio.timeout(limit):
            for _, ext in sorted(agent.registry.extensions.items()):
                await ext.drain()
            activity = agent.activity
            activity.quiescing = True
            activity.check_idle()
            await activity.idle.wait()
    except TimeoutError:
        raise RpcTimeoutError(
            f"graceful shutdown of {agent.name!r} did not finish within {limit} s "
            f"({len(agent.calls)} calls pending, {agent.activity.inflight} handlers running)"
        ) from None
    await _links_end(agent)


async def _links_end(agent: AgentView) -> None:
    """Wait (briefly) until the members' links to us have ended: they
    half-close them when told we left, so what they sent has arrived."""
    loop = asyncio.get_running_loop()
    end = loop.time() + _LINKS_WAIT
    while agent.links.statistics()["incoming_streams"] and loop.time() < end:
        await asyncio.sleep(_POLL)
        agent.activity.check_idle()
        await agent.activity.idle.wait()
