"""The rendezvous key-value store (served by rank 0 over gRPC) and ``init_method`` parsing."""

from ._client import StoreClient
from ._common import TOKEN_METADATA_KEY, GrpcTls, format_address
from ._rendezvous import RendezvousSpec, open_store, parse_init_method
from ._server import StoreServer

__all__ = [
    "TOKEN_METADATA_KEY",
    "GrpcTls",
    "RendezvousSpec",
    "StoreClient",
    "StoreServer",
    "format_address",
    "open_store",
    "parse_init_method",
]
