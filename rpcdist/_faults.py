"""Fault rules for tests: which outgoing message to drop, delay or fail.

``RpcOptions.faults`` carries a :class:`FaultInjector`; the transport's
fault-injecting wrapper (``_transport._faulty.FaultyTransport``) consults it
for every outgoing message. A message's *kind* is its method for calls and
internal messages, ``"reply:" + method`` for the reply to one, and ``"p2p"``
for point-to-point messages; rules match by exact kind or by a prefix
ending in ``*``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal

from ._errors import ConfigError

__all__ = ["Action", "Fault", "FaultInjector"]

Action = Literal["drop", "delay", "fail"]


@dataclass
class Fault:
    """One rule. ``nth`` counts matching messages from 1; ``times`` is how many
    consecutive matches (from the nth on) the rule applies to; ``None`` means
    every one from the nth."""

    kind: str
    action: Action
    nth: int = 1
    times: int | None = 1
    delay: float = 0.0
    seen: int = 0
    hits: int = field(default=0)

    def matches(self, kind: str) -> bool:
        if self.kind.endswith("*"):
            return kind.startswith(self.kind[:-1])
        return kind == self.kind


class FaultInjector:
    """A set of :class:`Fault` rules consulted for every outgoing message."""

    def __init__(self) -> None:
        self._rules: list[Fault] = []
        self._lock = threading.Lock()
        self.log: list[tuple[str, Action]] = []

    def add(
        self,
        kind: str,
        action: Action,
        *,
        nth: int = 1,
        times: int | None = 1,
        delay: float = 0.0,
    ) -> Fault:
        """Add a rule and return it (its ``hits`` counts applications).

        Raises:
            ConfigError: unknown action, ``nth < 1`` or a negative delay.
        """
        if action not in ("drop", "delay", "fail"):
            raise ConfigError(f"fault action must be 'drop', 'delay' or 'fail', got {action!r}")
        if nth < 1 or (times is not None and times < 1) or delay < 0:
            raise ConfigError(f"invalid fault rule nth={nth} times={times} delay={delay}")
        rule = Fault(kind, action, nth, times, delay)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def decide(self, kind: str) -> tuple[Action, float] | None:
        """The action to apply to the next message of ``kind``, if any."""
        with self._lock:
            for r in self._rules:
                if not r.matches(kind):
                    continue
                r.seen += 1
                last = None if r.times is None else r.nth + r.times - 1
                if r.seen >= r.nth and (last is None or r.seen <= last):
                    r.hits += 1
                    self.log.append((kind, r.action))
                    return r.action, r.delay
        return None
