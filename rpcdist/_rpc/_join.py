"""Joining a job: the store, the job secret, and every worker publishing
itself in the store and reading the others.

**The job secret.** Every job authenticates its links, even when the user
set no token: rank 0 then makes a random secret at rendezvous and the other
ranks read it from the store, so a process of another job (or any process
that does not speak to this job's store) cannot call in. Without a user
token the listeners stay on loopback (``RpcOptions.validated``), so the
store is reachable only from this host. A user token (``RPCDIST_TOKEN``; the
launcher always sets one) guards the store too.

**Refusals are reported on both sides.** A rank whose token the store
refuses is told so at once (``ConnectError``), and the store publishes the
refusal (naming the rank), which every rank waiting at rendezvous watches,
so rank 0 fails within milliseconds instead of timing out.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from .._errors import ConfigError, ConnectError
from .._store import GrpcTls, open_store
from .._store._common import REFUSED_KEY
from . import _procview

if TYPE_CHECKING:
    from .._store import RendezvousSpec, StoreClient, StoreServer
    from ._agent import Agent

__all__ = [
    "agree_names",
    "barrier",
    "check",
    "host_id",
    "job_secret",
    "join",
    "open_job_store",
    "watching_refusals",
]

T = TypeVar("T")
_SECRET_KEY = "rpc/secret"
#: What rpcdist's messages mean, bumped whenever that changes: every worker of
#: a job must agree (checked as they join). 2: an RRef passed back to its
#: owner in a call is confirmed in the call's reply (reply field ``rca``),
#: which a worker of protocol 1 would never read.
WIRE_PROTOCOL = 2


def _version() -> str:
    return str(getattr(sys.modules.get("rpcdist"), "__version__", "unknown"))


async def open_job_store(
    agent: Agent, spec: RendezvousSpec
) -> tuple[StoreClient, StoreServer | None]:
    """Connect to (rank 0: serve) the job's store, over TLS when the job has
    certificates.

    Raises:
        ConnectError: unreachable in time, or this rank's token was refused.
    """
    opts = agent.options
    tls = GrpcTls.of(opts)
    return await open_store(spec, token=opts.token, timeout=opts.init_timeout, tls=tls)


async def watching_refusals(agent: Agent, step: Awaitable[T]) -> T:
    """Await ``step``, failing at once if the store refuses some rank's token.

    Raises:
        ConnectError: a rank was refused (the message names it).
    """
    store = agent.store
    work = asyncio.ensure_future(step)
    watch = asyncio.ensure_future(store.get(REFUSED_KEY, agent.options.init_timeout))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and watch.done() and not watch.cancelled() and not watch.exception():
            raise ConnectError(
                f"{agent.name!r} (rank {agent.rank}) cannot join the job: "
                f"{watch.result().decode(errors='replace')}"
            )
        return await work
    finally:
        for t in (work, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


async def job_secret(agent: Agent) -> str:
    """The job's secret when the user set no token: made by rank 0, read by
    the others from the store (collective)."""
    store = agent.store
    if agent.rank == 0:
        secret = secrets.token_hex(16)
        await store.set(_SECRET_KEY, secret.encode())
        return secret
    got = await watching_refusals(agent, store.get(_SECRET_KEY, agent.options.init_timeout))
    return bytes(got).decode()


async def barrier(agent: Agent, name: str) -> None:
    """A store barrier of every worker, bounded by ``init_timeout``, failing
    at once if the store refuses a rank."""
    store, n = agent.store, agent.world_size
    await watching_refusals(agent, store.barrier(name, n, agent.options.init_timeout))


def host_id() -> str:
    """This host's identity: hostname and kernel boot id (same id: same host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


async def join(agent: Agent, published: dict[str, Any]) -> list[dict[str, Any]]:
    """Publish this worker (name, rank, host, what its transport needs to be
    dialled) and return every worker's entry, by rank.

    The caller fills in its tables, then passes the ``"rpc/init"`` barrier:
    after it every worker has its table (so may be called) and has read every
    entry (so rank 0 may stop the store on failure).
    """
    store, timeout = agent.store, agent.options.init_timeout
    me = {
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
    await store.set(f"rpc/worker/{agent.rank}", msgpack.packb(me))
    entries = await watching_refusals(
        agent,
        asyncio.gather(*(store.get(f"rpc/worker/{r}", timeout) for r in range(agent.world_size))),
    )
    return [msgpack.unpackb(e) for e in entries]


async def check(agent: Agent, infos: list[dict[str, Any]]) -> None:
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
                f"worker name {info['name']!r} is used by both rank {seen[info['name']]} "
                f"and rank {info['rank']}: names must be unique"
            )
        seen[info["name"]] = info["rank"]
    mine = agent.links.transport.name
    other = next((i for i in infos if i.get("transport") != mine), None)
    if other is not None:
        raise ConfigError(
            f"worker {other['name']!r} uses transport {other.get('transport')!r} but "
            f"{agent.name!r} uses {mine!r}: every worker needs the same RpcOptions.transport"
        )


async def agree_names(agent: Agent, name: str, timeout: float) -> list[str]:
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
