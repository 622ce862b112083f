"""Rendezvous: from ``init_method`` to a connected store client.

Three schemes, as in ``torch.distributed``:

- ``env://`` (the default): ``MASTER_ADDR`` (default ``127.0.0.1``),
  ``MASTER_PORT`` (may be left out when ``world_size == 1``), ``RANK`` and
  ``WORLD_SIZE``.
- ``tcp://host:port`` (``tcp://[::1]:29500`` for IPv6).
- ``file:///abs/path``: rank 0 serves the store on a port the OS picks (host
  ``RPCDIST_STORE_HOST``, default ``127.0.0.1``) and publishes
  ``host:port\\n<server id>\\n<static|dynamic>`` in ``/abs/path.rpcdist``
  (:func:`rendezvous_file`; the last line says whether the job has a world
  size, so that a worker that disagrees is refused even once the store is gone);
  the other ranks read it. The path itself is left alone, for a torch
  ``FileStore`` on the same ``init_method`` (``init_rpc`` then
  ``torch.distributed.init_process_group`` with one file, as hybrid
  DDP + RPC programs and PyTorch's own tests do).

``rank`` and ``world_size`` come from the arguments, else from the URL's
query (``?rank=1&world_size=4``), else from ``RANK`` and ``WORLD_SIZE``.
Rank 0 serves the store; every rank, rank 0 included, is a client of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._deadline import deadline_for, remaining
from .._errors import ConfigError, ConnectError
from ._common import GrpcTls, format_address

if TYPE_CHECKING:  # (imported where used: they load grpc, which init_rpc needs first)
    from ._client import StoreClient
    from ._server import StoreServer

__all__ = [
    "MIXED",
    "Polling",
    "RendezvousSpec",
    "join_file",
    "open_store",
    "parse_init_method",
    "rendezvous_file",
]

logger = logging.getLogger(__name__)

#: PyTorch's words for a worker without a world size meeting a job with one,
#: or the reverse (its tests check them).
MIXED = "RPC group mixes statically and dynamically initialized members which is not supported."
_DIGITS = re.compile(r"[0-9]+")
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
#: How long one attempt to reach the address read from a rendezvous (or
#: secret) file lasts before the file is read again (it may have been
#: replaced meanwhile), and the pauses between readings.
_ATTEMPT_TIMEOUT = 0.5
_POLL_FIRST = 0.01
_POLL_MAX = 0.25


@dataclass(frozen=True)
class RendezvousSpec:
    """Where the store is and who this process is, parsed from ``init_method``.

    ``scheme`` is ``"env"``, ``"tcp"`` or ``"file"``; ``path`` is set for
    ``"file"`` only, whose ``port`` is 0 (picked when rank 0 starts).
    """

    scheme: str
    host: str
    port: int
    rank: int
    world_size: int
    path: str | None

    @property
    def dynamic(self) -> bool:
        """No world size: a dynamic group (``world_size`` is 0)."""
        return self.world_size == 0

    @property
    def address(self) -> str:
        """``host:port`` of the store (IPv6 hosts in brackets)."""
        return format_address(self.host, self.port)


def _integer(raw: str, source: str, expected: str) -> int:
    if not _DIGITS.fullmatch(raw):
        raise ConfigError(f"{source} must be {expected}, got {raw!r}")
    return int(raw)


def _pick(
    name: str,
    arg: int | None,
    query: Mapping[str, str],
    env: Mapping[str, str],
    variable: str,
    url: str,
) -> int:
    """``rank`` or ``world_size``: argument, else URL query, else environment."""
    from_query = None
    if name in query:
        from_query = _integer(query[name], f"{name}= in init_method {url!r}", "an integer")
    if arg is not None:
        if isinstance(arg, bool) or not isinstance(arg, int):
            raise ConfigError(f"{name} must be an int, got {arg!r}")
        if from_query is not None and from_query != arg:
            raise ConfigError(f"{name}={arg} disagrees with {name}={from_query} in {url!r}")
        return arg
    if from_query is not None:
        return from_query
    if variable in env:
        return _integer(env[variable], f"environment variable {variable}", "an integer")
    raise ConfigError(
        f"{name} is not known: pass {name}=, add ?{name}= to init_method {url!r} "
        f"or set the environment variable {variable}"
    )


def _host(raw: str, source: str) -> str:
    host = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw
    if not host or any(c.isspace() or c in "/[]@?#" for c in host):
        raise ConfigError(f"{source} must be a host name or IP address, got {raw!r}")
    return host


def _port(raw: str, source: str) -> int:
    port = _integer(raw, source, "a port number in 0..65535")
    if port > 65535:
        raise ConfigError(f"{source} must be a port number in 0..65535, got {raw!r}")
    return port


def _split_netloc(netloc: str, url: str) -> tuple[str, int]:
    """``host`` and ``port`` of ``tcp://host:port`` (``[v6]:port`` for IPv6)."""
    source = f"init_method {url!r}"
    if netloc.startswith("["):
        host, bracket, rest = netloc[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise ConfigError(f"{source}: expected tcp://[ipv6]:port")
        raw_port = rest[1:]
    else:
        host, colon, raw_port = netloc.rpartition(":")
        if not colon:
            raise ConfigError(f"{source}: expected tcp://host:port, the port is missing")
        if ":" in host:
            raise ConfigError(f"{source}: put an IPv6 address in brackets, tcp://[{host}]:port")
    return _host(host, source), _port(raw_port, f"the port in {source}")


def _query(parts: urllib.parse.SplitResult, url: str) -> dict[str, str]:
    try:
        pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        raise ConfigError(f"init_method {url!r}: malformed query: {exc}") from exc
    query: dict[str, str] = {}
    for key, value in pairs:
        if key not in ("rank", "world_size"):
            raise ConfigError(
                f"init_method {url!r}: unknown parameter {key!r}; expected rank= or world_size="
            )
        if key in query:
            raise ConfigError(f"init_method {url!r}: {key}= is given twice")
        query[key] = value
    return query


def parse_init_method(
    init_method: str | None,
    rank: int | None,
    world_size: int | None,
    env: Mapping[str, str] = os.environ,
    *,
    dynamic: bool = False,
) -> RendezvousSpec:
    """Parse ``init_method`` (``None``: ``env://``) into a :class:`RendezvousSpec`.

    ``dynamic``: a world size given nowhere (argument, query, ``WORLD_SIZE``)
    means a dynamic group (``world_size`` 0) instead of an error.

    Raises:
        ConfigError: A value is missing or invalid; the message names the URL
            or environment variable and what was expected.
    """
    url = "env://" if init_method is None else init_method
    if not isinstance(url, str):
        raise ConfigError(f"init_method must be a string URL or None, got {url!r}")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"init_method {url!r} is not a valid URL: {exc}") from exc
    if parts.scheme not in ("env", "tcp", "file") or "://" not in url:
        raise ConfigError(
            f"init_method {url!r}: expected env://, tcp://host:port or file:///absolute/path"
        )
    if parts.fragment:
        raise ConfigError(f"init_method {url!r}: unexpected fragment #{parts.fragment}")
    query = _query(parts, url)
    if dynamic and world_size is None and "world_size" not in query and "WORLD_SIZE" not in env:
        size = 0
    else:
        size = _pick("world_size", world_size, query, env, "WORLD_SIZE", url)
        if size < 1:
            raise ConfigError(f"world_size must be >= 1, got {size}")
    me = _pick("rank", rank, query, env, "RANK", url)
    if size == 0 and me < 0:
        raise ConfigError(f"rank must be >= 0, got {me}")
    if size and not 0 <= me < size:
        raise ConfigError(f"rank must be in [0, {size}) for world_size {size}, got {me}")
    path = None
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ConfigError(f"init_method {url!r}: expected file:///absolute/path")
        path = urllib.parse.unquote(parts.path)
        host = _host(env.get("RPCDIST_STORE_HOST", "127.0.0.1"), "RPCDIST_STORE_HOST")
        port = 0
    else:
        if parts.path not in ("", "/"):
            raise ConfigError(f"init_method {url!r}: unexpected path {parts.path!r}")
        if parts.scheme == "tcp":
            host, port = _split_netloc(parts.netloc, url)
        else:
            if parts.netloc:
                raise ConfigError(f"init_method {url!r}: env:// takes no address; set MASTER_ADDR")
            host = _host(env.get("MASTER_ADDR", "127.0.0.1"), "MASTER_ADDR")
            if "MASTER_PORT" in env:
                port = _port(env["MASTER_PORT"], "MASTER_PORT")
            elif size == 1:
                port = 0
            else:
                raise ConfigError(
                    f"MASTER_PORT is not set; env:// needs it for "
                    f"{f'world_size {size}' if size else 'a dynamic group'} "
                    "(the port rank 0 serves the store on)"
                )
        if port == 0 and size != 1:
            raise ConfigError(
                f"store port 0 in init_method {url!r} works only for world_size 1: "
                "the other ranks would not know where to connect"
            )
    return RendezvousSpec(parts.scheme, host, port, me, size, path)


