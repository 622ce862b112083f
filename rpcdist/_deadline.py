"""Timeouts as absolute deadlines that travel with requests."""

from __future__ import annotations

import contextvars
import enum
import math
import time

from ._errors import ConfigError

__all__ = [
    "UNSET",
    "Unset",
    "current_deadline",
    "deadline_after",
    "deadline_for",
    "remaining",
    "seconds_of",
]


class Unset(enum.Enum):
    """Sentinel type: "use the agent's default timeout"."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset.UNSET

#: Absolute deadline (``time.monotonic()`` clock) of the request being handled
#: in this task or thread, inherited by nested calls.
current_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "rpcdist_deadline", default=None
)


def deadline_for(timeout: float | Unset | None, default: float | None) -> float | None:
    """The absolute deadline for a call made now, or ``None`` for no deadline.

    ``UNSET`` takes ``default``; ``None`` or ``0`` mean no timeout of its own.
    Either way a deadline inherited from the request being handled caps it.

    Raises:
        ConfigError: ``timeout`` is negative, NaN or not a number.
    """
    return deadline_after(seconds_of(default if timeout is UNSET else timeout))


def seconds_of(timeout: float | None) -> float | None:
    """``timeout`` checked: its seconds, or ``None`` for no timeout of its
    own (``None``, ``0`` or infinite); what :func:`deadline_after` takes.

    Raises:
        ConfigError: ``timeout`` is negative, NaN or not a number.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ConfigError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ConfigError(f"timeout must be >= 0 seconds, got {timeout!r}")
    if timeout == 0 or math.isinf(timeout):
        return None
    return timeout


def deadline_after(seconds: float | None) -> float | None:
    """:func:`deadline_for` of a timeout :func:`seconds_of` checked already
    (an agent's default, checked once: every call's path)."""
    inherited = current_deadline.get()
    if seconds is None:
        return inherited
    own = time.monotonic() + seconds
    return own if inherited is None or own < inherited else inherited


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (never negative), or ``None``."""
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())
