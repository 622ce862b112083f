"""PyTorch's distributed RNN program (embedding and decoder on a parameter
server, LSTM on the trainer) learns the same under rpcdist.torch as under
PyTorch RPC: the same seeds give the same loss at every step."""

from __future__ import annotations

import pytest
import rnn_prog

from rpcdist.testing import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


@pytest.mark.timeout(240)
def test_rnn_loss_trajectory_matches_pytorch_rpc():
    _, ours = run_workers(rnn_prog.run, 2, args=("rpcdist", 2), timeout=100)
    _, theirs = run_workers(rnn_prog.run, 2, args=("torch", 2), timeout=100)
    assert len(ours) == len(theirs) == 10
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    assert len(set(ours)) > 1  # it trained: the loss moved
