"""The rendezvous key-value store (served by rank 0 over gRPC) and ``init_method`` parsing.

The client and server load grpc, so they are imported when first used
(``open_store``, or these names), not with this package: a process that
imports rpcdist without joining a job never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._common import TOKEN_METADATA_KEY, GrpcTls, format_address
from ._rendezvous import MIXED, RendezvousSpec, open_store, parse_init_method

if TYPE_CHECKING:
    from ._client import StoreClient
    from ._server import StoreServer

__all__ = [
    "MIXED",
    "TOKEN_METADATA_KEY",
    "GrpcTls",
    "RendezvousSpec",
    "StoreClient",
    "StoreServer",
    "format_address",
    "open_store",
    "parse_init_method",
]


def __getattr__(name: str) -> Any:
    if name == "StoreClient":
        from ._client import StoreClient

        return StoreClient
    if name == "StoreServer":
        from ._server import StoreServer

        return StoreServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
