"""Pure layers of the collectives: ring schedule, splits, trees, metadata, backend choice."""

from __future__ import annotations

import functools
import itertools
import operator
import types
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcdist import CollectiveError, ConfigError
from rpcdist.collectives import ReduceOp
from rpcdist.collectives._engine import HostEngine, LocalOps
from rpcdist.collectives._nccl import NcclEngine, nccl_supports, usable, use_nccl
from rpcdist.collectives._ops import Meta, Xp, check_op, validate
from rpcdist.collectives._ring import (
    ag_step,
    chain_neighbours,
    dissemination_peers,
    lane_count,
    lanes,
    rs_step,
    simulate_ring_allreduce,
    split,
    tree_children,
    tree_parent,
)
from rpcdist.collectives._state import cpu_backend


@given(st.integers(0, 1000), st.integers(1, 17))
def test_split_covers_the_range_with_sizes_differing_by_at_most_one(n, parts):
    ranges = split(n, parts)
    assert len(ranges) == parts
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError):
        split(3, 0)
    with pytest.raises(ValueError):
        split(-1, 2)


@pytest.mark.parametrize("p", range(1, 9))
def test_ring_schedule_sends_what_the_left_neighbour_expects(p):
    for step in range(p - 1):
        for r in range(p):
            sent = rs_step(r, p, step)[0]
            assert rs_step((r + 1) % p, p, step)[1] == sent
            sent = ag_step(r, p, step)[0]
            assert ag_step((r + 1) % p, p, step)[1] == sent
    for r in range(p):
        # Rank r finishes reduce-scatter with segment r, and all-gather
        # brings every other segment exactly once.
        if p > 1:
            assert rs_step(r, p, p - 2)[1] == r
        got = {ag_step(r, p, s)[1] for s in range(p - 1)}
        assert got == set(range(p)) - {r}
        # Each forwarded segment is the one received a step before.
        for s in range(1, p - 1):
            assert rs_step(r, p, s)[0] == rs_step(r, p, s - 1)[1]
            assert ag_step(r, p, s)[0] == ag_step(r, p, s - 1)[1]


@given(
    st.integers(1, 7),
    st.integers(0, 60),
    st.integers(1, 9),
    st.sampled_from(["add", "max", "xor"]),
    st.integers(0, 2**16),
)
@settings(max_examples=150, deadline=None)
def test_simulated_ring_allreduce_equals_the_reduction(p, n, chunk, opname, seed):
    rng = np.random.default_rng(seed)
    inputs = [list(rng.integers(0, 100, n)) for _ in range(p)]
    fn = {"add": operator.add, "max": max, "xor": operator.xor}[opname]
    expected = [functools.reduce(fn, col) for col in zip(*inputs)] if n else []
    for got in simulate_ring_allreduce(inputs, fn, chunk):
        assert got == expected


