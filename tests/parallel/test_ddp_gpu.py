"""DDP, hooks and ZeRO with CuPy parameters, against the CPU oracle.

Skipped without CuPy and a CUDA device. With one GPU the ranks share it and
the collectives stage through host memory; with one GPU per rank they use
NCCL.
"""

from __future__ import annotations

from typing import Any

import ddp_workers as dw
import numpy as np
import pytest
from gpu_support import cuda_devices, needs_gpu

from rpcdist import optim
from rpcdist.testing import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def gpu_cases(rank: int, world: int, init_method: str, own_gpu: bool) -> dict[str, Any]:
    import cupy

    import rpcdist.tensor as rt
    from rpcdist import collectives as dist
    from rpcdist.nn import functional as F
    from rpcdist.parallel import DistributedDataParallel as DDP
    from rpcdist.parallel import ZeroRedundancyOptimizer, comm_hooks

    if own_gpu:
        cupy.cuda.Device(rank).use()
    device = f"cuda:{rank if own_gpu else 0}"
    dw.init(rank, world, init_method)
    out: dict[str, Any] = {}

    def run(hook: Any = None, zero: bool = False, steps: int = 3) -> dict[str, np.ndarray]:
        model = DDP(dw.mlp(rank + 1).to(device))
        assert all(type(b.buffer()).__module__.startswith("cupy") for b in model.reducer.buckets)
        if hook is not None:
            model.register_comm_hook(*hook)
        o: Any = (
            ZeroRedundancyOptimizer(model.parameters(), optim.SGD, lr=0.1, momentum=0.9)
            if zero
            else optim.SGD(list(model.parameters()), lr=0.1, momentum=0.9)
        )
        for s in range(steps):
            o.zero_grad()
            x, y = dw.batch(s, rank)
            loss = F.cross_entropy(model(rt.tensor(x).to(device)), rt.tensor(y).to(device))
            loss.backward()
            o.step()
        return model.module.state_dict()

    out["plain"] = run()
    out["zero"] = run(zero=True)
    out["fp16"] = run((None, comm_hooks.fp16_compress_hook))
    out["bf16"] = run((None, comm_hooks.bf16_compress_hook))
    ps = comm_hooks.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=1)
    out["powersgd"] = run((ps, comm_hooks.powerSGD_hook))
    dist.destroy_process_group()
    return out


@needs_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("own_gpu", [False, True], ids=["shared-gpu", "gpu-per-rank"])
def test_ddp_on_cupy_parameters(own_gpu):
    world = 2
    if own_gpu and cuda_devices() < world:
        pytest.skip(f"needs {world} CUDA devices")
    results = run_workers(gpu_cases, world, args=(own_gpu,), timeout=280)
    want = dw.oracle(3, world)[0].state_dict()
    for key in ("plain", "zero", "fp16", "bf16", "powersgd"):
        for k in want:
            assert np.array_equal(results[0][key][k], results[1][key][k]), (key, k)
    for k in want:
        np.testing.assert_allclose(results[0]["plain"][k], want[k], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(results[0]["zero"][k], want[k], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(results[0]["fp16"][k], want[k], rtol=0, atol=2e-2)
        np.testing.assert_allclose(results[0]["bf16"][k], want[k], rtol=0, atol=2e-2)
