"""Joining a job: the store, the job secret, and every worker publishing
itself in the store and reading the others.

**The job secret.** Every job authenticates its store calls and its links.
A user token (``RPCDIST_TOKEN``; the launcher always sets one) does both.
Without one, the job must meet on a loopback address: rank 0 makes a random
secret, guards the store with it and writes it to a file only its user can
read, where the other ranks (same host, same user) find it
(:mod:`rpcdist._store._private`); the store never hands it out. Across hosts
a job needs a token (or ``allow_insecure``, which then runs without any).

**A refusal stops only the refused.** A caller whose token the store refuses
is told so at once (``ConnectError``); the ranks that were let in keep
waiting, so a stray call cannot abort a starting job. If their rendezvous
then times out, the error says how many calls were refused and from where.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from .._errors import ConfigError, RpcdistError, RpcTimeoutError
from .._options import is_loopback
from .._store import GrpcTls, open_store
from .._store._common import REFUSED_KEY
from .._store._private import open_private_store
from .._transport._shm import SHM_DIR
from . import _procview

if TYPE_CHECKING:
    from .._store import RendezvousSpec, StoreClient, StoreServer
    from ._agent_view import AgentView

__all__ = [
    "agree_names",
    "barrier",
    "check",
    "entry",
    "host_id",
    "join",
    "open_job_store",
    "watching_refusals",
]

T = TypeVar("T")
#: How long a rank whose rendezvous timed out waits for the store's refusals.
_REFUSALS_WAIT = 2.0
#: What rpcdist's messages mean, bumped whenever that changes: every worker of
#: a job must agree (checked as they join). 2: an RRef passed back to its
#: owner in a call is confirmed in the call's reply (reply field ``rca``),
#: which a worker of protocol 1 would never read. 3: the stream's frame
#: envelope is msgpack (it was a protobuf ``Batch``).
WIRE_PROTOCOL = 3


def _version() -> str:
    return str(getattr(sys.modules.get("rpcdist"), "__version__", "unknown"))


async def open_job_store(
    agent: AgentView, spec: RendezvousSpec
) -> tuple[StoreClient, StoreServer | None]:
    """Connect to (rank 0: serve) the job's store, over TLS when the job has
    certificates, guarded by the user's token or, without one, by a secret
    kept in a per-user file (then also set as the links' token).

    Raises:
        ConnectError: unreachable in time, or this rank's token was refused.
        ConfigError: no token and a store beyond loopback (without
            ``allow_insecure``), or the secret file is not private.
    """
    opts = agent.options
    tls = GrpcTls.of(opts)
    if opts.token is None and is_loopback(spec.host):
        store, server, secret = await open_private_store(spec, timeout=opts.init_timeout, tls=tls)
        agent.links.transport.set_token(secret)
        return store, server
    opts.check_store_host(spec.host, spec.rank)  # (the agent checked it first)
    return await open_store(spec, token=opts.token, timeout=opts.init_timeout, tls=tls)


async def watching_refusals(agent: AgentView, step: Awaitable[T]) -> T:
    """Await ``step``; if it times out, say how many calls the store refused
    and from where (a rank with a wrong token, another user's process...).

    Raises:
        RpcTimeoutError: ``step`` timed out (with the store's refusals, if any).
    """
    try:
        return await step
    except RpcTimeoutError as exc:
        got = b""
        with contextlib.suppress(RpcdistError):
            got = await agent.store.get(REFUSED_KEY, _REFUSALS_WAIT)
        if not got:
            raise
        raise RpcTimeoutError(f"{exc}; meanwhile {got.decode(errors='replace')}") from exc


async def barrier(agent: AgentView, name: str) -> None:
    """A store barrier of every worker, bounded by ``init_timeout`` (a
    timeout names the calls the store refused)."""
    store, n = agent.store, agent.world_size
    await watching_refusals(agent, store.barrier(name, n, agent.options.init_timeout))


def host_id() -> str:
    """This host's identity: hostname, kernel boot id, the file system on
    /dev/shm and the pid namespace (same id: same host). Two containers
    with host networking share the first two, but a shared-memory segment
    one makes the other cannot open unless /dev/shm is shared, and a pid
    one names means another process, or none, to the other; the same-host
    paths rely on both, so such workers are two hosts here."""
    try:
        shm = str(os.stat(SHM_DIR).st_dev)  # (the file system mounted there)
    except OSError:
        shm = ""
    return "/".join([socket.gethostname(), _procview.boot_id(), shm, _procview.namespace("pid")])


def entry(agent: AgentView, published: dict[str, Any]) -> dict[str, Any]:
    """What this worker publishes: name, rank, host, process, and what its
    transport needs to be dialled."""
    return {
        "name": agent.name,
        "rank": agent.rank,
        "host": host_id(),
        "pid": os.getpid(),
        "seat": _procview.seat(),
        "transport": agent.links.transport.name,
        "link": published,
        "wire": WIRE_PROTOCOL,
        "version": _version(),
    }


async def join(agent: AgentView, published: dict[str, Any]) -> list[dict[str, Any]]:
    """Publish this worker (name, rank, host, what its transport needs to be
    dialled) and return every worker's entry, by rank.

    The caller fills in its tables, then passes the ``"rpc/init"`` barrier:
    after it every worker has its table (so may be called) and has read every
    entry (so rank 0 may stop the store on failure).
    """
    store, timeout = agent.store, agent.options.init_timeout
    me = entry(agent, published)
    await store.set(f"rpc/worker/{agent.rank}", msgpack.packb(me))
    entries = await watching_refusals(
        agent,
        asyncio.gather(*(store.get(f"rpc/worker/{r}", timeout) for r in range(agent.world_size))),
    )
    return [msgpack.unpackb(e) for e in entries]


async def check(agent: AgentView, infos: list[dict[str, Any]]) -> None:
    """Raises: ConfigError: duplicate names, or workers on different transports
    or wire protocols (rpcdist versions)."""
    other = next((i for i in infos if i.get("wire", 1) != WIRE_PROTOCOL), None)
    if other is not None:
        raise ConfigError(
            f"worker {other['name']!r} runs rpcdist {other.get('version', 'unknown')} (wire "
            f"protocol {other.get('wire', 1)}) but {agent.name!r} runs {_version()} (wire "
            f"protocol {WIRE_PROTOCOL}): every worker of a job needs the same rpcdist"
        )
    seen: dict[str, int] = {}
    for info in infos:
        if info["name"] in seen:
            raise ConfigError(
                f"worker name {info['name']!r} is not unique: it is used by both rank "
                f"{seen[info['name']]} and rank {info['rank']} (names must be unique)"
            )
        seen[info["name"]] = info["rank"]
    mine = agent.links.transport.name
    other = next((i for i in infos if i.get("transport") != mine), None)
    if other is not None:
        raise ConfigError(
            f"worker {other['name']!r} uses transport {other.get('transport')!r} but "
            f"{agent.name!r} uses {mine!r}: every worker needs the same RpcOptions.transport"
        )


async def agree_names(agent: AgentView, name: str, timeout: float) -> list[str]:
    """Every worker's new name, by rank (collective).

    Raises:
        ConfigError: a name is used twice.
    """
    store = agent.store
    await store.set(f"rpc/name/{agent.rank}", name.encode())
    got = await asyncio.gather(
        *(store.get(f"rpc/name/{r}", timeout) for r in range(agent.world_size))
    )
    names = [g.decode() for g in got]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"worker name {dup!r} is used more than once: names must be unique")
    return names