async def open_store(
    spec: RendezvousSpec,
    *,
    token: str | None,
    timeout: float,
    tls: GrpcTls | None = None,
    secret_file: str | None = None,
) -> tuple[StoreClient, StoreServer | None]:
    """Connect to the store ``spec`` names; rank 0 serves it first.

    Returns the client and, on rank 0, the server (the caller stops it after
    closing the client). ``timeout`` bounds the whole rendezvous. With
    ``tls``, the store is served and reached over TLS. With ``secret_file``
    (rank 0 of a job without a user token, :mod:`._private`), ``token`` is
    the job's secret, written there once the store listens.

    Raises:
        ConnectError: The store was not reached in time, rank 0 could not
            listen on its address, or the token was rejected.
        ConfigError: ``spec`` is inconsistent or the rendezvous file cannot be
            written or read.
    """
    if spec.scheme == "file":
        if spec.path is None:
            raise ConfigError(f"file:// rendezvous without a path: {spec!r}")
        path = rendezvous_file(spec.path)
        if spec.rank == 0:
            return await _serve_file(spec, path, token, timeout, tls, secret_file)
        return await join_file(path, token, timeout, spec.rank, tls, dynamic=spec.dynamic), None
    from ._client import StoreClient
    from ._server import StoreServer

    server = None
    address = spec.address
    if spec.rank == 0:
        server = StoreServer(token=token, tls=tls, secret_file=secret_file)
        port = await server.start(spec.host, spec.port)
        address = format_address(_WILDCARDS.get(spec.host, spec.host), port)
    elif spec.port == 0:
        raise ConfigError(f"rank {spec.rank} cannot find a store on port 0 ({spec!r})")
    store = StoreClient(address, token=token, timeout=timeout, rank=spec.rank, tls=tls)
    try:
        if server is not None:
            _publish_secret(server, token)
        await store.connect()
    except BaseException:
        await store.close()
        if server is not None:
            await server.stop(0)
        raise
    return store, server


