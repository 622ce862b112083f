"""``backend="auto"`` picks shared memory on the doorbell probe, not on the host name.

Agents in this process share a hostname and boot id, so by host identity
they are "on one host". When a peer's doorbell cannot be reached, the
group must still agree on the message ring (``auto``) or fail alike on
every rank (``shm``).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np
import pytest
from agent_support import ok, on_all

from rpcdist import ConfigError
from rpcdist import collectives as dist
from rpcdist.collectives import _shm
from rpcdist.collectives._api import attach, detach
from rpcdist.testing import as_current, local_agents

_CLONE_NEWNET = 0x40000000


def refuse_rank(monkeypatch: pytest.MonkeyPatch, member: int) -> list[bytes]:
    """Make every doorbell probe of group member ``member`` fail as across namespaces."""
    rung: list[bytes] = []
    real = _shm._ring_bell

    def ring(sock: Any, address: bytes, payload: bytes) -> None:
        rung.append(address)
        if address.endswith(f"-{member}".encode()):
            raise ConnectionRefusedError(111, "Connection refused")
        real(sock, address, payload)

    monkeypatch.setattr(_shm, "_ring_bell", ring)
    return rung


def sums(agents: list[Any]) -> list[Any]:
    def work(r: int) -> tuple[str, list[float]]:
        with as_current(agents[r]):
            x = np.arange(4, dtype="f8") * (r + 1)
            dist.all_reduce(x)
            dist.barrier()
            return dist.get_backend(), x.tolist()

    return ok(on_all(agents, work))


def test_same_host_identity_but_unreachable_doorbell_gives_the_ring(monkeypatch):
    rung = refuse_rank(monkeypatch, 2)
    with local_agents(3) as agents:
        assert len({agents[0].hosts[q] for q in range(3)}) == 1  # "one host" by name
        ok(on_all(agents, lambda r: attach(agents[r], "auto", 20)))
        try:
            assert sums(agents) == [("ring", [0.0, 6.0, 12.0, 18.0])] * 3
        finally:
            ok(on_all(agents, lambda r: detach(agents[r])))
    assert rung  # the decision came from probing


def test_reachable_doorbells_give_shared_memory(monkeypatch):
    rung = refuse_rank(monkeypatch, 99)  # nobody refused: the probe itself is seen
    with local_agents(2) as agents:
        ok(on_all(agents, lambda r: attach(agents[r], "auto", 20)))
        try:
            assert sums(agents) == [("shm", [0.0, 3.0, 6.0, 9.0])] * 2
        finally:
            ok(on_all(agents, lambda r: detach(agents[r])))
    assert len(rung) == 2


def test_shm_asked_for_with_an_unreachable_doorbell_fails_on_every_rank(monkeypatch):
    refuse_rank(monkeypatch, 1)
    with local_agents(2) as agents:
        results = on_all(agents, lambda r: attach(agents[r], "shm", 20))
        for got in results:
            assert isinstance(got, ConfigError), results
            assert "doorbell of rank 1" in str(got) and "Connection refused" in str(got)


def test_a_doorbell_in_another_network_namespace_gives_the_ring():
    """No patching: rank 1's loop thread (the one that binds its doorbell) sets
    the group up in a network namespace of its own, where abstract sockets
    are apart while ``/dev/shm`` is shared; it then moves back for the data."""
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    libc = ctypes.CDLL(None, use_errno=True)

    async def on_loop(fn: Any) -> Any:
        return fn()

    with local_agents(2) as agents:
        home = agents[1].run(on_loop(lambda: os.open("/proc/thread-self/ns/net", os.O_RDONLY)), "t")
        try:
            if agents[1].run(on_loop(lambda: libc.unshare(_CLONE_NEWNET)), "test") != 0:
                pytest.skip(f"unshare(CLONE_NEWNET) failed: errno {ctypes.get_errno()}")
            try:
                ok(on_all(agents, lambda r: attach(agents[r], "auto", 20)))
            finally:
                back = agents[1].run(on_loop(lambda: libc.setns(home, _CLONE_NEWNET)), "test")
            assert back == 0
        finally:
            os.close(home)
        try:
            assert sums(agents) == [("ring", [0.0, 3.0, 6.0, 9.0])] * 2
        finally:
            ok(on_all(agents, lambda r: detach(agents[r])))
