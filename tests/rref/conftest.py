"""RRef test fixtures: in-process agents whose RRef tables must drain after each test."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import rref_funcs as rf
from rref_support import GAUGES, options, settle

from rpcdist._rpc._agent import Agent
from rpcdist.testing import FaultInjector, local_agents

Start = Callable[..., list[Agent]]


def _describe(agents: list[Agent]) -> str:
    lines = []
    for a in agents:
        ctx = a.registry.extensions.get("rref")
        stats = {k: v for k, v in a.statistics().items() if k in GAUGES and v}
        left = ctx.owners.leftovers() if ctx is not None else []
        lines.append(f"{a.name}: {stats} live records {left}")
    return "\n".join(lines)


@pytest.fixture
def start() -> Iterator[Start]:
    """``start(n, faults=[...], intervals=[...], **local_agents_kw)``: leak-checked agents.

    ``intervals`` are the agents' control retry intervals (default 0.05 s).
    """
    groups: list[list[Agent]] = []
    with contextlib.ExitStack() as stack:

        def start(
            n: int,
            faults: list[FaultInjector | None] | None = None,
            intervals: list[float] | None = None,
            **kw: object,
        ) -> list[Agent]:
            fs = faults or [None] * n
            kw.setdefault("options", [options(f, i) for f, i in zip(fs, intervals or [0.05] * n)])
            agents = stack.enter_context(local_agents(n, **kw))  # type: ignore[arg-type]
            groups.append(agents)
            return agents

        yield start
        rf.clear()
        for agents in groups:
            if not any(a.closed for a in agents):
                got = settle(agents)
                assert got == dict.fromkeys(GAUGES, 0), _describe(agents)


@pytest.fixture
def rrefs2(start: Start) -> list[Agent]:
    return start(2)


@pytest.fixture
def rrefs3(start: Start) -> list[Agent]:
    return start(3)


@pytest.fixture
def rrefs4(start: Start) -> list[Agent]:
    return start(4)