def rendezvous_file(path: str) -> str:
    """The file rpcdist's ``file://`` rendezvous at ``path`` uses: beside it,
    so that ``path`` stays free for a torch ``FileStore`` on the same URL."""
    return path + ".rpcdist"


def _publish_secret(server: StoreServer, token: str | None) -> None:
    """Write the job's secret to the server's secret file, if it has one
    (after the server bound its port: the address is then ours)."""
    if server.secret_file is not None and token is not None:
        from ._secret_file import write_secret

        server.files.append(server.secret_file)
        write_secret(server.secret_file, token, server.server_id)


class Polling:
    """Rounds of reading a file rank 0 writes, until ``timeout`` (``None``/0: none)."""

    def __init__(self, timeout: float | None) -> None:
        self._deadline = deadline_for(timeout, None)
        self._delay = _POLL_FIRST

    def attempt(self) -> float:
        """How long one attempt to reach a store may last now."""
        left = remaining(self._deadline)
        return _ATTEMPT_TIMEOUT if left is None else min(left, _ATTEMPT_TIMEOUT)

    async def pause(self) -> bool:
        """Wait before the next round; ``False`` (at once) if time is up."""
        left = remaining(self._deadline)
        if left is not None and left <= 0:
            return False
        await asyncio.sleep(self._delay if left is None else min(self._delay, left))
        self._delay = min(2 * self._delay, _POLL_MAX)
        return True


