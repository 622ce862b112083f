"""PyTorch's RPC parameter server program on rpcdist.torch: the model lives on
the server, trainers train it through one distributed backward per batch."""

from __future__ import annotations

import ps_prog
import pytest

from rpcdist.testing import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


@pytest.mark.timeout(240)
def test_one_trainer_learns_exactly_as_under_pytorch_rpc():
    _, ours = run_workers(ps_prog.run, 2, args=("rpcdist", 12), timeout=100)
    _, theirs = run_workers(ps_prog.run, 2, args=("torch", 12), timeout=100)
    assert ours["grads_seen"] == theirs["grads_seen"] == [8] * 12  # every server parameter
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.timeout(150)
def test_two_trainers_share_the_server_and_the_loss_falls():
    _, t1, t2 = run_workers(ps_prog.run, 3, args=("rpcdist", 30), timeout=120)
    for got in (t1, t2):
        assert got["grads_seen"] == [8] * 30
        first, last = sum(got["losses"][:5]) / 5, sum(got["losses"][-5:]) / 5
        assert last < 0.9 * first, got["losses"]
