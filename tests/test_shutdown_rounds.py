"""The shutdown rounds' gathering of reports, against a store and a detector
that this test drives (no processes)."""

from __future__ import annotations

import asyncio
import time
import types

from rpcdist._rpc import _shutdown


class _Detector:
    """The part of the failure detector that ``gather_live`` reads."""

    def __init__(self) -> None:
        self.lost: dict[int, str] = {}
        self.lost_at: dict[int, float] = {}
        self._waiters: list[asyncio.Future[None]] = []

    def is_lost(self, rank: int) -> bool:
        return rank in self.lost

    def changed(self) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def declare(self, rank: int, why: str) -> None:
        self.lost[rank] = why
        self.lost_at[rank] = asyncio.get_running_loop().time()
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters.clear()

    def probe(self, rank: int, why: str) -> None:
        pass


class _Store:
    def __init__(self) -> None:
        self.values: dict[str, asyncio.Future[bytes]] = {}

    def slot(self, key: str) -> asyncio.Future[bytes]:
        return self.values.setdefault(key, asyncio.get_running_loop().create_future())

    async def get(self, key: str, timeout: float | None = None) -> bytes:
        return await asyncio.shield(self.slot(key))


KEY = "round/{}".format


def _rank0(world: int, reported: dict[int, bytes]) -> types.SimpleNamespace:
    """Rank 0 of ``world`` as ``gather_live`` sees it (in a running loop),
    with the values of ``reported`` already in the store."""
    store = _Store()
    for rank, value in reported.items():
        store.slot(KEY(rank)).set_result(value)
    return types.SimpleNamespace(rank=0, world_size=world, liveness=_Detector(), store=store)


def test_a_worker_lost_while_the_loop_was_held_up_still_has_its_report_read():
    """A peer that finished first looks lost to the slower ones; if noticing
    that kept the loop busy past the grace (dropping its connections can take
    long), the report already on its way must still be read."""

    async def main() -> dict[int, bytes]:
        loop = asyncio.get_running_loop()
        agent = _rank0(2, {0: b"mine"})
        detector, store = agent.liveness, agent.store

        def lost_then_busy() -> None:
            detector.declare(1, "its connection was refused")
            # the value was answered meanwhile; its reply waits behind this callback
            loop.call_soon(store.slot(KEY(1)).set_result, b"theirs")
            time.sleep(2 * _shutdown._LOST_GRACE)  # the loop is held up (not a wait for anything)

        loop.call_later(0.01, lost_then_busy)
        return await _shutdown.gather_live(agent, KEY, 5.0)

    assert asyncio.run(main()) == {0: b"mine", 1: b"theirs"}


def test_a_lost_worker_without_a_report_is_not_waited_for_beyond_the_grace():
    async def main() -> dict[int, bytes]:
        agent = _rank0(3, {0: b"a", 2: b"c"})
        asyncio.get_running_loop().call_later(0.01, agent.liveness.declare, 1, "killed")
        # (its value never comes: without the grace this would wait forever)
        return await asyncio.wait_for(_shutdown.gather_live(agent, KEY, None), 10)

    assert asyncio.run(main()) == {0: b"a", 2: b"c"}
