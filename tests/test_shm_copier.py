"""A large buffer is copied into its segment by the sending thread and the
copier thread together, when the host has a core idle: each takes the next
piece left, so the sender never waits for the copier to start, the copy
is whole whoever took which pieces, an error on either thread reaches the
sender, and the copier is gone once the transport stops."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from rpcdist._transport import _shm
from rpcdist._transport._shm import SegmentPool, SegmentReader, SegmentWriter

pytestmark = pytest.mark.skipif(not _shm.shm_available(), reason="no writable /dev/shm")

MB = 1 << 20


def _copiers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rpcdist-shm-copier" and t.is_alive()]


def _pieces_by_thread(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Note the thread that copies each piece."""
    names: list[str] = []
    copyto = np.copyto

    def recording(dst: np.ndarray, src: np.ndarray) -> None:
        names.append(threading.current_thread().name)
        copyto(dst, src)

    monkeypatch.setattr(_shm.np, "copyto", recording)
    return names


@pytest.fixture
def spare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_shm, "spare_core", lambda: True)


@pytest.fixture
def link() -> Iterator[tuple[SegmentPool, SegmentReader]]:
    """A sender's pool and a receiver, taken down after the test."""
    w = SegmentWriter()
    pool, reader = w.pool(), SegmentReader()
    yield pool, reader
    reader.close()
    pool.close()
    w.cleanup()


@pytest.mark.parametrize("nbytes", [4 * MB, 4 * MB + 1, 7 * MB + 12345, 64 * MB])
def test_a_shared_copy_arrives_whole(spare, link, nbytes):
    pool, reader = link
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    path, _ = pool.write([memoryview(src)])
    (view,) = reader.buffers(path, [nbytes])
    assert np.array_equal(np.frombuffer(view, np.uint8), src)


def test_the_sender_copies_every_piece_itself_while_the_copier_is_busy(spare, link, monkeypatch):
    pool, reader = link
    busy, let_go = threading.Event(), threading.Event()
    _shm._COPIER.put(lambda: (busy.set(), let_go.wait(60)))
    assert busy.wait(60)
    names = _pieces_by_thread(monkeypatch)
    src = np.arange(4 * MB, dtype=np.float32)  # 16 MB
    try:
        path, _ = pool.write([memoryview(src).cast("B")])
        assert set(names) == {threading.current_thread().name}
        assert len(names) == -(-src.nbytes // _shm._PIECE)
        # The copier, free at last, finds no piece left and no hold on the segment.
        let_go.set()
        _shm._COPIER.drain()
        assert len(names) == -(-src.nbytes // _shm._PIECE)
        (view,) = reader.buffers(path, [src.nbytes])
        assert np.array_equal(np.frombuffer(view, np.float32), src)
        del view
    finally:
        let_go.set()


def test_a_piece_that_fails_on_the_copier_fails_the_write(spare, link, monkeypatch):
    copyto = np.copyto

    def failing_on_the_copier(dst: np.ndarray, src: np.ndarray) -> None:
        if threading.current_thread().name == "rpcdist-shm-copier":
            raise MemoryError("injected on the copier")
        copyto(dst, src)

    # The sender waits for the copier to take a piece before it takes its own.
    took = threading.Event()
    work = _shm._SharedCopy.work

    def waiting_for_the_copier(self: _shm._SharedCopy) -> None:
        if threading.current_thread().name == "rpcdist-shm-copier":
            took.set()
        else:
            assert took.wait(60)
        work(self)

    monkeypatch.setattr(_shm.np, "copyto", failing_on_the_copier)
    monkeypatch.setattr(_shm._SharedCopy, "work", waiting_for_the_copier)
    pool, _ = link
    with pytest.raises(MemoryError, match="injected on the copier"):
        pool.write([memoryview(np.ones(16 * MB, np.uint8))])
    # The segment is free again: the next write reuses it.
    monkeypatch.setattr(_shm.np, "copyto", copyto)
    monkeypatch.setattr(_shm._SharedCopy, "work", work)
    pool.write([memoryview(np.ones(16 * MB, np.uint8))])
    assert len(pool) == 1


def test_without_an_idle_core_the_sender_copies_alone(link, monkeypatch):
    monkeypatch.setattr(_shm, "spare_core", lambda: False)
    put: list[object] = []
    monkeypatch.setattr(_shm._COPIER, "put", lambda *a: put.append(a))
    link[0].write([memoryview(np.ones(16 * MB, np.uint8))])
    assert put == []


def test_small_buffers_are_never_shared(spare, link, monkeypatch):
    put: list[object] = []
    monkeypatch.setattr(_shm._COPIER, "put", lambda *a: put.append(a))
    link[0].write([memoryview(np.ones(_shm._SHARED_COPY - 1, np.uint8))] * 3)
    assert put == []


def test_the_copier_has_ended_once_the_transport_cleans_up(spare):
    w = SegmentWriter()
    pool = w.pool()
    pool.write([memoryview(np.ones(16 * MB, np.uint8))])
    pool.close()
    w.cleanup()
    assert _copiers() == []


class _InterruptedOnce(threading.Event):
    """An event whose first wait is interrupted (KeyboardInterrupt)."""

    hit = False

    def wait(self, timeout: float | None = None) -> bool:
        if not self.hit:
            self.hit = True
            raise KeyboardInterrupt
        return super().wait(timeout)


def test_an_interrupted_write_returns_only_once_the_copiers_piece_is_in(spare, link, monkeypatch):
    # The segment is free again once the write returns: a piece still being
    # copied into it would land in the next message.
    pool, _ = link
    copyto = np.copyto
    holding, let_go = threading.Event(), threading.Event()
    order: list[str] = []

    def copier_slow(dst: np.ndarray, src: np.ndarray) -> None:
        if threading.current_thread().name == "rpcdist-shm-copier":
            holding.set()
            assert let_go.wait(60)
            copyto(dst, src)
            order.append("copier's piece in")
        else:  # (the sender takes its pieces once the copier holds one)
            assert holding.wait(60)
            copyto(dst, src)

    init = _shm._SharedCopy.__init__

    def interrupted_once(self: _shm._SharedCopy, dst: np.ndarray, src: np.ndarray) -> None:
        init(self, dst, src)
        self.done = _InterruptedOnce()

    monkeypatch.setattr(_shm.np, "copyto", copier_slow)
    monkeypatch.setattr(_shm._SharedCopy, "__init__", interrupted_once)

    def write() -> None:
        try:
            pool.write([memoryview(np.ones(16 * MB, np.uint8))])
        except KeyboardInterrupt:
            order.append("write interrupted")

    t = threading.Thread(target=write)
    t.start()
    t.join(0.5)  # (a write that did not wait would be done by now)
    let_go.set()
    t.join(60)
    assert order == ["copier's piece in", "write interrupted"]
