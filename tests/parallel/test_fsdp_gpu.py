"""FullyShardedDataParallel with CuPy parameters, against the CPU oracle.

Skipped without CuPy and a CUDA device (the ranks share one GPU; the
collectives stage CuPy buffers through host memory).
"""

from __future__ import annotations

from typing import Any

import ddp_workers as dw
import fsdp_workers as fw
import numpy as np
import pytest
from gpu_support import needs_gpu

from rpcdist.testing import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def gpu_cases(rank: int, world: int, init_method: str) -> dict[str, Any]:
    import rpcdist.tensor as rt
    from rpcdist import collectives as dist
    from rpcdist.nn import functional as F
    from rpcdist.parallel import FullyShardedDataParallel as FSDP

    dw.init(rank, world, init_method)
    out: dict[str, Any] = {}
    for strategy in fw.STRATEGIES:
        for mp in (None, "bfloat16"):
            model = FSDP(
                dw.mlp(rank + 1).to("cuda:0"),
                auto_wrap_policy=fw.LINEARS,
                sharding_strategy=strategy,
                mixed_precision=mp,
            )
            assert all(u.on_gpu for u in model._shared.units)
            o = fw.OPTS["adam"](list(model.parameters()))
            for s in range(3):
                o.zero_grad()
                x, y = dw.batch(s, rank)
                xt, yt = rt.tensor(x).to("cuda:0"), rt.tensor(y).to("cuda:0")
                F.cross_entropy(model(xt), yt).backward()
                o.step()
            full = model.state_dict(rank0_only=False)
            out[f"{strategy}_{mp}"] = full
            again = FSDP(
                dw.mlp(9).to("cuda:0"), auto_wrap_policy=fw.LINEARS, sharding_strategy=strategy
            )
            again.load_state_dict(model.state_dict("sharded"))
            out[f"{strategy}_{mp}_sharded"] = again.state_dict(rank0_only=False)
    dist.destroy_process_group()
    return out


@needs_gpu
@pytest.mark.timeout(300)
def test_fsdp_on_cupy_parameters():
    results = run_workers(gpu_cases, 2, timeout=280)
    want = dw.oracle(3, 2, opt=fw.OPTS["adam"])[0].state_dict()
    for strategy in fw.STRATEGIES:
        for mp, tol in ((None, 1e-10), ("bfloat16", 3e-2)):
            key = f"{strategy}_{mp}"
            for k in want:
                assert np.array_equal(results[0][key][k], results[1][key][k]), (key, k)
                np.testing.assert_allclose(results[0][key][k], want[k], rtol=tol, atol=tol)
                np.testing.assert_array_equal(results[0][f"{key}_sharded"][k], results[0][key][k])
