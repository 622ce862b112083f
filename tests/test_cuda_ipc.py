"""CuPy arrays between workers of one host by CUDA IPC handle (rpcdist._device._cuda_ipc).

These tests run without a GPU: a fake ``cupy`` module stands for the arrays
and a fake runtime for the CUDA calls, with one "driver" whose memory both
agents' runtimes map, as two processes of one host would. The real thing is
in ``test_cuda_ipc_gpu.py`` (two processes on a GPU).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from agent_support import until
from fake_cupy import FakeArray, install

import rpcdist
from rpcdist import RpcOptions, SerializationError
from rpcdist._device import _cuda_ipc
from rpcdist.testing import as_current, local_agents


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    return install(monkeypatch)


class Driver:
    """Device memory of one host, shared by every fake runtime."""

    def __init__(self) -> None:
        self.memory: dict[int, bytearray] = {}
        self.ptrs = itertools.count(0x1000, 0x1000)
        self.freed: list[int] = []


class FakeRuntime:
    """One process's view of the driver; ``refuse`` makes every mapping fail."""

    def __init__(self, driver: Driver, refuse: bool = False) -> None:
        self.driver = driver
        self.refuse = refuse
        self.device = 0  # this thread's current device
        self.unmappable: set[int] = set()  # devices that cannot map a peer's memory
        self.fail_stage = False
        self.fail_export = False
        self.mapped: dict[int, int] = {}  # mapped pointer -> exported block
        self.closed: list[int] = []
        self.staged = 0

    def current_device(self) -> int:
        return self.device

    def device_of(self, array: Any) -> int:
        return 0

    def malloc(self, device: int, nbytes: int) -> int:
        ptr = next(self.driver.ptrs)
        self.driver.memory[ptr] = bytearray(nbytes)
        return ptr

    def free(self, device: int, ptr: int) -> None:
        del self.driver.memory[ptr]
        self.driver.freed.append(ptr)

    def export(self, device: int, ptr: int) -> bytes:
        if self.fail_export:
            raise RuntimeError("cudaErrorMapBufferObjectFailed")
        return ptr.to_bytes(8, "little").ljust(64, b"\0")

    def open(self, handle: bytes, device: int) -> int:
        if self.refuse:
            raise RuntimeError("cudaErrorInvalidContext: invalid device context")
        if device in self.unmappable:
            raise RuntimeError("cudaErrorPeerAccessUnsupported: peer access is not supported")
        ptr = next(self.driver.ptrs)
        self.mapped[ptr] = int.from_bytes(handle[:8], "little")
        return ptr

    def close(self, ptr: int) -> None:
        del self.mapped[ptr]
        self.closed.append(ptr)

    def stage(self, array: Any, ptr: int) -> None:
        if self.fail_stage:
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access")
        data = np.ascontiguousarray(array.host).reshape(-1).view(np.uint8)
        self.driver.memory[ptr][: data.nbytes] = data.tobytes()
        self.staged += 1

    def fetch(self, ptr: int, shape: tuple[int, ...], dtype: Any, out: Any = None) -> Any:
        block = self.driver.memory[self.mapped[ptr]]
        count = int(np.prod(shape))
        got = np.frombuffer(block, dtype, count).reshape(shape)
        if out is None:
            return FakeArray(got.copy())
        out.host[...] = got
        return out

    def write(self, device: int, ptr: int, data: bytes) -> None:
        self.driver.memory[ptr][: len(data)] = data

    def read(self, ptr: int, nbytes: int) -> bytes:
        return bytes(self.driver.memory[self.mapped[ptr]][:nbytes])


def echo(x: Any) -> Any:
    return x


def ext(agent: Any) -> _cuda_ipc.CudaIpc:
    return agent.registry.extensions["cuda_ipc"]


@pytest.fixture
def pair(fake_cupy: types.ModuleType) -> Iterator[tuple[Any, Any, Driver]]:
    driver = Driver()
    with local_agents(2, options=RpcOptions(token=None)) as (a, b):
        ext(a)._runtime = FakeRuntime(driver)
        ext(b)._runtime = FakeRuntime(driver)
        yield a, b, driver