def _file_contents(address: str, server_id: str, dynamic: bool) -> str:
    return f"{address}\n{server_id}\n{'dynamic' if dynamic else 'static'}\n"


async def _serve_file(
    spec: RendezvousSpec,
    path: str,
    token: str | None,
    timeout: float,
    tls: GrpcTls | None,
    secret_file: str | None,
) -> tuple[StoreClient, StoreServer]:
    from ._client import StoreClient
    from ._server import FileStoreServer

    server = FileStoreServer(token=token, path=path, tls=tls, secret_file=secret_file)
    port = await server.start(spec.host, 0)
    advertised = socket.gethostname() if spec.host in _WILDCARDS else spec.host
    store = StoreClient(
        format_address(_WILDCARDS.get(spec.host, spec.host), port),
        token=token,
        timeout=timeout,
        rank=spec.rank,
        tls=tls,
    )
    try:
        _publish_secret(server, token)  # before the rendezvous file names the store
        temporary = f"{path}.{server.server_id}.tmp"
        try:
            with open(temporary, "w", encoding="utf-8") as file:
                file.write(
                    _file_contents(format_address(advertised, port), server.server_id, spec.dynamic)
                )
            os.replace(temporary, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(temporary)
            raise ConfigError(f"cannot write the rendezvous file {path!r}: {exc}") from exc
        await store.connect()
    except BaseException:
        await store.close()
        await server.stop(0)
        raise
    logger.debug("rank 0 published store %s:%d in %s", advertised, port, path)
    return store, server


def _read_file(path: str) -> tuple[str, str, str | None] | str:
    """``(address, server id, "static" or "dynamic")`` from a rendezvous
    file (``None``: an older file that does not say), or why there is none."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        return "the file does not exist yet"
    except UnicodeDecodeError:
        return "the file holds something other than a store address"
    except OSError as exc:
        raise ConfigError(f"cannot read the rendezvous file {path!r}: {exc}") from exc
    lines = text.splitlines()
    if len(lines) < 2 or ":" not in lines[0] or not lines[1]:
        return f"the file holds {text[:80]!r}, not a store address and server id"
    return lines[0], lines[1], lines[2] if len(lines) > 2 else None


async def join_file(
    path: str,
    token: str | None,
    timeout: float,
    rank: int | None = None,
    tls: GrpcTls | None = None,
    probe: bool = False,
    *,
    dynamic: bool | None = None,
) -> StoreClient:
    """Connect to the store whose address rank 0 wrote to ``path``
    (``probe``: see :class:`StoreClient`).

    The file may be stale (left by an earlier run) until rank 0 replaces it,
    so an address that fails, rejects the token or answers with another
    server id sends us back to reading the file until the deadline.

    Raises:
        ConnectError: no store of the file's was reached in time.
        ConfigError: the file's job has a world size and ``dynamic`` (this
            worker) has none, or the reverse (:data:`MIXED`).
    """
    from ._client import StoreClient

    polling = Polling(timeout)
    problem = "the file does not exist yet"
    while True:
        found = _read_file(path)
        if isinstance(found, str):
            problem = found
        else:
            address, server_id, mode = found
            if dynamic is not None and mode is not None and dynamic != (mode == "dynamic"):
                raise ConfigError(
                    f"{MIXED} (rpcdist: rank {rank} was started "
                    f"{'without' if dynamic else 'with'} a world size, but the rendezvous file "
                    f"{path!r} names the store of a {mode} group (a file left by an earlier "
                    "job is replaced when its rank 0 starts): pass the same world_size to "
                    "every worker, or none to any)"
                )
            store = StoreClient(
                address, token=token, timeout=timeout, rank=rank, tls=tls, probe=probe
            )
            try:
                await store.connect(timeout=polling.attempt())
            except ConnectError as exc:
                if f"[store {server_id}]" in str(exc):  # the file's own store refused us
                    await store.close()
                    raise
                problem = f"the file names {address}, which failed: {exc}"
            except BaseException:
                await store.close()
                raise
            else:
                if store.server_id == server_id:
                    return store
                problem = f"the file names {address}, which is another store than the file's"
            await store.close()
        if not await polling.pause():
            raise ConnectError(
                f"no store found through the rendezvous file {path!r} within {timeout}s: {problem}"
            )
