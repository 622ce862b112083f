"""PyTorch's batch-update parameter server on rpcdist.torch: a gloo process
group holds MASTER_PORT first, ``@async_execution`` returns a
``torch.futures.Future`` that other calls complete, and the server replies
with its ``nn.Module``; the losses match PyTorch RPC's exactly."""

from __future__ import annotations

import socket

import batch_ps_prog
import pytest

from rpcdist.testing import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


def _env() -> dict[str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@pytest.mark.timeout(240)
def test_batch_update_ps_matches_pytorch_rpc_beside_a_gloo_group():
    ours = run_workers(batch_ps_prog.run, 3, args=("rpcdist",), env=_env(), timeout=100)[0]
    theirs = run_workers(batch_ps_prog.run, 3, args=("torch",), env=_env(), timeout=100)[0]
    assert len(ours) == 2 and all(len(t) == batch_ps_prog.BATCHES for t in ours)
    for a, b in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert ours[0][0] != ours[0][-1]  # the model the server sent back changed
