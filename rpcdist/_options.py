"""Agent options: :class:`RpcOptions`."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._errors import ConfigError

if TYPE_CHECKING:
    from ._transport._faulty import FaultInjector

__all__ = ["RpcOptions"]

_MiB = 1 << 20


@dataclass(frozen=True)
class RpcOptions:
    """Options for one agent, passed as ``init_rpc(..., options=RpcOptions(...))``.

    Frozen: derive a changed copy with ``dataclasses.replace(options, ...)``.

    Attributes:
        token: Shared job token checked on every stream and store call. Defaults
            to the ``RPCDIST_TOKEN`` environment variable; ``None`` disables
            authentication (only sensible on a trusted loopback).
        allow_pickle: Let values of unregistered types travel as pickles.
            Off by default: only turn it on inside a trusted cluster.
        listen_host: Address the agent's server binds to (its port is picked by
            the OS). Defaults to ``RPCDIST_HOST`` or ``127.0.0.1``.
        advertise_host: Address peers use to reach this worker; defaults to
            ``listen_host`` (or ``127.0.0.1`` when that is a wildcard).
        tls_cert_file: PEM certificate chain for this worker (TLS on when set).
        tls_key_file: PEM private key for ``tls_cert_file``.
        tls_ca_file: PEM root certificates used to verify peers.
        chunk_bytes: Largest piece of array data in one frame.
        batch_bytes: Largest payload coalesced into one gRPC message.
        init_timeout: Seconds to wait for rendezvous with every worker.
        shutdown_timeout: Default bound on a graceful shutdown.
        control_retry_interval: Seconds before an unacknowledged control
            message (RRef protocol, cleanup) is sent again.
        faults: A fault injector for tests (see ``rpcdist.testing``).
        shm_threshold_bytes: Payloads at least this large, to a worker on the
            same host, travel through a /dev/shm file instead of the stream;
            ``None`` turns this off. ``"auto"`` (the default): 1 MiB on the
            gRPC transport (where it saves two of three copies), off on the
            TCP transport (whose socket path measured 3-4x faster than a
            fresh /dev/shm file per message; docs/design.md).
        local_sockets: On the TCP transport, reach workers on the same host
            (same hostname and boot id, learnt at rendezvous) through a Unix
            socket in Linux's abstract namespace instead of loopback TCP: the
            same frames and job-token hello, with about 1.7x the bulk bandwidth
            and a cheaper send per message (docs/design.md). A peer whose
            socket cannot be reached (another network namespace) is dialled
            over TCP instead. Defaults to on unless ``RPCDIST_LOCAL_SOCKETS=0``;
            turn it off to measure the cross-host TCP path on one machine.
        sync_channels: Connections per peer that ``rpc_sync`` may drive from
            the calling thread itself (TCP transport, requests up to 64 KiB,
            when this worker has no other calls in flight), each served at
            the callee by a thread of its own: a round trip then wakes two
            threads instead of four (docs/design.md, "Blocking calls"). Also
            the most such connections a worker serves per peer. ``0`` turns
            this off. Defaults to ``RPCDIST_SYNC_CHANNELS`` or 4.
        transport: How frames move: ``"tcp"`` (plain sockets, the default
            path), ``"grpc"`` (gRPC streams; TLS), ``"inproc"`` (agents of one
            process linked in memory, for tests) or ``"auto"`` (the default:
            ``"grpc"`` when TLS is configured, else ``"tcp"``). Defaults to
            ``RPCDIST_TRANSPORT``.
        ignore_rref_leaks: Let a graceful shutdown succeed even when RRef values
            owned here are still referenced by forks that were never deleted
            (by default it raises ``RRefError`` naming them).
    """

    token: str | None = field(default_factory=lambda: os.environ.get("RPCDIST_TOKEN") or None)
    allow_pickle: bool = False
    listen_host: str = field(default_factory=lambda: os.environ.get("RPCDIST_HOST", "127.0.0.1"))
    advertise_host: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    chunk_bytes: int = 4 * _MiB
    batch_bytes: int = 4 * _MiB
    init_timeout: float = 60.0
    shutdown_timeout: float = 60.0
    control_retry_interval: float = 1.0
    faults: FaultInjector | None = None
    shm_threshold_bytes: int | str | None = "auto"
    ignore_rref_leaks: bool = False
    transport: str = field(default_factory=lambda: os.environ.get("RPCDIST_TRANSPORT", "auto"))
    local_sockets: bool = field(
        default_factory=lambda: os.environ.get("RPCDIST_LOCAL_SOCKETS", "1") != "0"
    )
    sync_channels: int | str = field(
        default_factory=lambda: os.environ.get("RPCDIST_SYNC_CHANNELS", "4")
    )

    __module__ = "rpcdist"

    def validated(self) -> RpcOptions:
        """A checked copy of these options.

        Raises:
            ConfigError: an option is out of range or inconsistent.
        """
        for name in ("chunk_bytes", "batch_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1024:
                raise ConfigError(f"RpcOptions.{name} must be an int >= 1024, got {v!r}")
        for name in ("init_timeout", "shutdown_timeout", "control_retry_interval"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or v <= 0:
                raise ConfigError(f"RpcOptions.{name} must be a positive number, got {v!r}")
        t = self.shm_threshold_bytes
        if (
            t is not None
            and t != "auto"
            and (not isinstance(t, int) or isinstance(t, bool) or t < 1)
        ):
            raise ConfigError(
                f"RpcOptions.shm_threshold_bytes must be a positive int, 'auto' or None, got {t!r}"
            )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("RpcOptions.tls_cert_file and tls_key_file must be set together")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ConfigError("RpcOptions.tls_ca_file is required with TLS (to verify peers)")
        n = self.sync_channels
        if isinstance(n, str):
            try:
                n = int(n)
            except ValueError:
                raise ConfigError(
                    f"RpcOptions.sync_channels (or RPCDIST_SYNC_CHANNELS) must be an int >= 0, "
                    f"got {n!r}"
                ) from None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"RpcOptions.sync_channels must be an int >= 0, got {n!r}")
        if self.transport not in ("auto", "tcp", "grpc", "inproc"):
            raise ConfigError(
                "RpcOptions.transport must be 'auto', 'tcp', 'grpc' or 'inproc', "
                f"got {self.transport!r}"
            )
        if self.transport == "tcp" and self.tls:
            raise ConfigError(
                "RpcOptions.transport='tcp' does not do TLS: use 'grpc' (or 'auto') with TLS"
            )
        return dataclasses.replace(self, sync_channels=n)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def data_transport(self) -> str:
        """The transport ``transport`` resolves to: ``"tcp"``, ``"grpc"`` or ``"inproc"``."""
        if self.transport == "auto":
            return "grpc" if self.tls else "tcp"
        return self.transport

    @property
    def unix_sockets(self) -> bool:
        """Whether same-host peers use Unix sockets (``local_sockets``, where possible)."""
        return (
            bool(self.local_sockets)
            and self.data_transport == "tcp"
            and hasattr(socket, "AF_UNIX")
            and sys.platform.startswith("linux")  # abstract namespace
        )

    @property
    def payload_shm_threshold(self) -> int | None:
        """``shm_threshold_bytes`` with ``"auto"`` resolved for the transport."""
        t = self.shm_threshold_bytes
        if t == "auto":
            return (1 << 20) if self.data_transport == "grpc" else None
        return t if isinstance(t, int) else None

    def peer_host(self) -> str:
        """The host peers should dial to reach this worker."""
        if self.advertise_host:
            return self.advertise_host
        if self.listen_host in ("0.0.0.0", "::", "[::]", ""):
            return "127.0.0.1"
        return self.listen_host
