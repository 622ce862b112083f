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


def test_a_worker_lost_while_the_loop_was_held_up_still_has_its_report_read():
    """A peer that finished first looks lost to the slower ones; if noticing
    that kept the loop busy past the grace (dropping its connections can take
    long), the report already on its way must still be read."""

    async def main() -> dict[int, bytes]:
        loop = asyncio.get_running_loop()
        detector, store = _Detector(), _Store()
        agent = types.SimpleNamespace(rank=0, world_size=2, liveness=detector, store=store)
        key = "round/{}".format
        store.slot(key(0)).set_result(b"mine")

        def lost_then_busy() -> None:
            detector.declare(1, "its connection was refused")
            # the value was answered meanwhile; its reply waits behind this callback
            loop.call_soon(store.slot(key(1)).set_result, b"theirs")
            time.sleep(2 * _shutdown._LOST_GRACE)  # the loop is held up (not a wait for anything)

        loop.call_later(0.01, lost_then_busy)
        return await _shutdown.gather_live(agent, key, 5.0)

    assert asyncio.run(main()) == {0: b"mine", 1: b"theirs"}


def test_a_lost_worker_without_a_report_is_not_waited_for_beyond_the_grace():
    async def main() -> dict[int, bytes]:
        loop = asyncio.get_running_loop()
        detector, store = _Detector(), _Store()
        agent = types.SimpleNamespace(rank=0, world_size=3, liveness=detector, store=store)
        key = "round/{}".format
        store.slot(key(0)).set_result(b"a")
        store.slot(key(2)).set_result(b"c")
        loop.call_later(0.01, detector.declare, 1, "killed")
        # (its value never comes: without the grace this would wait forever)
        return await asyncio.wait_for(_shutdown.gather_live(agent, key, None), 10)

    assert asyncio.run(main()) == {0: b"a", 2: b"c"}
