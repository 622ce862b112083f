"""The message-passing algorithms (the gRPC engine) over an in-memory fake transport.

Every rank is a coroutine on one event loop; messages go through real
``Mailbox`` objects, delivered after random delays (so out of order), which
exercises the same code the gRPC path runs, quickly and for many shapes.
"""

from __future__ import annotations

import asyncio
import functools
import random

import numpy as np
import pytest
from coll_workers import DTYPES, UFUNC  # one oracle table for all collective tests
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcdist import CollectiveError
from rpcdist._rpc._p2p import Mailbox
from rpcdist._transport._frames import P2P, InMessage
from rpcdist.collectives import ReduceOp
from rpcdist.collectives._ops import Meta, xp_for
from rpcdist.collectives._ring_engine import RingEngine


class FakeLink:
    def __init__(self, rank: int, boxes: list[Mailbox], rng: random.Random) -> None:
        self.rank, self.size, self._boxes, self._rng = rank, len(boxes), boxes, rng

    def send(self, dst, key, data, header):
        msg = InMessage(0, P2P, key, header, [memoryview(bytearray(data))], 0)
        loop = asyncio.get_running_loop()
        loop.call_later(self._rng.random() * 1e-4, self._boxes[dst].deliver, self.rank, msg)
        fut = loop.create_future()
        fut.set_result(None)
        return fut

    def post(self, src, key, out):
        return self._boxes[self.rank].post(src, key, out)


def engines(p: int, chunk: int, seed: int = 0, small: int = 0) -> list[RingEngine]:
    """Engines over one fake network; ``small``: the recursive-doubling limit in bytes."""
    boxes = [Mailbox() for _ in range(p)]
    rng = random.Random(seed)
    return [RingEngine(FakeLink(r, boxes, rng), "t/", chunk, small) for r in range(p)]


