"""The fused layers' buffer pool: an array is handed out again only once nothing holds it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from rpcdist.nn import _buffers

pytestmark = pytest.mark.skipif(_buffers._IDLE < 0, reason="the pool needs CPython's refcounts")

SHAPE = (64, 1024)  # 256 KiB of float32: pooled


@pytest.fixture(autouse=True)
def _fresh_pool() -> Iterator[None]:
    _buffers.clear()
    yield
    _buffers.clear()


def take() -> np.ndarray:
    out: np.ndarray = _buffers.empty(np, SHAPE, np.float32)
    return out


def test_reused_once_idle_and_never_while_held() -> None:
    a = take()
    b = take()
    assert a is not b and not np.shares_memory(a, b)
    a_id = id(a)
    del a
    c = take()
    assert id(c) == a_id and c.base is None and c.flags.c_contiguous
    assert _buffers.statistics()["hits"] == 1


def test_views_and_exported_buffers_keep_an_array_in_use() -> None:
    a = take()
    a_id = id(a)
    box = {"row": a[1]}
    del a
    b = take()
    assert id(b) != a_id
    exported = memoryview(b)
    b_id = id(b)
    del box, b
    c = take()
    assert id(c) == a_id  # the view is gone; the memoryview still holds the other one
    d = take()
    assert id(d) not in (a_id, b_id)
    del exported, d
    assert id(take()) == b_id


def test_small_arrays_other_dtypes_and_shapes_are_separate() -> None:
    small = _buffers.empty(np, (8, 8), np.float32)
    assert _buffers.statistics()["arrays"] == 0 and small.shape == (8, 8)
    a = take()
    a_id = id(a)
    del a
    other = _buffers.empty(np, SHAPE, np.float64)
    flipped = _buffers.empty(np, SHAPE[::-1], np.float32)
    assert other.dtype == np.float64 and flipped.shape == SHAPE[::-1]
    assert id(take()) == a_id


def test_caps_per_shape_and_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    held = [take() for _ in range(_buffers.MAX_PER_SHAPE + 3)]
    assert _buffers.statistics()["arrays"] == _buffers.MAX_PER_SHAPE
    del held
    one = SHAPE[0] * SHAPE[1] * 4
    monkeypatch.setattr(_buffers, "MAX_BYTES", 3 * one)
    _buffers.clear()
    keep = [take(), take()]
    idle = take()
    del idle  # idle, so the least recently used shape can give it up
    big = _buffers.empty(np, (SHAPE[0], 2 * SHAPE[1]), np.float32)
    stats = _buffers.statistics()
    assert stats["bytes"] <= 3 * one and stats["arrays"] == 2
    assert big.shape == (SHAPE[0], 2 * SHAPE[1]) and len(keep) == 2


def test_threads_never_share_a_live_array() -> None:
    errors: list[str] = []
    start = threading.Barrier(4)

    def worker(k: int) -> None:
        start.wait()
        for i in range(200):
            a = take()
            a.fill(k * 1000 + i)
            b = take()
            b.fill(-1)
            if a[0, 0] != k * 1000 + i or np.shares_memory(a, b):
                errors.append(f"thread {k} step {i}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
