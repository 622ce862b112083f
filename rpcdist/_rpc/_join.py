"""Joining a job: every worker publishes itself in the store and reads the others."""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Any

import msgpack

from .._errors import ConfigError

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["agree_names", "check", "host_id", "join"]


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
        "transport": agent.links.transport.name,
        "link": published,
    }
    await store.set(f"rpc/worker/{agent.rank}", msgpack.packb(me))
    entries = await asyncio.gather(
        *(store.get(f"rpc/worker/{r}", timeout) for r in range(agent.world_size))
    )
    return [msgpack.unpackb(e) for e in entries]


async def check(agent: Agent, infos: list[dict[str, Any]]) -> None:
    """Raises: ConfigError: duplicate names, or workers on different transports."""
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
