"""Shared fixtures: in-process agents over loopback gRPC, with leak checks."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest

from rpcdist._rpc._agent import Agent
from rpcdist.testing import local_agents


def settle(agents: list[Agent], keys: tuple[str, ...], timeout: float = 10.0) -> dict[str, int]:
    """Wait until the gauges ``keys`` read 0 on every agent; return the last reading."""
    end = time.monotonic() + timeout
    while True:
        gc.collect()
        totals = {k: sum(a.statistics().get(k, 0) for a in agents) for k in keys}
        if not any(totals.values()) or time.monotonic() > end:
            return totals
        time.sleep(0.01)


_GAUGES = ("pending_calls", "inflight_handlers", "queued_frames", "p2p_unclaimed")


def _agents(n: int, **kw: object) -> Iterator[list[Agent]]:
    with local_agents(n, **kw) as agents:  # type: ignore[arg-type]
        yield agents
        assert settle(agents, _GAUGES) == dict.fromkeys(_GAUGES, 0)


@pytest.fixture
def agent1() -> Iterator[list[Agent]]:
    yield from _agents(1)


@pytest.fixture
def agents2() -> Iterator[list[Agent]]:
    yield from _agents(2)


@pytest.fixture
def agents3() -> Iterator[list[Agent]]:
    yield from _agents(3)


@pytest.fixture(autouse=True)
def _young_heap() -> Iterator[None]:
    """Each test starts with what earlier tests left alive frozen out of the
    cyclic collector, so that a test's own ``gc.collect()`` scans only what
    it made. With the whole suite's heap (torch included) a full collection
    took 0.75 s holding the GIL; the RRef tests, which collect in a loop
    while in-process agents share that GIL, starved the agents until their
    failure detectors declared one another lost (one test took 60 s in CI,
    and failed there)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _no_thread_leak() -> Iterator[None]:
    before = {t.ident for t in threading.enumerate()}
    yield
    end = time.monotonic() + 5
    while True:
        extra = [
            t
            for t in threading.enumerate()
            if t.ident not in before and t.name.startswith("rpcdist") and t.is_alive()
        ]
        if not extra or time.monotonic() > end:
            break
        time.sleep(0.01)
    assert not extra, f"threads left behind: {[t.name for t in extra]}"


# The device parametrisation of the tensor, nn and optim tests.
DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu, id="cuda")]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """``"cpu"``, and ``"cuda:0"`` where CuPy and a CUDA device are present."""
    from rpcdist.tensor import cuda_is_available

    dev: str = request.param
    if dev != "cpu" and not cuda_is_available():
        pytest.skip("CuPy or a CUDA device is not available")
    return dev
