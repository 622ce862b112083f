"""TLS credentials for gRPC, read once from the options: the gRPC transport's
streams and the rendezvous stores (served and reached with the same
certificates and CA as the workers' connections)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from .._options import RpcOptions

__all__ = ["GrpcTls"]


@dataclass(frozen=True)
class GrpcTls:
    """The certificates (PEM bytes) a gRPC server is served and reached with;
    ``mutual``: the server also requires a client certificate from the CA."""

    cert: bytes
    key: bytes
    ca: bytes
    mutual: bool = True

    @classmethod
    def of(cls, options: RpcOptions) -> GrpcTls | None:
        """The TLS of ``options`` (``None`` without certificates).

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
        return cls(
            pem["tls_cert_file"], pem["tls_key_file"], pem["tls_ca_file"], options.tls_mutual
        )

    def server_credentials(self) -> Any:
        import grpc  # (here: only TLS stores and the gRPC transport need it)

        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.mutual
        )

    def channel_credentials(self) -> Any:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )
