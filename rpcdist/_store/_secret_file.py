"""The secret of a job without a token, kept in a file only its user can read.

A job started with no token (no ``RPCDIST_TOKEN``, no launcher) still guards
its store and its links with a random secret that rank 0 makes. The secret is
never served by the store: rank 0 writes it, with the store's server id, to
``<runtime dir>/job-<hash of the rendezvous address>`` (mode 0600), and the
other ranks, which run on the same host as the same user, read it there. The
runtime directory is ``$XDG_RUNTIME_DIR/rpcdist`` when that variable is set,
else ``rpcdist-<uid>`` in the temporary directory; it is made with mode 0700
and refused if it is owned by someone else, is a symbolic link or lets the
group or others in.
The store server removes the file when it stops (when it still holds its id).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile

from .._errors import ConfigError

__all__ = ["read_secret", "remove_secret", "runtime_dir", "secret_path", "write_secret"]


def runtime_dir() -> str:
    """This user's private directory for job secrets, made on first use.

    Raises:
        ConfigError: it cannot be made, or it is not private to this user.
    """
    base = os.environ.get("XDG_RUNTIME_DIR", "")
    if base and os.path.isabs(base):
        path = os.path.join(base, "rpcdist")
    else:
        path = os.path.join(tempfile.gettempdir(), f"rpcdist-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot make the directory for job secrets {path!r}: {exc}") from exc
    _check_private(path, os.lstat(path), "directory for job secrets", directory=True)
    return path


def _check_private(path: str, info: os.stat_result, what: str, *, directory: bool) -> None:
    problem = None
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(info.st_mode):
        problem = "is not a plain " + ("directory" if directory else "file")
    elif info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    elif info.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):o}: the group or others may use it"
    if problem is not None:
        raise ConfigError(
            f"the {what} {path!r} {problem}; a job without RPCDIST_TOKEN keeps its secret "
            "there, so it must be private to this user: remove it, or set RPCDIST_TOKEN "
            "(rpcdist-run sets one)"
        )


def secret_path(rendezvous: str) -> str:
    """Where the secret of the job that meets at ``rendezvous`` is kept.

    ``rendezvous`` names the meeting place the same way on every rank (the
    store's ``host:port``, or ``file:<path>``).

    Raises:
        ConfigError: the runtime directory is not private (see :func:`runtime_dir`).
    """
    digest = hashlib.sha256(rendezvous.encode()).hexdigest()[:32]
    return os.path.join(runtime_dir(), f"job-{digest}")


def write_secret(path: str, secret: str, server_id: str) -> None:
    """Write ``secret`` and the store's ``server_id`` to ``path`` (mode 0600), atomically.

    Raises:
        ConfigError: the file cannot be written.
    """
    temporary = f"{path}.{server_id}.tmp"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as file:
            file.write(f"{secret}\n{server_id}\n")
        os.replace(temporary, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise ConfigError(f"cannot write the job's secret file {path!r}: {exc}") from exc


def read_secret(path: str) -> tuple[str, str] | str:
    """``(secret, server id)`` from ``path``, or why there is none yet.

    Raises:
        ConfigError: the file is not private to this user, or cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return f"rank 0 has not written the job's secret to {path!r} yet"
    except OSError as exc:
        raise ConfigError(f"cannot read the job's secret file {path!r}: {exc}") from exc
    with os.fdopen(fd, "rb") as file:
        _check_private(path, os.fstat(file.fileno()), "job's secret file", directory=False)
        lines = file.read(4096).decode("ascii", "replace").splitlines()
    if len(lines) < 2 or not lines[0] or not lines[1]:
        return f"the job's secret file {path!r} is incomplete"
    return lines[0], lines[1]


def remove_secret(path: str, server_id: str) -> None:
    """Remove ``path`` if it still holds ``server_id`` (a newer job may own it by now)."""
    with contextlib.suppress(OSError, ConfigError):
        found = read_secret(path)
        if isinstance(found, tuple) and found[1] == server_id:
            os.remove(path)
