"""Joining a job: who serves the launchers' store, connecting, the job record.

* One node: the store and the coordinator live in the launcher
  (:class:`MemoryStore`); nothing listens.
* Fixed size (``--nnodes N``): node 0's launcher serves the store on
  ``--master-addr:--master-port`` and coordinates; the others connect.
* Elastic (``--nnodes MIN:MAX``): the launcher that manages to listen there
  serves and coordinates, and is node 0 of every round; the others connect.

The store is guarded by the launchers' secret (``--token``/``RPCDIST_TOKEN``);
the workers get a separate job token that node 0 makes and publishes in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .._errors import ConfigError, ConnectError
from .._options import RpcOptions
from .._store import GrpcTls, StoreClient, StoreServer, format_address
from . import _records as rec
from ._args import DEFAULT_ADDR, LaunchConfig
from ._coordinator import Coordinator, RoundPolicy
from ._rendezvous import MemoryStore, NodeSession, Store

__all__ = ["Membership", "free_port", "join"]

logger = logging.getLogger(__name__)

_STOP_GRACE = 0.5
_LOCK_ATTEMPTS = 500


def free_port(host: str = DEFAULT_ADDR) -> int:
    """A TCP port on ``host`` that the OS reports free (bind port 0, read, close).

    Raises:
        ConfigError: ``host`` cannot be bound on this machine.
    """
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.bind(addr)
            port: int = sock.getsockname()[1]
            return port
    except OSError as exc:
        raise ConfigError(
            f"cannot pick a free port on --master-addr {host!r}: {exc}; pass --master-port"
        ) from exc


def _can_listen(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound here now (not in use, an address of this host).

    Checked with a plain socket first so that a launcher that will not serve
    the store does not make gRPC log a failed bind.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError:
        return False
    return True


@contextlib.asynccontextmanager
async def _same_port_lock(port: int) -> AsyncIterator[None]:
    """Serialise the elastic launchers of one host that try to serve ``port`` (Linux).

    The lock is an abstract Unix socket name: released when the process
    exits, no file left behind. Elsewhere, or after a few seconds, go without.
    """
    if not sys.platform.startswith("linux"):
        yield
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lock:
        for _ in range(_LOCK_ATTEMPTS):
            try:
                lock.bind(f"\0rpcdist-launch-{port}")
                break
            except OSError:
                await asyncio.sleep(0.01)
        yield


@dataclass
class Membership:
    """This launcher's place in the job."""

    session: NodeSession
    coordinator: Coordinator | None  # node 0 only
    job: rec.Job

    def describe(self) -> str:
        """``"launcher 3 (pid 123 on host)"`` for messages."""
        return f"launcher {self.session.seq} (pid {os.getpid()} on {socket.gethostname()})"


def _policy(config: LaunchConfig, interval: float) -> RoundPolicy:
    return RoundPolicy(
        min_nodes=config.min_nodes if config.min_nodes is not None else config.nnodes,
        max_nodes=config.nnodes,
        fixed=not config.elastic,
        max_restarts=config.max_restarts,
        rdzv_timeout=config.rdzv_timeout,
        last_call=config.rdzv_last_call,
        node_timeout=config.node_timeout,
        interval=interval,
    )


def _job(config: LaunchConfig, token: str) -> rec.Job:
    return rec.Job(
        nproc_per_node=config.nproc_per_node,
        min_nodes=config.min_nodes if config.min_nodes is not None else config.nnodes,
        max_nodes=config.nnodes,
        fixed=not config.elastic,
        max_restarts=config.max_restarts,
        token=token,
    )


def _shape(job: rec.Job) -> str:
    nodes = str(job.max_nodes) if job.fixed else f"{job.min_nodes}:{job.max_nodes}"
    return (
        f"--nnodes {nodes} --nproc-per-node {job.nproc_per_node} --max-restarts {job.max_restarts}"
    )


