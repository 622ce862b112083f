"""Releases of finished contexts ride on the next call to the peer that knows
them, acknowledged by its reply; what no call carries travels in batches: one
control message per peer for several contexts, sent when ``RELEASE_BATCH``
are queued, after ``RELEASE_DELAY``, or at a graceful shutdown; nothing is
left on any worker."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ad_funcs as af
import numpy as np
import pytest
from agent_support import contexts_settled

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist import RpcOptions
from rpcdist._rpc._outbox import ControlOutbox
from rpcdist.autograd import _extension
from rpcdist.tensor import Tensor
from rpcdist.testing import FaultInjector, as_current, local_agents


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[int]]]:
    """Every release message sent: ``(peer, context ids)``."""
    got: list[tuple[int, list[int]]] = []
    real = ControlOutbox._deliver

    async def counting(self: Any, peer: int, items: list[Any]) -> None:
        if self._method == _extension.RELEASE:
            got.append((peer, list(items)))
        await real(self, peer, items)

    monkeypatch.setattr(ControlOutbox, "_deliver", counting)
    return got


@pytest.fixture
def no_riding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Releases never ride on calls (only the control messages are left)."""
    monkeypatch.setattr(_extension.AutogradExtension, "take_releases", lambda *a: None)


def _contexts(n: int) -> list[int]:
    x = Tensor(np.ones(3), requires_grad=True)
    ids = []
    for _ in range(n):
        with dist_autograd.context() as cid:
            y = rpcdist.rpc_sync("worker1", af.tanh_scale, args=(x,))
            dist_autograd.backward(cid, [y.sum()])
        ids.append(cid)
    return ids


def test_a_loop_s_releases_ride_on_its_next_calls(
    sent: list[tuple[int, list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each iteration's call carries the release of the context before it;
    only the last, which no call follows, needs a message of its own."""
    # No timer fires during the loop (a loaded machine may take longer than
    # any short delay between two iterations); the last release is flushed
    # by hand, as the timer would.
    monkeypatch.setattr(_extension, "RELEASE_DELAY", 600.0)
    with local_agents(2, options=RpcOptions(token=None)) as agents, as_current(agents[0]):
        ids = _contexts(40)
        agents[0].loop.call_soon_threadsafe(_extension.ext(agents[0])._outbox.flush)
        assert contexts_settled(agents)
        assert agents[1].statistics()["autograd_released"] == 40  # each freed there, once
        for agent in agents:
            assert agent.statistics()["autograd_releases_inflight"] == 0
    assert [batch for _, batch in sent] == [ids[-1:]]  # (all 40 without riding)


def test_a_call_that_is_never_sent_gives_its_riding_releases_back(
    sent: list[tuple[int, list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_extension, "RELEASE_DELAY", 0.05)
    with local_agents(2, options=RpcOptions(token=None)) as agents, as_current(agents[0]):
        ids = _contexts(1)
        with pytest.raises(rpcdist.SerializationError):  # (it took the release, then failed)
            rpcdist.rpc_sync("worker1", af.tanh_scale, args=(lambda: None,))
        outbox = _extension.ext(agents[0])._outbox
        assert not outbox._riding and outbox.pending() in (0, 1)  # back in the box (or sent)
        assert contexts_settled(agents)
    assert [batch for _, batch in sent] == [ids]  # sent the usual way instead


def test_releases_that_ride_on_a_lost_call_are_sent_again(
    sent: list[tuple[int, list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that carried releases but got no reply (its reply dropped, so
    no acknowledgement) leaves them to the next flush, which sends them in
    a message of their own."""
    monkeypatch.setattr(_extension, "RELEASE_DELAY", 0.05)
    faults = FaultInjector()
    with local_agents(2, options=RpcOptions(token=None, faults=faults)) as agents:
        with as_current(agents[0]):
            ids = _contexts(1)
            faults.add("reply:ad_funcs:tanh_scale", "drop")
            with pytest.raises(rpcdist.RpcTimeoutError):
                rpcdist.rpc_sync("worker1", af.tanh_scale, args=(Tensor(np.ones(3)),), timeout=0.5)
            assert contexts_settled(agents)
    assert [batch for _, batch in sent] == [ids]


def test_a_loop_of_contexts_sends_fewer_release_messages_than_contexts(
    sent: list[tuple[int, list[int]]], monkeypatch: pytest.MonkeyPatch, no_riding: None
) -> None:
    # Long enough that a loaded machine's slow iterations still share messages;
    # what is left after the last full batch goes when the timer fires.
    monkeypatch.setattr(_extension, "RELEASE_DELAY", 0.5)
    with local_agents(2, options=RpcOptions(token=None)) as agents, as_current(agents[0]):
        ids = _contexts(40)
        assert contexts_settled(agents)
    released = [cid for _, batch in sent for cid in batch]
    assert sorted(released) == sorted(ids)  # each released once, on worker1
    assert {peer for peer, _ in sent} == {1}
    assert len(sent) < len(ids) and max(len(b) for _, b in sent) <= _extension.RELEASE_BATCH


def test_a_full_batch_goes_at_once_and_a_graceful_shutdown_sends_the_rest(
    sent: list[tuple[int, list[int]]], monkeypatch: pytest.MonkeyPatch, no_riding: None
) -> None:
    monkeypatch.setattr(_extension, "RELEASE_DELAY", 3600.0)  # only a full batch or drain
    batch = _extension.RELEASE_BATCH
    with local_agents(2, options=RpcOptions(token=None), graceful=True) as agents:
        with as_current(agents[0]):
            ids = _contexts(batch + 3)
        # The full batch is released on worker1; three wait for the timer.
        end = time.monotonic() + 10
        while agents[1].statistics()["autograd_contexts"] != 3 and time.monotonic() < end:
            time.sleep(0.01)
        assert agents[1].statistics()["autograd_contexts"] == 3
        assert [b for _, b in sent] == [ids[:batch]]
    assert [b for _, b in sent] == [ids[:batch], ids[batch:]]  # the drain sent them


def test_items_posted_faster_than_the_loop_sends_still_go_at_most_a_batch_a_message() -> None:
    """The loop only sends a full box on its next turn; items posted meanwhile
    (here: all of them, in one turn) make whole batches, the rest waits."""
    got: list[list[int]] = []

    class Peerless:
        closed = False

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop = loop

        async def send_control(self, peer: int, method: str, items: list[int]) -> None:
            got.append(list(items))

    async def main() -> None:
        box = ControlOutbox(Peerless(asyncio.get_running_loop()), "m", delay=3600, batch=4)
        for i in range(10):
            box.post(1, i)
        while box.pending() != 2:  # the two full batches went; two items wait
            await asyncio.sleep(0)
        assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]
        await box.drain()
        assert got[2:] == [[8, 9]] and box.pending() == 0
        box.close()

    asyncio.run(asyncio.wait_for(main(), 10))
