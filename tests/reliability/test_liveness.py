"""Pauses are not deaths; stopped peers are, on every layer, with one story.

Silence past ``peer_timeout`` only makes a peer suspect: on this host
``/proc`` gives a second opinion (a stopped process is lost, a running one
only paused), so a worker holding its GIL in native code survives, while a
SIGSTOPped one beside it is declared lost within 5 s. Every collective
backend learns of that verdict from the same detector and fails with
``CollectiveError`` naming the stopped rank; a shutdown with the store host
stopped ends promptly and names only it. Jobs take their ranks from the
launcher's environment, with the detector's default settings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import harness
import live_workers as lw
import pytest

import rpcdist
from rpcdist._rpc._liveness import REMOTE_FACTOR
from rpcdist._rpc._procview import STOPPED, process_state
from rpcdist.launch._hosting import free_port
from rpcdist.testing import local_agents

#: The default detector: a stopped same-host peer is declared lost within
#: ``peer_timeout`` plus two looks.
DEFAULTS = rpcdist.RpcOptions()
WINDOW = DEFAULTS.peer_timeout + 2 * DEFAULTS.heartbeat_interval
#: Room for a loaded 2-core machine (process scheduling, the op's own wake-up).
MARGIN = 1.5


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_gil_hold_is_a_pause_and_a_sigstop_beside_it_is_a_loss():
    res = harness.run_job(lw.gil_and_sigstop, 3, (free_port(),), timeout=90, expect={0, 1})
    assert not res.errors, res.errors
    v0, v1 = res.values[0], res.values[1]
    assert v0["w2"] == "WorkerLostError", v0
    assert "'w2'" in v0["w2_message"] and "stopped" in v0["w2_message"], v0["w2_message"]
    assert v0["detected_s"] < 5.0, v0["detected_s"]
    held = v0["held"]
    assert held[0] >= 2.4 and held[1] >= 3.9, held  # the GIL was held that long
    assert v0["after"] == 4 and v1["after"] == 4
    assert v0["lost"] == ["w2"] and v1["lost"] == ["w2"], (v0, v1)
    assert res.exitcodes[2] == -9  # the stopped one: killed by the harness


WAYS = ["shm", "ring-unix", "ring-tcp", "ring-rpc", "ring-grpc"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("way", WAYS)
def test_a_sigstopped_rank_fails_a_blocked_all_reduce_on_every_backend(way):
    res = harness.run_job(lw.sigstop_collective, 3, (free_port(), way), timeout=90, expect={0, 1})
    assert not res.errors, res.errors
    stopped = res.values[0]["stopped_at"]
    assert stopped is not None
    for rank in (0, 1):
        v = res.values[rank]
        assert v["backend"] == ("shm" if way == "shm" else "ring"), v
        assert v["error"] == "CollectiveError", v
        assert "lost rank 2" in v["message"] and "(rank 2) was lost" in v["message"], v["message"]
        # (time.monotonic is one clock for every process of the host)
        assert v["failed_at"] - stopped < WINDOW + MARGIN, (rank, v["failed_at"] - stopped)
    assert res.exitcodes[2] == -9


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("way", ["ring-rpc", "ring-grpc"])
def test_a_member_that_exits_after_a_loss_tells_the_others_its_cause(way):
    # Rank 1 sees the stopped rank 2 lost after 3 s and its process ends at
    # once, its notice to rank 0 held up half a second (a busy machine);
    # rank 0 would take 20 s, so it first hears of the loss from rank 1, or
    # sees rank 1 leave, which the notice must come before.
    windows = (20.0, WINDOW, WINDOW)
    res = harness.run_job(
        lw.sigstop_collective, 3, (free_port(), way, windows, 0.5), timeout=90, expect={0, 1}
    )
    assert not res.errors, res.errors
    assert "lost rank 2" in res.values[1]["message"], res.values[1]
    v = res.values[0]
    assert v["error"] == "CollectiveError", v
    assert "failed on rank 1" in v["message"] and "lost rank 2" in v["message"], v["message"]
    assert "(rank 1)" not in v["message"], v["message"]
    assert v["failed_at"] - v["stopped_at"] < WINDOW + MARGIN, v["failed_at"] - v["stopped_at"]
    assert res.exitcodes[1] == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_shutdown_with_the_store_host_stopped_ends_promptly_naming_it_only():
    res = harness.run_job(lw.store_host_stopped, 3, (free_port(),), timeout=90, expect={1, 2})
    assert not res.errors, res.errors
    for rank in (1, 2):
        v = res.values[rank]
        assert v["lost"] == ["w0"], (rank, v)
        assert v["shutdown_s"] < WINDOW + 2.0, (rank, v["shutdown_s"])
    assert res.exitcodes[0] == -9


def test_the_second_opinion_tells_a_stopped_process_from_a_paused_one():
    """The verdict on a silent same-host peer, with a real process as its
    stand-in: running, it is paused (up to ``pause_timeout``); stopped, it is
    lost once suspected; gone, at once. Without a view, the remote window."""
    opts = rpcdist.RpcOptions(
        token=None, heartbeat_interval=0.1, peer_timeout=1.0, pause_timeout=20.0
    )
    proc = subprocess.Popen(["sleep", "60"])
    try:
        with local_agents(2, options=opts) as (a, _b):
            lv = a.liveness
            assert lv.judge(1, 30.0) is not None  # in-process: no view, the remote window
            assert lv.window(1) == REMOTE_FACTOR * 1.0
            lv._pids[1] = proc.pid  # as a peer on this host
            assert lv.judge(1, 0.5) is None  # not even suspected
            assert lv.judge(1, 19.0) is None  # it runs (sleeps): a pause
            assert "runs" in lv.judge(1, 20.0)  # past pause_timeout: hung
            os.kill(proc.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10  # (the signal is delivered asynchronously)
            while process_state(proc.pid) != STOPPED and time.monotonic() < deadline:
                time.sleep(0.005)
            assert lv.judge(1, 0.5) is None
            assert "is stopped" in lv.judge(1, 1.0)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            assert "has exited" in lv.judge(1, 0.0)
    finally:
        proc.kill()
        proc.wait(10)


def test_options_check_pause_timeout():
    with pytest.raises(rpcdist.ConfigError, match="pause_timeout"):
        rpcdist.RpcOptions(peer_timeout=3.0, pause_timeout=2.0).validated()
    assert rpcdist.RpcOptions(peer_timeout=None, pause_timeout=1.0).validated()
