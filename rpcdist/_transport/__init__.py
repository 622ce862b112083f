"""Transports: how an agent's frames move between workers (see :mod:`._base`)."""

from __future__ import annotations

import asyncio

from .._options import RpcOptions
from ._base import Accept, Hooks, Link, LinkFactory, Peer, Transport, Validate
from ._faulty import FaultyTransport

__all__ = [
    "Accept",
    "Hooks",
    "Link",
    "LinkFactory",
    "Peer",
    "Transport",
    "Validate",
    "make_transport",
]


def make_transport(
    loop: asyncio.AbstractEventLoop, options: RpcOptions, *, rank: int, name: str
) -> Transport:
    """The transport ``options.data_transport`` names, wrapped for fault
    injection when ``options.faults`` is set (imported only when used)."""
    kind = options.data_transport
    transport: Transport
    if kind == "tcp":
        from ._tcp_dial import TcpTransport

        transport = TcpTransport(loop, options, rank=rank, name=name)
    elif kind == "grpc":
        from ._grpc import GrpcTransport

        transport = GrpcTransport(loop, options, rank=rank, name=name)
    else:
        from ._inproc import InprocTransport

        transport = InprocTransport(loop, options, rank=rank, name=name)
    if options.faults is not None:
        transport = FaultyTransport(transport, options.faults, loop)
    return transport
