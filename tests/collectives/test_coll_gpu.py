"""CuPy buffers: staged through host memory on the CPU engines, NCCL where usable.

Skipped without CuPy and a CUDA device; run on the GPU machine when one is lent.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gpu_support import cuda_devices, has_nccl, needs_gpu

from rpcdist.testing import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def cupy_worker(rank: int, world: int, init: str, backend: str, own_gpu: bool) -> None:
    import cupy

    from rpcdist import collectives as dist
    from rpcdist.collectives import ReduceOp
    from rpcdist.collectives._api import resolve

    if own_gpu:
        cupy.cuda.Device(rank).use()
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=60)
    try:
        # shared memory: 1,000 elements go through the host (HOST_REDUCE_BYTES);
        # 100,000 are staged piece by piece and reduced on the device in a
        # group of two and go through the host in larger groups; the ring
        # reduces both through the host
        for n, dtype in itertools.product(
            (1000, 100_000), ("float32", "float64", "int64", "complex64")
        ):
            x = cupy.arange(n, dtype=dtype) * (rank + 1)
            dist.all_reduce(x)
            expected = np.arange(n, dtype=dtype) * sum(range(1, world + 1))
            np.testing.assert_array_equal(cupy.asnumpy(x), expected)
        if backend == "shm" and not own_gpu:
            # only the staged path page-locks the slots (reduce_scatter below does too)
            assert resolve(None).engine.inner.seg.pinned == (world == 2)
        for n in (10, 100_000):
            y = cupy.full(n, rank + 1.0)
            dist.all_reduce(y, ReduceOp.AVG)
            assert bool((y == (world + 1) / 2).all())
            m = cupy.full(n, float(rank), "float32")
            into = cupy.zeros_like(m)
            dist.all_reduce(m, ReduceOp.MAX, out=into)
            assert bool((into == world - 1).all()) and bool((m == rank).all())
        z = cupy.full(5, rank, "int32")
        dist.all_reduce(z, ReduceOp.BXOR)  # not an NCCL op: falls back, staged
        b = cupy.full(7, rank, "float32")
        dist.broadcast(b, world - 1)
        assert bool((b == world - 1).all())
        outs = [cupy.empty(3, "float32") for _ in range(world)]
        dist.all_gather(outs, cupy.full(3, rank, "float32"))
        assert all(bool((o == q).all()) for q, o in enumerate(outs))
        rs = cupy.empty(4, "float32")
        dist.reduce_scatter(rs, [cupy.full(4, 1.0, "float32") for _ in range(world)])
        assert bool((rs == world).all())
        for n in (6, 100_000):
            red = cupy.full(n, 2.0)
            dist.reduce(red, 0, ReduceOp.PROD)
            assert bool((red == (2.0**world if rank == 0 else 2.0)).all())
        if own_gpu:  # every rank has its own GPU: the default group went through NCCL
            assert resolve(None).extra.get("nccl") is not None
        elif backend == "shm":  # CuPy copies go straight to page-locked slots
            assert resolve(None).engine.inner.seg.pinned
    finally:
        dist.destroy_process_group()


@needs_gpu
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("backend", "world"), [("shm", 2), ("ring", 2), ("shm", 3)])
def test_cupy_buffers_on_the_cpu_engines(backend, world):
    run_workers(cupy_worker, world, args=(backend, False), timeout=150)


@pytest.mark.skipif(cuda_devices() < 2, reason="needs two CUDA devices for NCCL")
@pytest.mark.timeout(180)
def test_cupy_buffers_through_nccl():
    run_workers(cupy_worker, 2, args=("nccl", True), timeout=150)


@pytest.mark.skipif(not has_nccl(), reason="needs CuPy with NCCL and a CUDA device")
def test_the_nccl_engine_drives_a_real_communicator_of_one_rank():
    """The calls into ``cupy.cuda.nccl`` (pointers, counts, datatypes, complex as
    float pairs, AVG's divide, the completion event), on a communicator of one
    rank: one GPU cannot hold two NCCL ranks. Outputs are separate buffers
    wherever the op allows, so a wrong count or pointer shows as garbage."""
    import asyncio
    from types import SimpleNamespace

    import cupy
    from cupy.cuda import nccl

    from rpcdist.collectives import ReduceOp
    from rpcdist.collectives._engine import NcclEngineOps
    from rpcdist.collectives._nccl import NcclEngine
    from rpcdist.collectives._ops import Meta, xp_for

    with cupy.cuda.Device(0):
        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        engine = NcclEngine(comm, nccl, cupy, 1, 0)
        group = SimpleNamespace(run_async=asyncio.run, timeout=30.0)
        ops = NcclEngineOps(engine, group, cupy.cuda.get_current_stream(), 0)
        try:
            for dtype, op in (
                ("float32", ReduceOp.SUM),
                ("float64", ReduceOp.AVG),
                ("int64", ReduceOp.MAX),
                ("complex64", ReduceOp.SUM),
                ("float16", ReduceOp.MIN),
            ):
                src = (cupy.arange(1001) - 500).astype(dtype)
                if dtype.startswith("complex"):
                    src = src + 1j * src[::-1]
                meta = Meta("all_reduce", 0, op, -1, dtype, src.shape)
                dst = cupy.full_like(src, 7)
                ops.all_reduce(0, xp_for(src), src, dst, op, meta)
                assert bool((dst == src).all()), (dtype, op)

                buf = src.copy()
                ops.broadcast(1, buf, 0, Meta("broadcast", 1, 0, 0, dtype, buf.shape))
                assert bool((buf == src).all()), dtype

                red = src.copy()
                ops.reduce(2, xp_for(red), red, red, 0, op, Meta("reduce", 2, op, 0, dtype, ()))
                assert bool((red == src).all()), (dtype, op)

                out = cupy.full_like(src, 7)
                ops.all_gather(3, src, [out], Meta("all_gather", 3, 0, -1, dtype, src.shape))
                assert bool((out == src).all()), dtype

                rs = cupy.full_like(src, 7)
                ops.reduce_scatter(
                    4, xp_for(src), [src], rs, op, Meta("reduce_scatter", 4, op, -1, dtype, ())
                )
                assert bool((rs == src).all()), (dtype, op)
        finally:
            engine.close()