def big(seed: int = 0, n: int = 1 << 17) -> FakeArray:
    return FakeArray(np.random.default_rng(seed).standard_normal(n).astype(np.float32))


def probed(a: Any, peer: int = 1) -> bool | None:
    return until(lambda: ext(a)._peers.get((peer, 0)) is not None) and ext(a)._peers[(peer, 0)]


def test_large_arrays_cross_by_handle_once_the_probe_succeeds(pair: Any) -> None:
    a, b, _ = pair
    x = big()
    with as_current(a):
        first = rpcdist.rpc_sync("worker1", echo, args=(x,))  # host path; starts the probe
        assert ext(a).sent == 0 and np.array_equal(first.host, x.host)
        assert probed(a) is True and probed(b, 0) is True
        for seed in range(1, 4):
            y = big(seed)
            back = rpcdist.rpc_sync("worker1", echo, args=(y,))
            assert type(back) is FakeArray and np.array_equal(back.host, y.host)
            # Every lend comes back (releases are control messages, a little later).
            assert until(lambda: ext(a).statistics()["cuda_ipc_lends"] == 0)
            assert until(lambda: ext(b).statistics()["cuda_ipc_lends"] == 0)
    # Both directions went by handle: the call's argument and the echoed reply.
    assert ext(a).sent == 3 and ext(b).received == 3
    assert ext(b).sent == 3 and ext(a).received == 3
    # Blocks are reused (each lend came back before the next: one block each,
    # the probe's), and each is mapped once by the peer.
    assert len(ext(a)._blocks) == 1 and len(ext(b)._blocks) == 1
    assert len(ext(b)._runtime.mapped) == len(ext(a)._blocks)  # type: ignore[union-attr]


def test_the_sender_may_change_its_array_once_the_call_returned(pair: Any) -> None:
    a, b, _ = pair
    with as_current(a):
        rpcdist.rpc_sync("worker1", echo, args=(big(),))
        assert probed(a) is True
        x = big(7)
        fut = rpcdist.rpc_async("worker1", echo, args=(x,))
        expected = x.host.copy()
        x.host[:] = 0  # a snapshot was staged while encoding
        assert np.array_equal(fut.wait().host, expected)


def test_layouts_and_dtypes_survive(pair: Any) -> None:
    a, _, _ = pair
    f_order = FakeArray(np.asfortranarray(np.arange(512 * 256, dtype=np.float64).reshape(512, 256)))
    strided = FakeArray(np.arange(4 << 17, dtype=np.int32).reshape(-1, 4)[:, 1])
    cplx = FakeArray(np.full((300, 300), 1 - 2j, np.complex64))
    with as_current(a):
        rpcdist.rpc_sync("worker1", echo, args=(big(),))
        assert probed(a) is True
        for x in (f_order, strided, cplx):
            back = rpcdist.rpc_sync("worker1", echo, args=(x,))
            assert back.dtype == x.dtype and back.shape == x.shape
            assert np.array_equal(back.host, x.host)
        assert rpcdist.rpc_sync("worker1", echo, args=(f_order,)).host.flags.f_contiguous
    assert ext(a).sent == 4


