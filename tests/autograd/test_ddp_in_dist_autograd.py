"""DDP inside a distributed-autograd backward: the reducer's all-reduces run
during ``rpcdist.autograd.backward``, the averages land in the context, and a
DistributedOptimizer steps them (the DDP + RPC hybrid)."""

from __future__ import annotations

import hybrid_workers as hw
import numpy as np
import pytest

from rpcdist.testing import run_workers

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(150)
def test_ddp_dense_part_and_remote_table_train_as_one_process_would():
    _, t1, t2 = run_workers(hw.run, 3, timeout=120)
    want = hw.oracle()
    for trainer, got in ((1, t1), (2, t2)):
        assert got["grad_left_alone"]  # the context, not .grad
        for g, w in zip(got["dense_grads"], want["dense_grads"]):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
        for k, v in want["dense"].items():
            np.testing.assert_allclose(got["dense"][k], v, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got["table"], want["table"][trainer], rtol=1e-10, atol=1e-12)
    for k in want["dense"]:  # the DDP replicas stayed identical
        np.testing.assert_array_equal(t1["dense"][k], t2["dense"][k])
