"""CuPy arrays between two processes on one GPU by CUDA IPC (needs CuPy and a
CUDA device; the logic is tested without one in ``test_cuda_ipc.py``)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from gpu_support import needs_gpu

import rpcdist
from rpcdist import RpcOptions
from rpcdist.testing import as_current, local_agents, run_workers

pytestmark = [pytest.mark.gpu, needs_gpu]


def echo(x: Any) -> Any:
    return x


def on_this_device(x: Any) -> tuple[int, float]:
    import cupy

    assert isinstance(x, cupy.ndarray)
    return x.device.id, float(x.sum())


def stats() -> dict[str, int]:
    return rpcdist.statistics()


def _cases() -> list[Any]:
    import cupy

    base = cupy.arange(1 << 20, dtype=cupy.float64)
    return [
        cupy.random.default_rng(0).standard_normal(1 << 20, dtype=cupy.float32),
        cupy.asfortranarray(base.reshape(512, 2048)),
        base.astype(cupy.int64)[::3],  # not contiguous
        (base[: 1 << 18] * (1 - 2j)).astype(cupy.complex64),
        base.astype(cupy.float16),
        base % 3 == 0,
        cupy.ones((0, 4096), cupy.float32),  # empty: the host path
    ]


def ipc_worker(rank: int, world: int, init: str, ipc: bool) -> dict[str, Any] | None:
    import cupy

    from rpcdist._device import _cuda_ipc

    _cuda_ipc.IDLE = 1.0  # type: ignore[misc]  # retire idle blocks within the test
    rpcdist.init_rpc(
        f"w{rank}", rank, world, init_method=init, rpc_timeout=60, options=RpcOptions(cuda_ipc=ipc)
    )
    try:
        if rank != 0:
            return None
        warm = cupy.ones(1 << 20, cupy.float32)
        # The first large array takes the host path while the probe runs.
        end = time.monotonic() + 20
        while time.monotonic() < end:
            assert bool((rpcdist.rpc_sync("w1", echo, args=(warm,)) == 1).all())
            s = rpcdist.statistics()
            if not ipc or (s["cuda_ipc_sent"] > 0 and s["cuda_ipc_received"] > 0):
                break
        before = rpcdist.statistics()["cuda_ipc_sent"]
        for x in _cases():
            back = rpcdist.rpc_sync("w1", echo, args=(x,))
            assert isinstance(back, cupy.ndarray)
            assert back.dtype == x.dtype and back.shape == x.shape, (back.dtype, x.dtype)
            assert bool((back == x).all())
            if x.flags.f_contiguous and not x.flags.c_contiguous:
                assert back.flags.f_contiguous
        # A snapshot is sent: the caller may change its array at once.
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        fut = rpcdist.rpc_async("w1", on_this_device, args=(x,))
        x[...] = 0
        device, total = fut.wait()
        assert device == 0 and total == float(np.arange(1 << 20, dtype=np.float64).sum())
        sent = rpcdist.statistics()["cuda_ipc_sent"] - before
        # Releases are control messages: wait until every lend is back.
        end = time.monotonic() + 20
        while time.monotonic() < end:
            mine, theirs = rpcdist.statistics(), rpcdist.rpc_sync("w1", stats)
            if mine["cuda_ipc_lends"] == 0 and theirs["cuda_ipc_lends"] == 0:
                break
        # Idle blocks are unmapped by the peer, then freed.
        end = time.monotonic() + 20
        while time.monotonic() < end:
            held = rpcdist.statistics()["cuda_ipc_block_bytes"]
            held += rpcdist.rpc_sync("w1", stats)["cuda_ipc_block_bytes"]
            if held == 0:
                break
        return {"sent": sent, "mine": mine, "theirs": theirs, "held": held}
    finally:
        rpcdist.shutdown()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("ipc", [True, False], ids=["ipc", "off"])
def test_cupy_arrays_cross_processes_by_handle(ipc: bool) -> None:
    out = run_workers(ipc_worker, 2, args=(ipc,), timeout=150)[0]
    mine, theirs = out["mine"], out["theirs"]
    assert mine["cuda_ipc_lends"] == 0 and theirs["cuda_ipc_lends"] == 0
    assert out["held"] == 0
    if ipc:
        assert mine["cuda_ipc_block_bytes"] > 0  # (before the blocks were retired)
        # Six of the seven cases and the snapshot go by handle, both ways
        # (the empty one is below the size limit).
        assert out["sent"] == 7 and theirs["cuda_ipc_received"] >= 7
        assert theirs["cuda_ipc_sent"] >= 6 and mine["cuda_ipc_received"] >= 6
    else:
        assert mine["cuda_ipc_sent"] == theirs["cuda_ipc_sent"] == 0


def test_agents_of_one_process_keep_the_host_path() -> None:
    import cupy

    with local_agents(2, options=RpcOptions(token=None)) as (a, b), as_current(a):
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        for _ in range(3):
            assert bool((rpcdist.rpc_sync("worker1", echo, args=(x,)) == x).all())
        ext = a.registry.extensions["cuda_ipc"]
        end = time.monotonic() + 10
        while ext._peers.get((1, 0)) is None and time.monotonic() < end:
            time.sleep(0.01)
        # CUDA refuses to map a process's own export: the probe says no.
        assert ext._peers[(1, 0)] is False and ext.sent == 0
        assert bool((rpcdist.rpc_sync("worker1", echo, args=(x,)) == x).all())