def test_small_arrays_always_take_the_host_path(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    a, _, _ = pair
    with as_current(a):
        rpcdist.rpc_sync("worker1", echo, args=(big(),))
        assert probed(a) is True
        small = FakeArray(np.ones(_cuda_ipc.MIN_BYTES // 4 - 1, np.float32))
        assert np.array_equal(rpcdist.rpc_sync("worker1", echo, args=(small,)).host, small.host)
        # A small strided one is not even made contiguous on the device first.
        monkeypatch.setattr(sys.modules["cupy"], "ascontiguousarray", None)
        strided = FakeArray(np.arange(1000.0)[::2])
        assert np.array_equal(rpcdist.rpc_sync("worker1", echo, args=(strided,)).host, strided.host)
    assert ext(a).sent == 0


def test_a_peer_that_cannot_map_keeps_the_host_path(
    fake_cupy: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="rpcdist._device._cuda_ipc")
    driver = Driver()
    with local_agents(2, options=RpcOptions(token=None)) as (a, b):
        ext(a)._runtime = FakeRuntime(driver)
        ext(b)._runtime = FakeRuntime(driver, refuse=True)
        with as_current(a):
            for seed in range(3):
                x = big(seed)
                assert np.array_equal(rpcdist.rpc_sync("worker1", echo, args=(x,)).host, x.host)
                if seed == 0:
                    assert probed(a) is False
        assert ext(a).sent == 0 and ext(b).received == 0
        # Why is said once, naming the peer and CUDA's reason.
        said = [r.getMessage() for r in caplog.records if "CUDA IPC" in r.getMessage()]
        assert len(said) == 1
        assert "to 'worker1' travel through host memory" in said[0]
        assert "cudaErrorInvalidContext" in said[0]
        # The probe's block went back to the pool, and nothing is lent.
        assert ext(a).statistics()["cuda_ipc_lends"] == 0
        assert sum(map(len, ext(a)._free.values())) == len(ext(a)._blocks) == 1


def test_turned_off_it_never_probes(fake_cupy: types.ModuleType) -> None:
    driver = Driver()
    opts = RpcOptions(token=None, cuda_ipc=False)
    f_order = FakeArray(np.asfortranarray(np.arange(512 * 256, dtype=np.float64).reshape(512, 256)))
    with local_agents(2, options=opts) as (a, b):
        ext(a)._runtime = FakeRuntime(driver)
        ext(b)._runtime = FakeRuntime(driver)
        with as_current(a):
            for x in (big(0), big(1), f_order):
                back = rpcdist.rpc_sync("worker1", echo, args=(x,))
                assert np.array_equal(back.host, x.host)
            assert back.host.flags.f_contiguous  # the host path keeps the order too
        assert ext(a)._peers == {} and not driver.memory


def test_the_option_reads_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCDIST_CUDA_IPC", "0")
    assert RpcOptions().cuda_ipc is False
    monkeypatch.setenv("RPCDIST_CUDA_IPC", "1")
    assert RpcOptions().cuda_ipc is True


# ----------------------------------------------- lends, leases and losses


@dataclasses.dataclass
class Wire:
    """The parts of a WireContext the extension reads."""

    agent: Any
    peer: Any
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def abort(self) -> None:
        for undo in self.extra.pop("undo", ()):
            undo()


def ready(agent: Any, driver: Driver, peer: int = 1) -> _cuda_ipc.CudaIpc:
    e = ext(agent)
    e._runtime = FakeRuntime(driver)
    e._peers[(peer, 0)] = True
    return e


def test_an_aborted_message_gives_its_lend_back(pair: Any) -> None:
    a, b, driver = pair
    e = ready(a, driver)
    wire = Wire(a, a.workers[1])
    assert e.lend(wire, big()) is not None
    assert e.statistics()["cuda_ipc_lends"] == 1
    wire.abort()
    assert e.statistics()["cuda_ipc_lends"] == 0


def test_a_lost_peer_gives_its_lends_back_and_its_blocks_are_unmapped(pair: Any) -> None:
    a, b, driver = pair
    e = ready(a, driver)
    fields = e.lend(Wire(a, a.workers[1]), big())
    assert fields is not None and e.statistics()["cuda_ipc_lends"] == 1
    # The peer maps the block; then each loses the other.
    out = ext(b).take(Wire(b, b.workers[0]), fields, (1 << 17,), np.dtype(np.float32))
    assert np.array_equal(out.host, big().host)
    assert len(ext(b)._runtime.mapped) == 1  # type: ignore[union-attr]
    e.peer_lost(1)
    ext(b).peer_lost(0)
    assert e.statistics()["cuda_ipc_lends"] == 0 and e._peers[(1, 0)] is False
    assert not ext(b)._runtime.mapped and ext(b)._mapped == {}  # type: ignore[union-attr]
    assert e.lend(Wire(a, a.workers[1]), big()) is None  # no IPC to a lost peer


def test_a_receiver_refuses_a_lend_past_its_lease(pair: Any) -> None:
    a, b, driver = pair
    e = ready(a, driver)
    fields = e.lend(Wire(a, a.workers[1]), big())
    assert fields is not None
    fields[4] = time.monotonic() + _cuda_ipc.MARGIN / 2  # as if it had been delayed
    with pytest.raises(SerializationError, match="after its CUDA IPC lease ran out"):
        ext(b).take(Wire(b, b.workers[0]), fields, (1 << 17,), np.dtype(np.float32))
    # Refused or not, the lend is released.
    assert until(lambda: e.statistics()["cuda_ipc_lends"] == 0)


def test_malformed_ipc_fields_are_refused(pair: Any) -> None:
    a, b, driver = pair
    e = ready(a, driver)
    fields = e.lend(Wire(a, a.workers[1]), big())
    assert fields is not None
    for bad in (fields[:-1], [*fields[:3], "7", *fields[4:]], [*fields[:4], 1, fields[5]]):
        with pytest.raises(SerializationError, match="malformed CuPy array payload"):
            ext(b).take(Wire(b, b.workers[0]), bad, (1 << 17,), np.dtype(np.float32))


def test_past_the_cap_arrays_take_the_host_path_and_expired_lends_come_back(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _, driver = pair
    e = ready(a, driver)
    monkeypatch.setattr(_cuda_ipc, "CAP", 2 * _cuda_ipc.MIN_BLOCK)
    wires = [Wire(a, a.workers[1]) for _ in range(3)]
    got = [e.lend(w, big()) for w in wires]
    assert got[0] is not None and got[1] is not None and got[2] is None  # two blocks fit
    assert len(driver.memory) == 2
    e._lends[got[0][3]].expiry = time.monotonic() - 1  # as if never released
    assert e.lend(Wire(a, a.workers[1]), big()) is not None  # the expired block is reused
    assert len(driver.memory) == 2


def test_close_frees_the_blocks_and_unmaps_the_peers(pair: Any) -> None:
    a, b, driver = pair
    e = ready(a, driver)
    fields = e.lend(Wire(a, a.workers[1]), big())
    assert fields is not None
    ext(b).take(Wire(b, b.workers[0]), fields, (1 << 17,), np.dtype(np.float32))
    rt_b = ext(b)._runtime
    ext(b).close()
    e.close()
    assert rt_b.closed and not rt_b.mapped  # type: ignore[union-attr]
    assert not driver.memory and len(driver.freed) == 1
    assert e.lend(Wire(a, a.workers[1]), big()) is None


def test_idle_blocks_are_unmapped_by_their_peers_then_freed(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, driver = pair
    monkeypatch.setattr(_cuda_ipc, "IDLE", 0.2)
    with as_current(a):
        rpcdist.rpc_sync("worker1", echo, args=(big(),))
        assert probed(a) is True and probed(b, 0) is True
        back = rpcdist.rpc_sync("worker1", echo, args=(big(1),))
        assert np.array_equal(back.host, big(1).host)
    assert ext(a).sent == 1 and ext(b).sent == 1
    # One lend stays out (as if its message were still on the way): its
    # block must outlive the trimming; every other block goes.
    held = ext(a).lend(Wire(a, a.workers[1]), big(2, 1 << 19))
    assert held is not None
    kept = held[1]
    mapped_b = ext(b)._runtime.mapped  # type: ignore[union-attr]
    mapped_a = ext(a)._runtime.mapped  # type: ignore[union-attr]
    assert until(lambda: [blk.id for blk in ext(a)._blocks] == [kept] and not ext(b)._blocks)
    assert until(lambda: not mapped_a and not ext(a)._mapped)
    assert until(lambda: not mapped_b and not ext(b)._mapped)  # (the lent block is unmapped)
    assert len(driver.memory) == 1 and len(driver.freed) >= 2
    # The lent block still holds its array, and goes once released and idle.
    out = ext(b).take(Wire(b, b.workers[0]), held, (1 << 19,), np.dtype(np.float32))
    assert np.array_equal(out.host, big(2, 1 << 19).host)
    assert until(lambda: not ext(a)._blocks and not driver.memory)
    assert until(lambda: not ext(b)._mapped and not mapped_b)


def test_a_thread_on_a_device_that_cannot_map_uses_the_probed_one(pair: Any) -> None:
    a, b, _ = pair
    with as_current(a):
        rpcdist.rpc_sync("worker1", echo, args=(big(),))
        assert probed(a) is True  # answered by b on device 0
    rt_b = ext(b)._runtime
    rt_b.device = 1  # type: ignore[union-attr]
    rt_b.unmappable = {1}  # type: ignore[union-attr]
    fields = ext(a).lend(Wire(a, a.workers[1]), big(3))
    assert fields is not None
    out = ext(b).take(Wire(b, b.workers[0]), fields, (1 << 17,), np.dtype(np.float32))
    assert np.array_equal(out.host, big(3).host)
    assert {k[2] for k in ext(b)._mapped if k[1] == fields[1]} == {0}
    # With no device that can map it, the error names CUDA IPC and the peer.
    rt_b.unmappable = {0, 1}  # type: ignore[union-attr]
    fields = ext(a).lend(Wire(a, a.workers[1]), big(4, 1 << 19))
    assert fields is not None
    with pytest.raises(SerializationError, match="from 'worker0' through CUDA IPC.*peer access"):
        ext(b).take(Wire(b, b.workers[0]), fields, (1 << 19,), np.dtype(np.float32))


@pytest.mark.parametrize("fault", ["stage", "export"])
def test_a_failing_cuda_call_on_the_sender_leaves_the_host_path(pair: Any, fault: str) -> None:
    a, _, driver = pair
    with as_current(a):
        rpcdist.rpc_sync("worker1", echo, args=(big(),))
        assert probed(a) is True
        setattr(ext(a)._runtime, f"fail_{fault}", True)
        x = big(5, 1 << 20)  # a new block size: export is asked for
        assert np.array_equal(rpcdist.rpc_sync("worker1", echo, args=(x,)).host, x.host)
    assert ext(a).sent == 0 and ext(a).statistics()["cuda_ipc_lends"] == 0
    held = ext(a).statistics()["cuda_ipc_block_bytes"]
    assert held == sum(len(v) * k[1] for k, v in ext(a)._free.items())  # all blocks free
    assert len(driver.memory) == len(ext(a)._blocks) + len(ext(pair[1])._blocks)


def test_a_lend_whose_message_never_arrived_comes_back_at_its_expiry(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _, driver = pair
    monkeypatch.setattr(_cuda_ipc, "IDLE", 0.1)
    e = ready(a, driver)
    fields = e.lend(Wire(a, a.workers[1]), big())
    assert fields is not None
    # Never released (its message was dropped unread): at its expiry the
    # lend comes back, and its block is retired once idle.
    e._lends[fields[3]].expiry = time.monotonic() + 0.2
    assert until(lambda: e.statistics()["cuda_ipc_lends"] == 0)
    assert until(lambda: e.statistics()["cuda_ipc_block_bytes"] == 0 and not driver.memory)


def test_a_lend_that_does_not_fit_its_block_is_refused_before_any_copy(pair: Any) -> None:
    a, b, driver = pair
    e = ready(a, driver)
    fields = e.lend(Wire(a, a.workers[1]), big())
    assert fields is not None and fields[5] == _cuda_ipc.MIN_BLOCK
    staged = ext(b)._runtime
    # A header claiming more bytes than the block holds would read past it.
    with pytest.raises(SerializationError, match="does not fit its CUDA IPC block"):
        ext(b).take(Wire(b, b.workers[0]), fields, (1 << 19,), np.dtype(np.float32))
    assert not ext(b)._mapped and not staged.mapped  # type: ignore[union-attr]
    assert until(lambda: e.statistics()["cuda_ipc_lends"] == 0)  # released all the same


def test_an_array_over_max_message_bytes_takes_the_host_path_and_its_refusal(
    fake_cupy: types.ModuleType,
) -> None:
    driver = Driver()
    opts = RpcOptions(token=None, max_message_bytes=1 << 20)
    with local_agents(2, options=opts) as (a, b):
        ext(a)._runtime = FakeRuntime(driver)
        ext(b)._runtime = FakeRuntime(driver)
        ext(a)._peers[(1, 0)] = True
        with as_current(a), pytest.raises(SerializationError, match="max_message_bytes"):
            rpcdist.rpc_sync("worker1", echo, args=(big(0, 1 << 19),))  # 2 MiB
        assert ext(a).sent == 0 and not driver.memory
