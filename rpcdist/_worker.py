"""Worker identity: names, ranks and :class:`WorkerInfo`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._errors import ConfigError

__all__ = ["WorkerInfo", "check_worker_name"]

_NAME_RE = re.compile(r"[A-Za-z0-9_\-:]{1,127}")


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's name and id (its rank). Equal and hashable; safe to send."""

    name: str
    id: int

    __module__ = "rpcdist"


def check_worker_name(name: object) -> str:
    """Return ``name`` if it is a valid worker name.

    Raises:
        ConfigError: ``name`` is not 1-127 letters, digits, ``_``, ``-`` or ``:``.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(
            f"invalid worker name {name!r}: expected 1-127 characters from "
            "letters, digits, '_', '-' and ':'"
        )
    return name
