"""Agent options: :class:`RpcOptions`."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import socket
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._errors import ConfigError

if TYPE_CHECKING:
    from ._faults import FaultInjector

__all__ = ["CALLABLE_POLICIES", "RpcOptions", "callable_entry", "is_loopback"]

_MiB = 1 << 20
_GiB = 1 << 30

#: ``RpcOptions.callable_policy`` values (``"denylist"``: a deprecated alias
#: of ``"exposed"``).
CALLABLE_POLICIES = ("exposed", "allowlist", "any", "denylist")


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def _shm_env() -> int | str | None:
    """``RPCDIST_SHM_THRESHOLD``: bytes, ``off`` (None) or ``auto`` (the default)."""
    v = os.environ.get("RPCDIST_SHM_THRESHOLD", "auto").strip().lower()
    if v in ("off", "none", "0"):
        return None
    return int(v) if v.isdigit() else v


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def callable_entry(entry: Any) -> str:
    """An ``allowed_callables`` entry as a string: ``"module"`` (every function
    in it and its submodules) or ``"module:qualname"`` (one function or class).

    Raises:
        ConfigError: ``entry`` is neither a string, a module nor a named callable.
    """
    if isinstance(entry, str):
        module, _, qualname = entry.partition(":")
        if (
            module
            and all(p.isidentifier() for p in module.split("."))
            and (not qualname or all(p.isidentifier() for p in qualname.split(".")))
        ):
            return entry
    elif isinstance(entry, types.ModuleType):
        return entry.__name__
    else:
        mod = getattr(entry, "__module__", None)
        qual = getattr(entry, "__qualname__", None)
        if isinstance(mod, str) and isinstance(qual, str) and "<" not in qual:
            return f"{mod}:{qual}"
    raise ConfigError(
        "RpcOptions.allowed_callables entries must be modules, module-level functions or "
        f"classes, or strings 'module' / 'module:qualname'; got {entry!r}"
    )


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
            Defaults to ``RPCDIST_TLS_CERT``.
        tls_key_file: PEM private key for ``tls_cert_file``; defaults to
            ``RPCDIST_TLS_KEY``.
        tls_ca_file: PEM root certificates used to verify peers; defaults to
            ``RPCDIST_TLS_CA``. Peers are dialled by address, so their
            certificates must name it (an IP or DNS subject alternative name).
        chunk_bytes: Largest piece of array data in one frame.
        batch_bytes: Largest payload coalesced into one gRPC message.
        init_timeout: Seconds to wait for rendezvous with every worker.
        shutdown_timeout: Default bound on a graceful shutdown's drain, once
            every live worker has called ``shutdown`` (waiting for them to
            call it is bounded only by ``shutdown(timeout=...)``).
        control_retry_interval: Seconds before an unacknowledged control
            message (RRef protocol, cleanup) is sent again.
        faults: A fault injector for tests (see ``rpcdist.testing``).
        shm_threshold_bytes: Payloads at least this large, to a worker on the
            same host, travel through a reused /dev/shm segment instead of
            the stream (one copy; docs/design.md); ``None`` turns this off.
            ``"auto"``: 1 MiB, or off with TLS (payloads then stay in the
            encrypted stream). Default: ``RPCDIST_SHM_THRESHOLD`` (bytes,
            ``off`` or ``auto``), else ``"auto"``.
        local_sockets: On the TCP transport, reach workers on the same host
            (same hostname, boot id, /dev/shm and pid namespace, learnt at rendezvous) through a Unix
            socket in Linux's abstract namespace instead of loopback TCP: the
            same frames and job-token hello, with more bulk bandwidth and a
            cheaper send per message (docs/design.md). A peer whose
            socket cannot be reached (another network namespace) is dialled
            over TCP instead. Defaults to on unless ``RPCDIST_LOCAL_SOCKETS=0``;
            turn it off to measure the cross-host TCP path on one machine.
        sync_channels: Connections per peer that ``rpc_sync`` may drive from
            the calling thread itself (TCP transport, when this worker has
            no other calls in flight), each served at
            the callee by a thread of its own: a round trip then wakes two
            threads instead of four (docs/design.md, "Blocking calls"). Also
            the most such connections a worker serves per peer. ``0`` turns
            this off. Defaults to ``RPCDIST_SYNC_CHANNELS`` or 4.
        busy_poll_us: On those connections, how long (microseconds) a thread
            waiting for a reply, or for the next call it serves, polls its
            socket without sleeping before it sleeps in ``poll``. A reply
            that comes within it is read by a thread that never slept, which
            saves the wake-up (tens of microseconds on a virtual machine) and
            keeps the core warm. A thread polls only when the last wait of
            its kind (a reply to the same function on the same worker) was
            that short, only one thread of a process polls at a time,
            and not while this worker runs other handlers, has bytes coming
            for another of its threads, or shares its process with other
            agents (they would wait for the GIL), nor while more threads
            are runnable on the host than it has cores. ``0`` turns it off.
            Defaults to ``RPCDIST_BUSY_POLL_US`` or 1000: long enough for a
            handler that computes for a few hundred microseconds
            (docs/design.md, "Blocking calls").
        gil_switch_us: While agents run in this process, how long
            (microseconds) a thread that needs the GIL waits before Python
            makes the thread holding it let go (``sys.setswitchinterval``).
            Python's own 5 ms is what a call's handler and reply wait behind
            a compute thread of the worker that holds the GIL (a pure-Python
            loop; NumPy and PyTorch kernels release it): each such wait
            costs a call up to that long. Set when the first agent starts,
            only if the program left Python's default in place, and put
            back when the last one shuts down (if nothing changed it
            meanwhile). ``None`` (or ``"off"``) leaves it alone. Defaults to
            ``RPCDIST_GIL_SWITCH_US`` or 500.
        transport: How frames move: ``"tcp"`` (plain sockets, the default
            path, with or without TLS), ``"grpc"`` (gRPC streams), ``"inproc"``
            (agents of one process linked in memory, for tests) or ``"auto"``
            (the default: ``"tcp"``). Defaults to ``RPCDIST_TRANSPORT``.
        ignore_rref_leaks: Let a graceful shutdown succeed even when RRef values
            owned here are still referenced by forks that were never deleted
            (by default it raises ``RRefError`` naming them).
        allow_insecure: Let a worker without a job token or TLS listen beyond
            loopback (``listen_host``, or rank 0's store address). Off by
            default: such a worker would run calls from anyone who can reach
            it, so it is refused with ``ConfigError``. Turn it on only on a
            network you trust completely.
        tls_mutual: With TLS, also require and verify a certificate from every
            connecting worker (mutual TLS; the default). Off: only servers
            are verified, and peers are authenticated by the job token.
        max_message_bytes: Largest message (its arrays' bytes together) a
            worker accepts or sends. A peer announcing a larger one is refused
            with ``ProtocolError`` before anything is allocated and its
            connection is dropped; sending one raises ``SerializationError``.
            Default 2 GiB.
        heartbeat_interval: Seconds of silence on a link after which this
            worker sends a heartbeat on it (only idle links carry them).
        peer_timeout: Seconds without a byte from a linked peer (heartbeats
            included) after which it is suspected. A suspect on this host
            whose process is stopped (SIGSTOP) is then declared lost: calls,
            RRefs, collectives and autograd contexts involving it fail with
            ``WorkerLostError``, and it is never dialled again. One whose
            process still runs is only paused (see ``pause_timeout``); one on
            another host is declared lost after four times this, or twice the
            longest silence it ended itself. ``None`` turns the failure
            detector off (hangs are then found only by deadlines). Default
            3 s: a stopped peer on this host is declared lost 3 to 4 s after
            it stops, one on another host after 12 s (docs/failure-model.md).
        pause_timeout: The longest silence tolerated from a peer that is
            still running (a garbage collection or a native call holding its
            GIL): on this host, seen running through ``/proc``; on another
            host, the cap of its adaptive window. Default 30 s.
        callable_policy: Which functions peers may call here by name (and
            send as arguments, call as methods through RRef proxies):
            ``"exposed"`` (the default) admits only what the program exposes:
            its own functions and classes (``__main__`` and the modules it
            has imported from outside the standard library and
            site-packages), ``allowed_callables``, those decorated with
            ``@rpcdist.expose``, a curated set of pure numerical functions
            (``math``, ``operator``, NumPy's and torch's array math) and
            rpcdist's protocol entry points; a peer's call never imports a
            module. ``"allowlist"`` admits only ``allowed_callables``,
            ``@rpcdist.expose`` and the protocol entry points. ``"any"``
            admits every importable callable (fully trusted clusters only).
            ``"denylist"`` is a deprecated alias of ``"exposed"``. A refused
            call raises ``CallPolicyError`` at the caller, naming the option
            that would admit it.
        allowed_callables: Functions, classes or modules (or their names,
            ``"module"`` / ``"module:qualname"``) peers may call even where
            the policy would refuse them (an installed package of the
            program's own is admitted by naming it; a named module may be
            imported by a peer's call); with ``"allowlist"``, the only ones.
        cuda_ipc: Send large CuPy arrays to workers on the same host through
            CUDA IPC (device to device, no copy through host memory), once a
            probe has shown the peer can map this worker's device memory;
            otherwise, and when off, they travel through host memory.
            Defaults to ``RPCDIST_CUDA_IPC`` or on.
    """

    token: str | None = field(default_factory=lambda: os.environ.get("RPCDIST_TOKEN") or None)
    allow_pickle: bool = False
    listen_host: str = field(default_factory=lambda: os.environ.get("RPCDIST_HOST", "127.0.0.1"))
    advertise_host: str | None = None
    tls_cert_file: str | None = field(default_factory=lambda: _env("RPCDIST_TLS_CERT"))
    tls_key_file: str | None = field(default_factory=lambda: _env("RPCDIST_TLS_KEY"))
    tls_ca_file: str | None = field(default_factory=lambda: _env("RPCDIST_TLS_CA"))
    tls_mutual: bool = True
    allow_insecure: bool = False
    chunk_bytes: int = 4 * _MiB
    batch_bytes: int = 4 * _MiB
    init_timeout: float = 60.0
    shutdown_timeout: float = 60.0
    control_retry_interval: float = 1.0
    faults: FaultInjector | None = None
    shm_threshold_bytes: int | str | None = field(default_factory=lambda: _shm_env())
    ignore_rref_leaks: bool = False
    transport: str = field(default_factory=lambda: os.environ.get("RPCDIST_TRANSPORT", "auto"))
    local_sockets: bool = field(
        default_factory=lambda: os.environ.get("RPCDIST_LOCAL_SOCKETS", "1") != "0"
    )
    sync_channels: int | str = field(
        default_factory=lambda: os.environ.get("RPCDIST_SYNC_CHANNELS", "4")
    )
    busy_poll_us: float | str = field(
        default_factory=lambda: os.environ.get("RPCDIST_BUSY_POLL_US", "1000")
    )
    gil_switch_us: float | str | None = field(
        default_factory=lambda: os.environ.get("RPCDIST_GIL_SWITCH_US", "500")
    )
    max_message_bytes: int = 2 * _GiB
    heartbeat_interval: float = 0.5
    peer_timeout: float | None = 3.0
    pause_timeout: float = 30.0
    callable_policy: str = "exposed"
    allowed_callables: tuple[Any, ...] = ()
    cuda_ipc: bool = field(default_factory=lambda: os.environ.get("RPCDIST_CUDA_IPC", "1") != "0")

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
        spin = _microseconds(self.busy_poll_us, "busy_poll_us", 0) or 0.0
        switch = _microseconds(self.gil_switch_us, "gil_switch_us", 1, off=True)
        if self.transport not in ("auto", "tcp", "grpc", "inproc"):
            raise ConfigError(
                "RpcOptions.transport must be 'auto', 'tcp', 'grpc' or 'inproc', "
                f"got {self.transport!r}"
            )
        if self.transport == "inproc" and self.tls:
            raise ConfigError("RpcOptions.transport='inproc' moves no bytes and does no TLS")
        m = self.max_message_bytes
        if not isinstance(m, int) or isinstance(m, bool) or m < 1 << 16:
            raise ConfigError(f"RpcOptions.max_message_bytes must be an int >= 65536, got {m!r}")
        hb = self.heartbeat_interval
        if not isinstance(hb, int | float) or isinstance(hb, bool) or hb <= 0:
            raise ConfigError(
                f"RpcOptions.heartbeat_interval must be a positive number, got {hb!r}"
            )
        pt = self.peer_timeout
        if pt is not None and (not isinstance(pt, int | float) or isinstance(pt, bool) or pt < hb):
            raise ConfigError(
                "RpcOptions.peer_timeout must be None or a number of seconds >= "
                f"heartbeat_interval ({hb}), got {pt!r}"
            )
        pz = self.pause_timeout
        if not isinstance(pz, int | float) or isinstance(pz, bool) or pz < (pt or hb):
            raise ConfigError(
                "RpcOptions.pause_timeout must be a number of seconds >= peer_timeout "
                f"({pt}), got {pz!r}"
            )
        if self.callable_policy not in CALLABLE_POLICIES:
            raise ConfigError(
                f"RpcOptions.callable_policy must be one of {CALLABLE_POLICIES}, "
                f"got {self.callable_policy!r}"
            )
        policy = self.callable_policy
        if policy == "denylist":
            warnings.warn(
                "RpcOptions(callable_policy='denylist') is deprecated: it now means the "
                "default, 'exposed' (peers call only what the program exposes)",
                DeprecationWarning,
                stacklevel=3,
            )
            policy = "exposed"
        if not isinstance(self.allowed_callables, tuple | list | frozenset | set):
            raise ConfigError(
                "RpcOptions.allowed_callables must be a tuple of functions, modules or names, "
                f"got {type(self.allowed_callables).__name__}"
            )
        allowed = tuple(sorted({callable_entry(e) for e in self.allowed_callables}))
        if self.token == "":
            raise ConfigError("RpcOptions.token must not be empty (use None for no token)")
        if not self.token and not self.tls and not self.allow_insecure:
            host = self.listen_host.strip("[]")
            if not is_loopback(host or "0.0.0.0"):
                raise ConfigError(
                    f"RpcOptions.listen_host={self.listen_host!r} (or RPCDIST_HOST) would accept "
                    "calls from beyond this host with no job token and no TLS: set a token "
                    "(RpcOptions.token or RPCDIST_TOKEN; rpcdist-run sets one), configure TLS, "
                    "or pass RpcOptions(allow_insecure=True) on a network you trust"
                )
        return dataclasses.replace(
            self,
            sync_channels=n,
            busy_poll_us=spin,
            gil_switch_us=switch,
            callable_policy=policy,
            allowed_callables=allowed,
        )

    def check_store_host(self, host: str, rank: int = 0) -> None:
        """Refuse to serve (rank 0) or meet at the rendezvous store beyond
        loopback without a token: a job without one shares its secret through
        a file on one host.

        Raises:
            ConfigError: ``host`` is not a loopback address and neither a token
                nor ``allow_insecure`` is set.
        """
        if self.token or self.allow_insecure or is_loopback(host or "0.0.0.0"):
            return
        what = "serve the rendezvous store" if rank == 0 else "meet its job at the store"
        raise ConfigError(
            f"rank {rank} would {what} on {host!r} (MASTER_ADDR or the init_method), beyond "
            "this host, with no job token: set the same token on every rank (RpcOptions.token "
            "or RPCDIST_TOKEN; rpcdist-run sets one) or pass RpcOptions(allow_insecure=True) "
            "on a network you trust"
        )

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def data_transport(self) -> str:
        """The transport ``transport`` resolves to: ``"tcp"``, ``"grpc"`` or ``"inproc"``."""
        if self.transport == "auto":
            return "tcp"
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
        if t == "auto":  # (with TLS, payloads stay in the encrypted stream)
            return None if self.tls else 1 << 20
        return t if isinstance(t, int) else None

    def peer_host(self) -> str:
        """The host peers should dial to reach this worker."""
        if self.advertise_host:
            return self.advertise_host
        if self.listen_host in ("0.0.0.0", "::", "[::]", ""):
            return "127.0.0.1"
        return self.listen_host


_OFF_HINT = ", None or 'off'"


def _microseconds(value: Any, name: str, least: float, *, off: bool = False) -> float | None:
    """``RpcOptions.<name>`` (or its environment variable) as a number of
    microseconds in ``[least, 1e6]``; with ``off``, None for None or ``"off"``.

    Raises:
        ConfigError: it is not one.
    """
    v = value
    if off and (v is None or (isinstance(v, str) and v.strip().lower() in ("off", "none", ""))):
        return None
    with contextlib.suppress(ValueError):
        v = float(v) if isinstance(v, str) else v
    if not isinstance(v, int | float) or isinstance(v, bool) or not least <= v <= 1_000_000:
        raise ConfigError(
            f"RpcOptions.{name} (or RPCDIST_{name.upper()}) must be a number of microseconds "
            f"in [{least:g}, 1e6]{_OFF_HINT if off else ''}, got {value!r}"
        )
    return float(v)
