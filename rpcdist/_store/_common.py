"""What the store's server and client share: the service name, the token
metadata key, gRPC message limits, TLS credentials (the transport's
:class:`GrpcTls`) and address formatting."""

from __future__ import annotations

from .._transport._grpc_tls import GrpcTls

__all__ = [
    "BARRIER_PREFIX",
    "INT64",
    "MESSAGE_OPTIONS",
    "RANK_METADATA_KEY",
    "REFUSED_KEY",
    "SERVICE",
    "TOKEN_METADATA_KEY",
    "GrpcTls",
    "format_address",
]

#: gRPC metadata key that carries the job token on every store call.
TOKEN_METADATA_KEY = "rpcdist-token"
#: gRPC metadata key naming the caller's rank (for the server's refusal report).
RANK_METADATA_KEY = "rpcdist-rank"
#: A key ``get`` can wait on: set to a description of the first caller the
#: server refused for its token (it is not counted among the keys stored).
REFUSED_KEY = "rpcdist/refused"

SERVICE = "rpcdist.v1.Store"
BARRIER_PREFIX = "rpcdist/barrier/"
INT64 = range(-(2**63), 2**63)

MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal host in brackets (``[::1]:29500``)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"
