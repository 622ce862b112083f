"""PyTorch's RPC pipeline program on rpcdist.torch: micro-batches pass between
shards as RRefs and one distributed backward crosses three processes (the
second shard fetches its input from the first with ``to_here`` inside the
context); the losses match PyTorch RPC's."""

from __future__ import annotations

import pipeline_prog
import pytest

from rpcdist.testing import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


@pytest.mark.timeout(240)
def test_pipeline_matches_pytorch_rpc():
    ours = run_workers(pipeline_prog.run, 3, args=("rpcdist",), timeout=100)[0]
    theirs = run_workers(pipeline_prog.run, 3, args=("torch",), timeout=100)[0]
    assert len(ours) == 4 and ours[-1] < ours[0]
    assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-6)
