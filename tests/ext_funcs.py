"""Callees and a probe type for the extension tests (resolved by name)."""

from __future__ import annotations

import contextvars
from typing import Any

import rpcdist
from rpcdist.functions import async_execution

#: Set by the test scope while a handler runs.
IN_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("in_scope", default=None)
#: Read by the caller's metadata source.
TAG: contextvars.ContextVar[str | None] = contextvars.ContextVar("tag", default=None)


def plain() -> str | None:
    return IN_SCOPE.get()


async def coroutine() -> str | None:
    return IN_SCOPE.get()


@async_execution
def batched() -> rpcdist.Future[str | None]:
    fut: rpcdist.Future[str | None] = rpcdist.Future()
    fut.set_result(IN_SCOPE.get())
    return fut


def nested(to: str) -> Any:
    """Calls on from inside a handler: the caller's scope state follows."""
    return rpcdist.rpc_sync(to, plain)


class Box:
    def read(self) -> str | None:
        return IN_SCOPE.get()


def make_box() -> Box:
    return Box()


class Probe:
    """A value whose decoding records the metadata of the message it came in."""


SEEN: list[Any] = []


def probe() -> Probe:
    return Probe()


def echo(x: Any) -> Any:
    return x


def fail(x: Any) -> None:
    raise KeyError("on purpose")


def ignore(x: Any) -> None:
    """Returns nothing: its reply is the codec's constant ``None`` header."""
    return None
