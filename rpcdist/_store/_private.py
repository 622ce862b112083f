"""Rendezvous of a job without a token: its secret travels through a per-user file.

Rank 0 makes a random secret, serves the store guarded by it and writes it to
a file only its user can read (:mod:`._secret_file`); the other ranks wait
for that file, then reach the store with the secret. So the store hands the
secret to nobody, and a process of another user can neither read it nor
reach the store. Such a job works only on one host and for one user; across
hosts or users the job needs ``RPCDIST_TOKEN`` (the launcher sets one).
"""

from __future__ import annotations

import os
import secrets
from typing import TYPE_CHECKING

from .._errors import ConnectError
from ._common import SECRET_FILE_REFUSAL, GrpcTls, format_address
from ._rendezvous import Polling, join_file, open_store, rendezvous_file
from ._secret_file import read_secret, secret_path

if TYPE_CHECKING:
    from ._client import StoreClient
    from ._rendezvous import RendezvousSpec
    from ._server import StoreServer

__all__ = ["open_private_store", "private_secret_path"]

_PROBE_TIMEOUT = 0.2
_LOOPBACK_NAMES = {"localhost": "127.0.0.1"}


def private_secret_path(spec: RendezvousSpec) -> str:
    """The secret file of the job that meets at ``spec`` (the same on every rank).

    Raises:
        ConfigError: the runtime directory is not private to this user.
    """
    if spec.scheme == "file" and spec.path is not None:
        where = f"file:{os.path.abspath(spec.path)}"
    else:
        where = format_address(_LOOPBACK_NAMES.get(spec.host, spec.host), spec.port)
    return secret_path(where)


async def open_private_store(
    spec: RendezvousSpec, *, timeout: float, tls: GrpcTls | None = None
) -> tuple[StoreClient, StoreServer | None, str]:
    """Connect to (rank 0: serve) the store of a job without a token.

    Returns the client, rank 0's server and the job's secret (which guards
    the store and is the links' token).

    Raises:
        ConnectError: no store of this job was reached in time (the message
            says what was found instead), or the store asks for a token
            (``RPCDIST_TOKEN``) that this rank does not have.
        ConfigError: the secret file or its directory is not private, or
            cannot be written.
    """
    if spec.rank == 0:
        secret = secrets.token_hex(16)
        # (a job of one has nobody to share the secret with: no file)
        path = private_secret_path(spec) if spec.world_size != 1 else None
        store, server = await open_store(
            spec, token=secret, timeout=timeout, tls=tls, secret_file=path
        )
        return store, server, secret
    path = private_secret_path(spec)
    store = await _join(spec, path, timeout, tls)
    return store, None, store.token or ""


async def _join(
    spec: RendezvousSpec, path: str, timeout: float, tls: GrpcTls | None
) -> StoreClient:
    """Wait for rank 0's secret file, then reach the store it names.

    The file may be stale (left by an earlier job that met here) until rank 0
    replaces it: a store that refuses the secret, or that is not the one the
    file names, sends us back to reading the file until the deadline.
    """
    polling = Polling(timeout)
    while True:
        found = read_secret(path)
        if isinstance(found, str):
            problem = found
            await _probe(spec, tls)
        else:
            secret, server_id = found
            try:
                store = await _reach(spec, secret, polling.attempt(), timeout, tls)
            except ConnectError as exc:
                _no_user_token(spec.rank, exc)  # (a stale file, and a job with RPCDIST_TOKEN)
                problem = f"the secret in {path!r} did not open the store: {exc}"
            else:
                if store.server_id == server_id:
                    return store
                problem = f"the secret file {path!r} names another store (left by a past job)"
                await store.close()
        if not await polling.pause():
            raise ConnectError(
                f"rank {spec.rank} reached no store of its job within {timeout}s: {problem}. "
                "A job without RPCDIST_TOKEN shares its secret through a file only the user "
                "who started rank 0 can read, so every rank must run on that host as that "
                "user; otherwise set RPCDIST_TOKEN on every rank (rpcdist-run sets one)"
            )


async def _probe(spec: RendezvousSpec, tls: GrpcTls | None) -> None:
    """Fail at once if the job's store is up and asks for a user token.

    Raises:
        ConnectError: the store refused us and is not guarded by a secret file
            (its job has ``RPCDIST_TOKEN``; this rank has none).
    """
    try:
        store = await _reach(spec, None, _PROBE_TIMEOUT, _PROBE_TIMEOUT, tls, probe=True)
        await store.close()  # a store with no token at all: not this job's
    except ConnectError as exc:
        _no_user_token(spec.rank, exc)


def _no_user_token(rank: int, exc: ConnectError) -> None:
    """Raises: ConnectError: ``exc`` is a refusal by a store that asks for a
    user token (``RPCDIST_TOKEN``), not for a secret file's."""
    text = str(exc)
    if "rejected this process's token" in text and SECRET_FILE_REFUSAL not in text:
        raise ConnectError(
            f"rank {rank} has no job token (RPCDIST_TOKEN) but its job's store asks for one: {text}"
        ) from exc


async def _reach(
    spec: RendezvousSpec,
    token: str | None,
    attempt: float,
    timeout: float,
    tls: GrpcTls | None,
    probe: bool = False,
) -> StoreClient:
    """One attempt, of ``attempt`` seconds, to reach the store with ``token``.

    Raises:
        ConnectError: not reached, or the token was refused.
    """
    from ._client import StoreClient

    if spec.scheme == "file" and spec.path is not None:
        return await join_file(
            rendezvous_file(spec.path), token, attempt, spec.rank, tls, probe, dynamic=spec.dynamic
        )
    store = StoreClient(
        spec.address, token=token, timeout=timeout, rank=spec.rank, tls=tls, probe=probe
    )
    try:
        await store.connect(timeout=attempt)
    except BaseException:
        await store.close()
        raise
    return store