def inputs(p: int, n: int, dtype: str, op: ReduceOp, seed: int) -> list[np.ndarray]:
    """Values whose reduction is exact in any order (the oracle is NumPy's)."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return [rng.integers(0, 2, n).astype(bool) for _ in range(p)]
    if op is ReduceOp.PROD:
        return [
            rng.choice([-2, -1, 1, 2] if np.dtype(dtype).kind != "u" else [1, 2], n).astype(dtype)
            for _ in range(p)
        ]
    return [rng.integers(0, 8, n).astype(dtype) for _ in range(p)]


def oracle(xs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    out = functools.reduce(lambda a, b: UFUNC[op](a, b), xs)
    if op is ReduceOp.AVG:
        out = out / np.array(len(xs), out.dtype)
    return out.astype(xs[0].dtype)


def ops_for(dtype: str) -> list[ReduceOp]:
    kind = np.dtype(dtype).kind
    ops = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
    if kind in "fc":
        ops.append(ReduceOp.AVG)
    if kind in "biu":
        ops += [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    if kind == "c":
        ops = [o for o in ops if o not in (ReduceOp.MIN, ReduceOp.MAX)]
    return ops


case = st.tuples(
    st.integers(2, 6),
    st.integers(0, 200),
    st.sampled_from(DTYPES),
    st.integers(16, 256),
    st.integers(0, 999),
).flatmap(lambda t: st.tuples(*map(st.just, t), st.sampled_from(ops_for(t[2]))))


@given(case, st.booleans(), st.booleans())
@settings(max_examples=150, deadline=None)
def test_ring_all_reduce_and_reduce_scatter_match_numpy(params, in_place, doubling):
    p, n, dtype, chunk, seed, op = params
    xs = inputs(p, n, dtype, op, seed)
    expected = oracle(xs, op)
    engs = engines(p, chunk, seed, small=1 << 20 if doubling else 0)
    outs = [x.copy() if in_place else np.full_like(x, 3) for x in xs]
    srcs = [o if in_place else x.copy() for o, x in zip(outs, xs)]

    async def go() -> None:
        meta = Meta("all_reduce", 0, op, -1, dtype, (n,))
        await asyncio.gather(
            *(e.all_reduce(0, xp_for(s), s, o, op, meta) for e, s, o in zip(engs, srcs, outs))
        )
        sizes = [(n + q) % 5 for q in range(p)]
        pieces = [inputs(p, s, dtype, op, seed + 1 + s) for s in sizes]  # pieces[q][r]
        rs_out = [np.empty(sizes[r], dtype) for r in range(p)]
        meta = Meta("reduce_scatter", 1, op, -1, dtype, sizes)
        await asyncio.gather(
            *(
                e.reduce_scatter(
                    1, xp_for(rs_out[r]), [pieces[q][r] for q in range(p)], rs_out[r], op, meta
                )
                for r, e in enumerate(engs)
            )
        )
        for r in range(p):
            np.testing.assert_array_equal(rs_out[r], oracle(pieces[r], op))

    asyncio.run(go())
    for o in outs:
        np.testing.assert_array_equal(o, expected)
    if not in_place:
        for s, x in zip(srcs, xs):
            np.testing.assert_array_equal(s, x)


@given(st.integers(2, 6), st.integers(0, 300), st.integers(16, 200), st.integers(0, 999))
@settings(max_examples=60, deadline=None)
def test_rooted_and_gathering_collectives_match_numpy(p, n, chunk, seed):
    rng = np.random.default_rng(seed)
    big = n * 100 if seed % 3 == 0 else n  # large messages take the chain path
    engs = engines(p, max(chunk, big * 8 // 8), seed)
    root = seed % p

    async def go() -> None:
        # broadcast
        data = rng.integers(0, 100, big).astype("f8")
        bufs = [data.copy() if r == root else np.zeros(big) for r in range(p)]
        meta = Meta("broadcast", 0, 0, root, "f8", (big,))
        await asyncio.gather(*(e.broadcast(0, b, root, meta) for e, b in zip(engs, bufs)))
        for b in bufs:
            np.testing.assert_array_equal(b, data)
        # reduce (non-roots' buffers untouched)
        xs = [rng.integers(0, 9, big).astype("i8") for _ in range(p)]
        srcs = [x.copy() for x in xs]
        meta = Meta("reduce", 1, ReduceOp.SUM, root, "i8", (big,))
        await asyncio.gather(
            *(
                e.reduce(1, xp_for(s), s, s if r == root else None, root, ReduceOp.SUM, meta)
                for r, (e, s) in enumerate(zip(engs, srcs))
            )
        )
        for r in range(p):
            np.testing.assert_array_equal(srcs[r], sum(xs) if r == root else xs[r])
        # all_gather-v with empty pieces
        sizes = [(n * (q + 1)) % 7 for q in range(p)]
        mine = [rng.integers(0, 9, sizes[r]).astype("i4") for r in range(p)]
        outs = [[np.empty(s, "i4") for s in sizes] for _ in range(p)]
        meta = Meta("all_gather", 2, 0, -1, "i4", sizes)
        await asyncio.gather(*(e.all_gather(2, m, o, meta) for e, m, o in zip(engs, mine, outs)))
        for o in outs:
            for q in range(p):
                np.testing.assert_array_equal(o[q], mine[q])
        # gather / scatter
        gl = [np.empty(s, "i4") for s in sizes]
        meta = Meta("gather", 3, 0, root, "i4", ())
        await asyncio.gather(
            *(
                e.gather(3, mine[r], gl if r == root else None, root, meta)
                for r, e in enumerate(engs)
            )
        )
        for q in range(p):
            np.testing.assert_array_equal(gl[q], mine[q])
        got = [np.empty(s, "i4") for s in sizes]
        meta = Meta("scatter", 4, 0, root, "i4", ())
        await asyncio.gather(
            *(
                e.scatter(4, got[r], mine if r == root else None, root, meta)
                for r, e in enumerate(engs)
            )
        )
        for q in range(p):
            np.testing.assert_array_equal(got[q], mine[q])
        # all_to_all with unequal splits: rank r sends r+q+n%3 items to q
        ins = [[np.full((r + q + n) % 4, 10 * r + q, "i8") for q in range(p)] for r in range(p)]
        outs2 = [[np.empty((q + r + n) % 4, "i8") for q in range(p)] for r in range(p)]
        meta = Meta("all_to_all", 5, 0, -1, "i8", ())
        await asyncio.gather(*(e.all_to_all(5, outs2[r], ins[r], meta) for r, e in enumerate(engs)))
        for r in range(p):
            for q in range(p):
                np.testing.assert_array_equal(outs2[r][q], ins[q][r])
        await asyncio.gather(*(e.barrier(6, Meta("barrier", 6, 0, -1, "u1", ())) for e in engs))

    asyncio.run(go())


def test_a_mismatched_rank_is_found_by_its_neighbours():
    p = 3
    engs = engines(p, 8)

    async def one(r: int) -> None:
        dtype = "f8" if r == 2 else "f4"
        x = np.ones(10, dtype)
        meta = Meta("all_reduce", 0, ReduceOp.SUM, -1, dtype, (10,))
        await asyncio.wait_for(engs[r].all_reduce(0, xp_for(x), x, x, ReduceOp.SUM, meta), 0.5)

    async def go() -> list[object]:
        return await asyncio.gather(*(one(r) for r in range(p)), return_exceptions=True)

    results = asyncio.run(go())
    # Ranks next to the odd one out see it; the other one is stuck (the agent's
    # abort or the timeout ends it in real runs).
    assert isinstance(results[0], CollectiveError) and "rank 2" in str(results[0])
    assert isinstance(results[2], CollectiveError)


@pytest.mark.parametrize("p", [2, 5])
def test_empty_and_single_element_buffers(p):
    engs = engines(p, 4)
    for n in (0, 1, p - 1):
        xs = [np.arange(n, dtype="i8") + r for r in range(p)]

        async def go(xs=xs, n=n) -> None:
            meta = Meta("all_reduce", n, ReduceOp.SUM, -1, "i8", (n,))
            await asyncio.gather(
                *(e.all_reduce(n, xp_for(x), x, x, ReduceOp.SUM, meta) for e, x in zip(engs, xs))
            )

        expected = sum(np.arange(n, dtype="i8") + r for r in range(p))
        asyncio.run(go())
        for x in xs:
            np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("p", [2, 3, 5, 6])
@pytest.mark.parametrize("small", [0, 1 << 20])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG])
def test_every_rank_gets_bitwise_the_same_inexact_result(p, small, op):
    rng = np.random.default_rng(p)
    xs = [rng.standard_normal(333).astype("f4") for _ in range(p)]
    for x in xs:  # signed zeros: MIN/MAX return whichever comes first
        x[:4] = [0.0, -0.0, 0.0, -0.0] if rng.random() < 0.5 else [-0.0, 0.0, -0.0, 0.0]
    engs = engines(p, 64, p, small)

    async def go() -> None:
        meta = Meta("all_reduce", 0, op, -1, "f4", (333,))
        await asyncio.gather(
            *(e.all_reduce(0, xp_for(x), x, x, op, meta) for e, x in zip(engs, xs))
        )

    asyncio.run(go())
    assert len({x.tobytes() for x in xs}) == 1
