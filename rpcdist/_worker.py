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

    def __post_init__(self) -> None:
        check_worker_name(self.name)


def check_worker_name(name: object) -> str:
    """Return ``name`` if it is a valid worker name.

    Raises:
        ConfigError: ``name`` is not 1-127 letters, digits, ``_``, ``-`` or ``:``
            (worded first as torch's ``WorkerInfo`` words it).
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        if name == "":
            first = "Worker name must be non-empty"
        elif isinstance(name, str) and len(name) > 127:
            first = "Worker name must be shorter than 128 characters"
        else:
            first = "Worker name must match ^[A-Za-z0-9-_:]*$"
        raise ConfigError(
            f"{first}: invalid worker name {name!r}: expected 1-127 characters from "
            "letters, digits, '_', '-' and ':'"
        )
    return name
