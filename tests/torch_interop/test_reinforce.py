"""PyTorch's batched REINFORCE program on rpcdist.torch: ``@async_execution``
batches observers' requests behind a Future; episodes match PyTorch RPC's."""

from __future__ import annotations

import pytest
import reinforce_prog

from rpcdist.testing import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


@pytest.mark.timeout(240)
def test_batched_reinforce_matches_pytorch_rpc():
    ours = run_workers(reinforce_prog.run, 3, args=("rpcdist",), timeout=100)[0]
    theirs = run_workers(reinforce_prog.run, 3, args=("torch",), timeout=100)[0]
    assert len(ours) == 6
    assert ours == pytest.approx(theirs)