def _check_fits(config: LaunchConfig, job: rec.Job) -> None:
    """Raise :class:`ConfigError` unless this launcher was given node 0's job shape."""
    mine = _job(config, job.token)
    if mine != job:
        raise ConfigError(
            f"node 0 runs the job with {_shape(job)}; this launcher was given {_shape(mine)}"
        )


@contextlib.asynccontextmanager
async def _taking_part(
    store: Store,
    session: NodeSession,
    config: LaunchConfig,
    job: rec.Job,
    coordinator: Coordinator | None,
) -> AsyncIterator[Membership]:
    """Register, run the coordinator beside this agent when hosting; clean up."""
    await session.register(None if config.elastic else config.node_rank)
    task = None
    if coordinator is not None:
        coordinator.host = session.seq
        task = asyncio.create_task(coordinator.run(), name="rpcdist-launch-coordinator")
        task.add_done_callback(session.fail_with)
    try:
        yield Membership(session, coordinator, job)
        if task is not None:
            await task  # it returns once every node has read the job's end
    finally:
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await session.close()


@contextlib.asynccontextmanager
async def join(config: LaunchConfig) -> AsyncIterator[Membership]:
    """Join (or start, on node 0) the job ``config`` describes.

    Raises:
        ConfigError: this launcher does not fit the job node 0 started.
        ConnectError: the launchers' store can be neither served nor reached.
    """
    interval = min(1.0, config.node_timeout / 5)
    policy = _policy(config, interval)
    if not config.multi_node:
        memory = MemoryStore()
        job = _job(config, config.token)
        await memory.set(rec.JOB, rec.encode(job))
        session = NodeSession(
            memory, "the launcher's own store", interval=interval, node_timeout=config.node_timeout
        )
        fixed = config.master_port

        def port() -> int:
            return fixed if fixed is not None else free_port(config.master_addr)

        local = Coordinator(memory, policy, 0, port)
        async with _taking_part(memory, session, config, job, local) as member:
            yield member
        return
    assert config.master_port is not None  # parse_args requires it with several nodes
    address = format_address(config.master_addr, config.master_port)
    # With certificates in the environment (RPCDIST_TLS_CERT, _KEY and _CA,
    # which the workers inherit too), the launchers' store speaks only TLS:
    # the job token node 0 makes travels through it.
    tls = GrpcTls.of(RpcOptions(token=None))
    server = None
    async with _same_port_lock(config.master_port):
        if config.elastic:  # whoever can listen there serves
            hosting = _can_listen(config.master_addr, config.master_port)
        else:
            hosting = config.node_rank == 0
        if hosting:
            server = StoreServer(token=config.token, tls=tls)
            try:
                await server.start(config.master_addr, config.master_port)
            except ConnectError as exc:
                if not config.elastic:
                    raise ConnectError(f"node 0 cannot serve the launchers' store: {exc}") from exc
                logger.debug("another launcher serves the rendezvous (%s)", exc)
                server = None
    client = StoreClient(address, token=config.token, timeout=config.node_timeout, tls=tls)
    try:
        try:
            await client.connect(timeout=config.rdzv_timeout)
        except ConnectError as exc:
            raise ConnectError(
                f"cannot join the launchers' rendezvous at {address}: {exc}; every launcher "
                "of a job needs the same --master-addr, --master-port and --token"
            ) from exc
        session = NodeSession(
            client,
            f"the launchers' store at {address}",
            interval=interval,
            node_timeout=config.node_timeout,
        )
        coordinator: Coordinator | None = None
        if server is not None:
            job = _job(config, secrets.token_hex(16))
            await client.set(rec.JOB, rec.encode(job))
            logger.info("serving the launchers' rendezvous on %s", address)

            def fresh_port() -> int:
                return free_port(config.master_addr)

            coordinator = Coordinator(client, policy, 0, fresh_port)
        else:
            job = await session.read_job(config.rdzv_timeout)
            _check_fits(config, job)
        async with _taking_part(client, session, config, job, coordinator) as member:
            yield member
    finally:
        await client.close()
        if server is not None:
            await server.stop(_STOP_GRACE)
