"""What the store's server and client share: the service name, the token
metadata key, gRPC message limits, TLS credentials and address formatting."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from .._errors import ConfigError
from .._options import RpcOptions

__all__ = [
    "BARRIER_PREFIX",
    "INT64",
    "MESSAGE_OPTIONS",
    "RANK_METADATA_KEY",
    "REFUSED_KEY",
    "SERVICE",
    "TOKEN_METADATA_KEY",
    "StoreTls",
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


@dataclass(frozen=True)
class StoreTls:
    """The certificates (PEM bytes) the store is served and reached with.

    A job with TLS certificates talks to its rendezvous store over TLS too,
    with the same certificates and CA as the workers' connections, so that
    the job token in each request is never in clear; ``mutual``: the server
    also requires a client certificate from the CA.
    """

    cert: bytes
    key: bytes
    ca: bytes
    mutual: bool = True

    @classmethod
    def of(cls, options: RpcOptions) -> StoreTls | None:
        """The store's TLS for ``options`` (``None`` without certificates).

        Raises:
            ConfigError: a certificate, key or CA file cannot be read.
        """
        if not options.tls:
            return None
        files = {
            "tls_cert_file": options.tls_cert_file,
            "tls_key_file": options.tls_key_file,
            "tls_ca_file": options.tls_ca_file,
        }
        pem: dict[str, bytes] = {}
        for name, path in files.items():
            try:
                pem[name] = Path(path or "").read_bytes()
            except OSError as e:
                raise ConfigError(f"cannot read RpcOptions.{name} {path!r}: {e}") from e
        return cls(pem["tls_cert_file"], pem["tls_key_file"], pem["tls_ca_file"],
                   options.tls_mutual)  # fmt: skip

    def server_credentials(self) -> Any:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.mutual
        )

    def channel_credentials(self) -> Any:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )
