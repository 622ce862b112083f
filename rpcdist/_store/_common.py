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
    "SECRET_FILE_REFUSAL",
    "SERVICE",
    "TOKEN_METADATA_KEY",
    "GrpcTls",
    "format_address",
]

#: gRPC metadata key that carries the job token on every store call.
TOKEN_METADATA_KEY = "rpcdist-token"
#: gRPC metadata key naming the caller's rank (for the server's refusal report).
RANK_METADATA_KEY = "rpcdist-rank"
#: A key that is always set: how many callers the server refused for their
#: token and from where, ``b""`` if none (it is not counted among the keys stored).
REFUSED_KEY = "rpcdist/refused"
#: What a store guarded by a per-user secret file says to a caller it refuses
#: (a rank that has no token looks for it to tell a job with ``RPCDIST_TOKEN``,
#: which it cannot join, from one whose secret file it may yet find).
SECRET_FILE_REFUSAL = (
    "this job has no RPCDIST_TOKEN: its secret is in a file only its user can read"
)

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