def test_simulated_ring_needs_equal_lengths():
    with pytest.raises(ValueError):
        simulate_ring_allreduce([[1, 2], [1]], operator.add)


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=8), st.integers(1, 4096))
def test_lanes_cut_every_segment_into_chunks_of_at_most_chunk(sizes, chunk):
    count = lane_count(sizes, chunk)
    assert count >= 1
    assert count == max(1, -(-max(sizes) // chunk))
    for size in sizes:
        ranges = lanes(size, count)
        assert len(ranges) == count and ranges[-1][1] == size
        assert all(b - a <= chunk for a, b in ranges)


@pytest.mark.parametrize("p", range(1, 18))
def test_binomial_tree_is_a_spanning_tree(p):
    seen = {0}
    frontier = [0]
    while frontier:
        node = frontier.pop()
        for c in tree_children(node, p):
            assert tree_parent(c) == node and c not in seen
            seen.add(c)
            frontier.append(c)
    assert seen == set(range(p))
    assert tree_parent(0) == -1


@pytest.mark.parametrize("p", range(1, 10))
def test_chain_and_dissemination(p):
    assert chain_neighbours(0, p)[0] == -1 and chain_neighbours(p - 1, p)[1] == -1
    for r in range(p):
        heard = {r}
        for k, (to, frm) in enumerate(dissemination_peers(r, p)):
            assert to == (r + 2**k) % p and frm == (r - 2**k) % p
        # After the rounds, r has heard from everyone transitively.
        knows = [{q} for q in range(p)]
        for k in range(len(dissemination_peers(0, p))):
            knows = [knows[q] | knows[(q - 2**k) % p] for q in range(p)]
        heard |= knows[r]
        assert heard == set(range(p))


def test_check_op_accepts_and_rejects():
    assert check_op(ReduceOp.SUM, np.dtype("f4")) is ReduceOp.SUM
    assert check_op(3, np.dtype("i4")) is ReduceOp.MAX
    with pytest.raises(ConfigError, match="integer"):
        check_op(ReduceOp.BXOR, np.dtype("f4"))
    with pytest.raises(ConfigError, match="AVG"):
        check_op(ReduceOp.AVG, np.dtype("i8"))
    with pytest.raises(ConfigError):
        check_op("sum", np.dtype("f4"))


def test_meta_names_both_sides_of_a_mismatch():
    a = Meta("all_reduce", 3, ReduceOp.SUM, -1, "f4", (4,))
    b = Meta("all_reduce", 3, ReduceOp.SUM, -1, "f8", (4,))
    a.check(a.wire, 1, "x")
    with pytest.raises(CollectiveError, match=r"float64\[4\].*float32\[4\]"):
        a.check(b.wire, 1, "all_reduce #3")


def test_validate_pairs_piece_sizes():
    ok = [
        Meta("all_to_all", 0, 0, -1, "f4", (), [1, 2], [1, 3]).full,
        Meta("all_to_all", 0, 0, -1, "f4", (), [3, 4], [2, 4]).full,
    ]
    validate(ok, "x")
    bad = [ok[0], Meta("all_to_all", 0, 0, -1, "f4", (), [5, 4], [2, 4]).full]
    with pytest.raises(CollectiveError, match="sends 5 elements to rank 0"):
        validate(bad, "x")
    gathers = [
        Meta("gather", 1, 0, 0, "f4", (), [2], [2, 3]).full,
        Meta("gather", 1, 0, 0, "f4", (), [4], []).full,
    ]
    with pytest.raises(CollectiveError, match="expects 3"):
        validate(gathers, "x")
    with pytest.raises(CollectiveError, match="rank 1 called"):
        validate([ok[0], Meta("broadcast", 0, 0, 1, "f4", (2,)).full], "x")


def test_cpu_backend_choice():
    assert cpu_backend("auto", ["h", "h"]) == "shm"
    assert cpu_backend("auto", ["h", "k"]) == "ring"
    assert cpu_backend("nccl", ["h"]) == "shm"
    assert cpu_backend("grpc", ["h", "h"]) == "ring"  # the former name
    assert cpu_backend("ring", ["h", "h"]) == "ring"
    assert cpu_backend("shm", ["h", "h"]) == "shm"
    with pytest.raises(ConfigError, match="one host"):
        cpu_backend("shm", ["h", "k"])
    with pytest.raises(ConfigError, match="backend"):
        cpu_backend("mpi", ["h"])


def test_nccl_selection_logic():
    assert usable([[True, "h/0"], [True, "h/1"]])
    assert not usable([[True, "h/0"], [True, "h/0"]])  # two ranks share a GPU
    assert not usable([[True, "h/0"], [False, "no cupy"]])
    assert not usable([])
    assert use_nccl("auto", True, True)
    assert not use_nccl("auto", False, True)  # NumPy buffers never go to NCCL
    assert not use_nccl("auto", True, False)
    assert not use_nccl("shm", True, True) and not use_nccl("ring", True, True)
    with pytest.raises(ConfigError, match="nccl"):
        use_nccl("nccl", True, False)
    f4, c8, b1 = np.dtype("f4"), np.dtype("c8"), np.dtype("?")
    assert nccl_supports("all_reduce", f4, ReduceOp.SUM)
    assert nccl_supports("all_reduce", c8, ReduceOp.AVG)
    assert not nccl_supports("all_reduce", c8, ReduceOp.MAX)
    assert not nccl_supports("all_reduce", np.dtype("i4"), ReduceOp.BXOR)
    assert not nccl_supports("all_reduce", b1, ReduceOp.MAX)
    assert not nccl_supports("all_reduce", np.dtype("i2"), ReduceOp.SUM)
    assert not nccl_supports("all_gather", f4, None, [2, 3])
    assert nccl_supports("all_gather", f4, None, [3, 3])
    assert not nccl_supports("all_to_all", f4, None)


class _FakeBuf:
    def __init__(self, ptr: int, size: int, dtype: str) -> None:
        self.data = types.SimpleNamespace(ptr=ptr)
        self.size = size
        self.dtype = np.dtype(dtype)
        self.divided_by = 1

    def __itruediv__(self, k: int) -> _FakeBuf:
        self.divided_by = k
        return self


def _fake_nccl_engine(rank: int = 0):
    calls = []

    class Comm:
        def __getattr__(self, name):
            return lambda *a: calls.append((name, a))

    nccl = types.SimpleNamespace(
        NCCL_FLOAT32=7,
        NCCL_FLOAT64=8,
        NCCL_INT64=4,
        NCCL_SUM=0,
        NCCL_PROD=1,
        NCCL_MAX=2,
        NCCL_MIN=3,
    )
    event = types.SimpleNamespace(record=lambda s: None, synchronize=lambda: None)
    cuda = types.SimpleNamespace(Device=lambda i: nullcontext(), Event=lambda **kw: event)
    cupy = types.SimpleNamespace(cuda=cuda)
    return NcclEngine(Comm(), nccl, cupy, 4, rank), calls


def test_nccl_engine_translates_calls():
    import asyncio

    eng, calls = _fake_nccl_engine()
    stream = types.SimpleNamespace(ptr=99)
    src, dst = _FakeBuf(1, 10, "f4"), _FakeBuf(2, 10, "f4")
    cplx = _FakeBuf(3, 5, "c16")

    async def go() -> None:
        await eng.run(
            "all_reduce", {"src": src, "dst": dst, "op": ReduceOp.MAX, "device": 0}, stream, 5, "x"
        )
        await eng.run(
            "all_reduce",
            {"src": cplx, "dst": cplx, "op": ReduceOp.AVG, "device": 0},
            stream,
            5,
            "x",
        )
        await eng.run("broadcast", {"buf": src, "root": 2, "device": 0}, stream, 5, "x")
        await eng.run(
            "reduce",
            {"src": src, "dst": src, "op": ReduceOp.SUM, "root": 1, "device": 0},
            stream,
            5,
            "x",
        )

    asyncio.run(go())
    assert calls[0] == ("allReduce", (1, 2, 10, 7, 2, 99))
    assert calls[1] == ("allReduce", (3, 3, 10, 8, 0, 99))  # complex as float pairs, AVG as SUM
    assert cplx.divided_by == 4  # ... then divided on the GPU
    assert calls[2] == ("broadcast", (1, 1, 10, 7, 2, 99))
    assert calls[3] == ("reduce", (1, 1, 10, 7, 0, 1, 99))
    with pytest.raises(CollectiveError, match="does not run"):
        asyncio.run(eng.run("all_to_all", {"device": 0}, stream, 5, "x"))


# ------------------------------------------------- page-locked shared memory


class _PinRecorder:
    """A device adapter that records which host regions are page-locked."""

    host = False

    def __init__(self, refuse_at: int = 0, unpin_fails: bool = False) -> None:
        self.refuse_at = refuse_at
        self.unpin_fails = unpin_fails
        self.tries = 0
        self.locked: set[int] = set()

    def pin(self, region: np.ndarray) -> bool:
        self.tries += 1
        if self.tries == self.refuse_at:
            return False
        self.locked.add(region.ctypes.data)
        return True

    def unpin(self, region: np.ndarray) -> None:
        if self.unpin_fails:
            raise RuntimeError("device gone")
        self.locked.remove(region.ctypes.data)


def _segments(world: int = 3):
    import mmap
    import socket

    from rpcdist.collectives._shm import _CTRL, SLOTS, Segments

    slot = 4096
    maps = [mmap.mmap(-1, _CTRL + SLOTS * slot) for _ in range(world)]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    return Segments(0, maps, sock, [f"pin-test-{q}" for q in range(world)], slot), maps


def test_shared_memory_is_page_locked_once_per_group_and_released_at_close():
    seg, maps = _segments(3)
    xp = _PinRecorder()
    assert seg.pin(xp) and seg.pinned
    assert len(xp.locked) == 3  # every member's data region, each once
    assert seg.pin(xp) and xp.tries == 3  # later collectives do not pin again
    seg.close()
    assert xp.locked == set() and not seg.pinned
    assert all(m.closed for m in maps)


def test_a_refused_region_leaves_no_region_page_locked_and_is_not_retried():
    seg, maps = _segments(3)
    xp = _PinRecorder(refuse_at=2)
    assert not seg.pin(xp) and not seg.pinned
    assert xp.locked == set()
    assert not seg.pin(xp) and xp.tries == 2
    seg.close()
    assert all(m.closed for m in maps)


def test_a_device_that_fails_at_close_still_lets_the_segments_unmap():
    seg, maps = _segments(2)
    assert seg.pin(_PinRecorder(unpin_fails=True))
    seg.close()
    assert all(m.closed for m in maps) and not seg.pinned


def test_host_buffers_are_never_page_locked():
    from rpcdist.collectives._ops import xp_for

    seg, _ = _segments(2)
    assert not seg.pin(xp_for(np.zeros(3))) and not seg.pinned
    assert seg.pin(_PinRecorder())  # a later device collective still pins them
    seg.close()


# ------------------------------------------- device buffers reduced on the host


class _DeviceXp(Xp):
    """Array operations of a pretend device whose memory is NumPy's: counts
    the copies between it and the host."""

    host = False

    def __init__(self) -> None:
        super().__init__()
        self.down = self.up = 0

    def host_view(self, a):
        self.down += 1
        return np.array(a)  # a copy, as from a device

    def from_host(self, dst, src):
        self.up += 1
        np.copyto(dst, src)


class _Inner:
    """A blocking CPU engine that reduces as if every rank held the same buffer."""

    def __init__(self, limit: int, size: int = 2) -> None:
        self.limit, self.size = limit, size
        self.seen: list[tuple[str, bool, bool]] = []

    def reduces_on_host(self, nbytes):
        return nbytes <= self.limit

    def all_reduce(self, seq, xp, src, dst, op, meta):
        self.seen.append(("all_reduce", xp.host, dst is src))
        xp.ufunc(op)(src, src, out=dst)

    def reduce(self, seq, xp, src, out, root, op, meta):
        self.seen.append(("reduce", xp.host, out is None))
        if out is not None:
            xp.ufunc(op)(src, src, out=out)


@pytest.mark.parametrize("n", [4, 1000])
def test_host_engine_reduces_device_buffers_on_the_host_where_the_engine_says(n):
    inner, xp = _Inner(limit=64), _DeviceXp()
    engine = HostEngine(inner, None)  # type: ignore[arg-type]
    src, dst = np.arange(n, dtype=np.float32), np.zeros(n, np.float32)
    meta = Meta("all_reduce", 1, ReduceOp.SUM, -1, src.dtype, src.shape)
    engine.all_reduce(1, xp, src, dst, ReduceOp.SUM, meta)
    np.testing.assert_array_equal(dst, 2 * np.arange(n, dtype=np.float32))
    np.testing.assert_array_equal(src, np.arange(n, dtype=np.float32))  # input untouched
    small = src.nbytes <= 64
    # small: one copy down, the host algorithm in place on it, one copy up;
    # large: the device buffers go to the engine as they are
    assert inner.seen == [("all_reduce", small, small)]
    assert (xp.down, xp.up) == ((1, 1) if small else (0, 0))


def test_host_engine_copies_a_host_reduced_result_up_only_at_the_root():
    inner, xp = _Inner(limit=1 << 20), _DeviceXp()
    engine = HostEngine(inner, None)  # type: ignore[arg-type]
    buf = np.ones(8, np.float64)
    meta = Meta("reduce", 1, ReduceOp.SUM, 0, buf.dtype, buf.shape)
    engine.reduce(1, xp, buf, None, 0, ReduceOp.SUM, meta)  # not the root
    assert inner.seen == [("reduce", True, True)] and (xp.down, xp.up) == (1, 0)
    engine.reduce(2, xp, buf, buf, 0, ReduceOp.SUM, meta)  # the root, in place
    assert inner.seen[-1] == ("reduce", True, False) and (xp.down, xp.up) == (2, 1)
    np.testing.assert_array_equal(buf, np.full(8, 2.0))


def test_host_engine_never_routes_host_buffers_or_a_group_of_one_through_copies():
    inner, xp = _Inner(limit=1 << 20), Xp()
    engine = HostEngine(inner, None)  # type: ignore[arg-type]
    buf = np.ones(4, np.float32)
    engine.all_reduce(
        1, xp, buf, buf, ReduceOp.SUM, Meta("all_reduce", 1, ReduceOp.SUM, -1, buf.dtype, buf.shape)
    )
    assert inner.seen == [("all_reduce", True, True)]
    assert not LocalOps().reduces_on_host(4)


def test_which_engines_reduce_device_buffers_on_the_host():
    from rpcdist.collectives import _ring_engine, _shm_algos

    def shm(size: int) -> Any:
        return _shm_algos.ShmEngine(types.SimpleNamespace(rank=0, size=size))  # type: ignore[arg-type]

    limit = _shm_algos.HOST_REDUCE_BYTES
    assert shm(2).reduces_on_host(limit) and not shm(2).reduces_on_host(limit + 1)
    assert shm(3).reduces_on_host(1 << 30)  # larger groups: every size
    ring = _ring_engine.RingEngine(types.SimpleNamespace(rank=0, size=2), "g/")  # type: ignore[arg-type]
    assert ring.reduces_on_host(4) and ring.reduces_on_host(1 << 40)  # every size
