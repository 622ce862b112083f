"""Worker entry points for the multi-process collective tests (importable by spawned children).

Each function batches many checks into one process launch. Inputs are
derived from a seed, the case and the rank, so every rank can compute the
exact NumPy oracle for everyone's inputs.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time

import numpy as np

import rpcdist
from rpcdist import collectives as dist
from rpcdist.collectives import ReduceOp

UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
DTYPES = ["int32", "int64", "uint8", "float32", "float64", "float16", "complex64", "bool"]


def ops_for(dtype: str) -> list[ReduceOp]:
    kind = np.dtype(dtype).kind
    ops = [ReduceOp.SUM, ReduceOp.PROD]
    if kind != "c":
        ops += [ReduceOp.MIN, ReduceOp.MAX]
    if kind in "fc":
        ops.append(ReduceOp.AVG)
    if kind in "biu":
        ops += [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    return ops


def make_input(seed: int, case: int, rank: int, n: int, dtype: str, op: ReduceOp) -> np.ndarray:
    """Values whose reduction is exact whatever the order."""
    rng = np.random.default_rng([seed, case, rank])
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if op is ReduceOp.PROD:
        vals = [1, 2] if np.dtype(dtype).kind == "u" else [-2, -1, 1, 2]
        return rng.choice(vals, n).astype(dtype)
    return rng.integers(0, 8, n).astype(dtype)


def oracle(xs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    out = functools.reduce(lambda a, b: UFUNC[op](a, b), xs)
    if op is ReduceOp.AVG:
        out = out / np.array(len(xs), out.dtype)
    return out.astype(xs[0].dtype)


def _init(rank: int, world: int, init: str, timeout: float = 60) -> dist.ProcessGroup:
    dist.init_process_group("auto", init_method=init, rank=rank, world_size=world, timeout=timeout)
    return dist.new_group(range(world), backend="grpc")  # the ring's former name


def allreduce_matrix(rank: int, world: int, init: str, seed: int, n_random: int) -> dict:
    """all_reduce on the default (shared-memory) group and a gRPC group over every rank."""
    grpc_group = _init(rank, world, init)
    checked = 0
    digests = []
    try:
        assert dist.get_backend() == "shm" and dist.get_backend(grpc_group) == "ring"
        for name, group in (("shm", None), ("ring", grpc_group)):
            sizes = [0, 1, max(world - 1, 0), 7 * world + 3]
            cases = [(n, d, op) for n in sizes for d in DTYPES for op in ops_for(d)]
            cases += [
                (100_003, "float32", ReduceOp.SUM),
                (100_003, "int64", ReduceOp.BXOR),
                (100_003, "float64", ReduceOp.AVG),
                (100_003, "uint8", ReduceOp.MIN),
            ]
            rng = np.random.default_rng(seed)
            for _ in range(n_random):
                d = DTYPES[rng.integers(len(DTYPES))]
                ops = ops_for(d)
                cases.append((int(rng.integers(0, 5000)), d, ops[rng.integers(len(ops))]))
            cases += [(1 << 20, "float32", ReduceOp.SUM), ((1 << 20) + 5, "int64", ReduceOp.MAX)]
            for case, (n, d, op) in enumerate(cases):
                xs = [make_input(seed, case, r, n, d, op) for r in range(world)]
                expected = oracle(xs, op)
                mine = xs[rank].copy()
                if case % 3 == 0:
                    out = np.empty_like(mine)
                    dist.all_reduce(mine, op, group=group, out=out)
                    np.testing.assert_array_equal(mine, xs[rank])
                else:
                    out = mine
                    dist.all_reduce(out, op, group=group)
                np.testing.assert_array_equal(out, expected, err_msg=f"{name} {n} {d} {op!r}")
                checked += 1
            # Twice in a row on fresh buffers, inexact floats: bitwise identical,
            # on every rank (the digests are compared by the test).
            rng = np.random.default_rng([seed, rank])
            base = rng.standard_normal(12_345).astype("f4")
            a, b = base.copy(), base.copy()
            dist.all_reduce(a, group=group)
            dist.all_reduce(b, group=group)
            assert a.tobytes() == b.tobytes()
            digests.append(hashlib.sha1(a.tobytes()).hexdigest())
        stats = rpcdist.collectives._api.state().agent.statistics()
        return {"checked": checked, "digests": digests, "stats": stats}
    finally:
        dist.destroy_process_group()


def everything_else(rank: int, world: int, init: str) -> dict:
    """Every other collective on both backends, ordering, barrier, send/recv, cleanup."""
    grpc_group = _init(rank, world, init)
    st = rpcdist.collectives._api.state()
    dist.barrier()  # every rank finished setting up (and unlinking) its segments
    shm_files = sorted(f for f in os.listdir("/dev/shm") if st.job in f)
    out: dict = {"shm_files_while_running": shm_files}
    try:
        for name, group in (("shm", None), ("ring", grpc_group)):
            p = dist.get_world_size(group)
            for root in range(p):
                for n in (0, 5, 300_001):
                    b = np.arange(n, dtype="f8") if rank == root else np.zeros(n)
                    dist.broadcast(b, root, group=group)
                    np.testing.assert_array_equal(b, np.arange(n, dtype="f8"))
                red = np.full(1000, rank + 1, "i8")
                dist.reduce(red, root, group=group)
                np.testing.assert_array_equal(red, p * (p + 1) // 2 if rank == root else rank + 1)
                gl = [np.empty((q, 3), "i4") for q in range(p)] if rank == root else None
                dist.gather(np.full((rank, 3), rank, "i4"), gl, root, group=group)
                if rank == root:
                    assert all((gl[q] == q).all() and gl[q].shape == (q, 3) for q in range(p))
                sc = np.empty(2 * rank)
                sl = [np.full(2 * q, q + 0.5) for q in range(p)] if rank == root else None
                dist.scatter(sc, sl, root, group=group)
                np.testing.assert_array_equal(sc, np.full(2 * rank, rank + 0.5))
            sizes = [0, 3, 200_000][:p] + [7] * max(0, p - 3)
            outs = [np.empty(s, "i2") for s in sizes]
            src = np.arange(2 * sizes[rank], dtype="i2")[::2]  # not contiguous
            dist.all_gather(outs, src, group=group)
            for q, o in enumerate(outs):
                np.testing.assert_array_equal(o, np.arange(2 * sizes[q], dtype="i2")[::2])
            rs = np.empty(sizes[rank], "f4")
            dist.reduce_scatter(
                rs, [np.full(s, rank + 1.0, "f4") for s in sizes], ReduceOp.MAX, group=group
            )
            assert (rs == p).all()
            a2a = [np.empty(rank * 10 + q, "u1") for q in range(p)]
            dist.all_to_all(
                a2a, [np.full(q * 10 + rank, rank, "u1") for q in range(p)], group=group
            )
            assert all((a2a[q] == q).all() for q in range(p))
            # A barrier really waits for the slowest rank.
            if rank == 0:
                time.sleep(0.5)
            t = time.monotonic()
            dist.barrier(group=group)
            out[f"{name}_barrier_wait"] = time.monotonic() - t
            # 1000 queued async all_reduces, each right; a barrier implies they are done.
            bufs = [np.full(3, float(rank + k)) for k in range(1000)]
            works = [dist.all_reduce(x, group=group, async_op=True) for x in bufs]
            dist.barrier(group=group)
            assert all(w.is_completed() for w in works)
            for k, x in enumerate(bufs):
                assert (x == p * k + p * (p - 1) / 2).all(), (name, k, x)
        # Point-to-point, matched by source and tag (not by order).
        right, left = (rank + 1) % world, (rank - 1) % world
        ws = [dist.isend(np.full(4, rank * 10 + t, "i8"), right, tag=t) for t in (1, 2)]
        got2, got1 = np.empty(4, "i8"), np.empty(4, "i8")
        assert dist.recv(got2, left, tag=2) == left
        dist.irecv(got1, left, tag=1).wait()
        for w in ws:
            w.wait()
        assert (got1 == left * 10 + 1).all() and (got2 == left * 10 + 2).all()
        out["stats"] = st.agent.statistics()
        return out
    finally:
        job = st.job
        dist.destroy_process_group()
        out["shm_files_after"] = sorted(f for f in os.listdir("/dev/shm") if job in f)


def failures(rank: int, world: int, init: str) -> dict:
    """Mismatches on both backends, then a rank killed in the middle of each."""
    assert world == 4
    dist.init_process_group("auto", init_method=init, rank=rank, world_size=world, timeout=30)
    groups = {"shm": dist.new_group(range(3)), "ring": dist.new_group(range(3), backend="ring")}
    out: dict = {}
    for name, g in groups.items():
        if rank == 3:
            continue
        errors = []
        for call in (
            lambda g=g: dist.all_reduce(np.ones(8, "f8" if rank == 2 else "f4"), group=g),
            lambda g=g: dist.all_reduce(np.ones(8), group=g),
        ):
            try:
                call()
                errors.append("no error")
            except rpcdist.CollectiveError as e:
                errors.append(str(e))
        out[f"{name}_mismatch"] = errors
    # Kill: rank 3 dies in a shared-memory all_reduce, rank 2 in a gRPC one.
    kill = {
        "shm": (dist.new_group([0, 1, 3]), 3),
        "ring": (dist.new_group([0, 1, 2], backend="ring"), 2),
    }
    big = np.ones(4 << 20, "f4")
    for name, (g, victim) in kill.items():
        if rank == victim:
            dist.all_reduce(big, group=g, async_op=True)
            time.sleep(0.05)
            os._exit(17)
        if rank in g.ranks:
            t = time.monotonic()
            try:
                for _ in range(100):
                    dist.all_reduce(big, group=g)
                out[f"{name}_kill"] = ("no error", 0.0)
            except (rpcdist.CollectiveError, rpcdist.RpcTimeoutError) as e:
                out[f"{name}_kill"] = (type(e).__name__ + ": " + str(e), time.monotonic() - t)
    dist.destroy_process_group()
    return out


def init_orders(rank: int, world: int, init: str) -> list:
    """init_rpc then init_process_group, and the other way round; one transport each time."""
    import rpc_funcs as rf

    out = []
    rpcdist.init_rpc(f"w{rank}", rank, world, init_method=init)
    dist.init_process_group(init_method=init)
    peer = (rank + 1) % world
    for k in range(3):
        x = np.full(10, float(k + rank))
        w = dist.all_reduce(x, async_op=True)
        out.append(rpcdist.rpc_sync(f"w{peer}", rf.add, args=(k, rank)))
        w.wait()
        out.append(float(x[0]))
    agent = rpcdist.collectives._api.state().agent
    dist.destroy_process_group()
    assert not agent.closed and not dist.is_initialized()
    out.append(rpcdist.rpc_sync(f"w{peer}", rf.add, args=(1, 1)))
    rpcdist.shutdown()
    return out


def init_pg_then_rpc(rank: int, world: int, init: str) -> list:
    import rpc_funcs as rf

    dist.init_process_group(init_method=init, rank=rank, world_size=world)
    rpcdist.init_rpc(f"v{rank}", rank, world)
    out = [rpcdist.rpc_sync(f"v{(rank + 1) % world}", rf.add, args=(rank, 1))]
    x = np.full(4, float(rank))
    dist.all_reduce(x)
    out.append(float(x[0]))
    rpcdist.shutdown()
    dist.barrier()  # the agent stays while the process group needs it
    dist.destroy_process_group()
    return out


def eight(rank: int, world: int, init: str) -> list:
    """A cheap run at p=8 on both backends."""
    grpc_group = _init(rank, world, init)
    sums = []
    for group in (None, grpc_group):
        for n in (0, 3, 1001):
            x = np.full(n, rank + 1, "i8")
            dist.all_reduce(x, group=group)
            sums.append(int(x.sum()))
        b = np.full(5, rank, "i4")
        dist.broadcast(b, 7, group=group)
        sums.append(int(b.sum()))
        dist.barrier(group=group)
    dist.destroy_process_group()
    return sums
