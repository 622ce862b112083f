"""Helpers the RRef tests import (a module of its own: test modules importing
from ``conftest`` get whichever directory's conftest pytest loaded last)."""

from __future__ import annotations

import gc
import time

from rpcdist import RpcOptions
from rpcdist._rpc._agent import Agent
from rpcdist.testing import FaultInjector

#: Gauges that read 0 on every worker once every RRef is dropped and the protocol settled.
GAUGES = (
    "rref_owners",
    "rref_forks",
    "rref_pending_users",
    "rref_pending_children",
    "rref_users",
    "rref_outbox",
    "pending_calls",
    "inflight_handlers",
    "queued_frames",
)


def options(faults: FaultInjector | None = None, interval: float = 0.05) -> RpcOptions:
    return RpcOptions(token=None, control_retry_interval=interval, faults=faults)


def gauges(agents: list[Agent]) -> dict[str, int]:
    return {k: sum(a.statistics().get(k, 0) for a in agents) for k in GAUGES}


def settle(agents: list[Agent], timeout: float = 10.0) -> dict[str, int]:
    """Collect garbage until the gauges read 0 on every agent (or time runs out)."""
    end = time.monotonic() + timeout
    while True:
        gc.collect()
        totals = gauges(agents)
        if not any(totals.values()) or time.monotonic() > end:
            return totals
        time.sleep(0.01)
