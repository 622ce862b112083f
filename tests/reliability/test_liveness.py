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

import socket

import harness
import live_workers as lw
import pytest

import rpcdist

#: The default detector: a stopped same-host peer is declared lost within
#: ``peer_timeout`` plus two looks.
DEFAULTS = rpcdist.RpcOptions()
WINDOW = DEFAULTS.peer_timeout + 2 * DEFAULTS.heartbeat_interval
#: Room for a loaded 2-core machine (process scheduling, the op's own wake-up).
MARGIN = 1.5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_gil_hold_is_a_pause_and_a_sigstop_beside_it_is_a_loss():
    res = harness.run_job(lw.gil_and_sigstop, 3, (_port(),), timeout=90, expect={0, 1})
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
    res = harness.run_job(lw.sigstop_collective, 3, (_port(), way), timeout=90, expect={0, 1})
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
def test_shutdown_with_the_store_host_stopped_ends_promptly_naming_it_only():
    res = harness.run_job(lw.store_host_stopped, 3, (_port(),), timeout=90, expect={1, 2})
    assert not res.errors, res.errors
    for rank in (1, 2):
        v = res.values[rank]
        assert v["lost"] == ["w0"], (rank, v)
        assert v["shutdown_s"] < WINDOW + 2.0, (rank, v["shutdown_s"])
    assert res.exitcodes[0] == -9
