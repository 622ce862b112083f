"""Point-to-point ``send``/``recv`` (and ``isend``/``irecv``), matched by source and tag.

They ride the agent's one-way messages on every backend: the key is the
tag, the mailbox matches by (source, key) in order, so several sends with
one tag arrive in the order they were made. They do not take a group
sequence number: they are not ordered with the collectives.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from .._errors import CollectiveError, ConfigError, RpcTimeoutError
from .._futures import Future
from ._api import resolve, state
from ._engine import host_in, host_out
from ._group import ProcessGroup
from ._link import recv_checked as _recv
from ._ops import Meta, as_bytes, check_array
from ._shm import CHECK_PERIOD
from ._work import Work

if TYPE_CHECKING:
    from .._rpc._agent import Agent

__all__ = ["irecv", "isend", "recv", "send"]


def _peer(peer: int, group: ProcessGroup | None, what: str) -> tuple[Any, int]:
    st = state()
    g = resolve(group)
    g.check_member(what)
    g.group_rank(peer, what)
    if peer == st.agent.rank:
        raise CollectiveError(f"{what}: rank {peer} is this process; send to another rank")
    return st, peer


def _check_tag(tag: Any, what: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise ConfigError(f"{what}: tag must be an int, got {tag!r}")
    return tag


def _submit(agent: Agent, coro: Any) -> Future[Any]:
    fut: Future[Any] = agent.submit(coro)
    return fut


def isend(buf: Any, dst: int, tag: int = 0, group: ProcessGroup | None = None) -> Work:
    """Start sending ``buf`` to global rank ``dst``; the Work completes when ``buf`` may be reused.

    Raises:
        ConfigError: a bad buffer or tag.
        CollectiveError: ``dst`` is not a member of ``group`` or is this rank.
    """
    tag = _check_tag(tag, "isend")
    st, peer = _peer(dst, group, "isend")
    check_array(buf, "isend buf")
    host = host_in(buf)
    meta = Meta("p2p", tag, 0, -1, buf.dtype, [buf.size])
    key = f"{st.tag}.p2p/{tag}"

    async def body() -> None:
        async with asyncio.timeout(st.timeout):
            await st.agent.p2p_send(peer, key, [as_bytes(host)], meta.wire)

    return Work(_submit(st.agent, body()), f"send to {peer} tag {tag}")


def irecv(buf: Any, src: int, tag: int = 0, group: ProcessGroup | None = None) -> Work:
    """Start receiving into ``buf`` from global rank ``src``; the Work's result is ``src``.

    Raises:
        ConfigError: a bad buffer or tag.
        CollectiveError: ``src`` is not a member of ``group`` or is this rank.
    """
    tag = _check_tag(tag, "irecv")
    st, peer = _peer(src, group, "irecv")
    check_array(buf, "irecv buf", writable=True)
    meta = Meta("p2p", tag, 0, -1, buf.dtype, [buf.size])
    key = f"{st.tag}.p2p/{tag}"
    agent = st.agent
    where = f"recv from rank {peer} tag {tag}"

    async def body() -> int:
        host, finish = host_out(buf)
        try:
            fut = agent.mailbox.post(peer, key, as_bytes(host))
        except CollectiveError as e:  # it arrived already, with another size
            raise CollectiveError(f"{where}: sizes differ ({e})") from e
        loop = asyncio.get_running_loop()
        deadline = None if st.timeout is None else loop.time() + st.timeout
        while not fut.done():
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                fut.cancel()
                raise RpcTimeoutError(f"{where} timed out after {st.timeout} s")
            await asyncio.wait(
                {fut}, timeout=CHECK_PERIOD if left is None else min(left, CHECK_PERIOD)
            )
            if not fut.done() and st.dead_peers([peer]):
                fut.cancel()
                raise CollectiveError(f"{where}: rank {peer} died")
        await _recv(fut, meta, peer, where)
        if finish is not None:
            finish()
        return peer

    return Work(_submit(agent, body()), where)


def send(buf: Any, dst: int, tag: int = 0, group: ProcessGroup | None = None) -> None:
    """Send ``buf`` to global rank ``dst``; returns once ``buf`` may be reused.

    Raises:
        ConfigError: a bad buffer or tag.
        CollectiveError: ``dst`` is not a member or is this rank.
        RpcTimeoutError: the timeout passed.
    """
    state().agent.check_not_loop_thread("send()")
    isend(buf, dst, tag, group).wait()


def recv(buf: Any, src: int, tag: int = 0, group: ProcessGroup | None = None) -> int:
    """Receive into ``buf`` the next message with ``tag`` from global rank ``src``; returns ``src``.

    Raises:
        ConfigError: a bad buffer or tag.
        CollectiveError: the sizes or dtypes differ, ``src`` died or is not a member.
        RpcTimeoutError: the timeout passed.
    """
    state().agent.check_not_loop_thread("recv()")
    result: int = irecv(buf, src, tag, group).result()
    return result
