"""One launcher, one node: children, failures, restarts, signals and reaping.

Each test runs ``python -m rpcdist.launch`` as a subprocess in its own
session on the tiny scripts in ``scripts/``; the ``launchers`` fixture kills
whatever is left and fails the test if any process it started survived.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import pytest
from launch_util import CHILD, SCRIPTS, TRAIN, alive, read_pid, read_starts, running, train_module

import rpcdist
from rpcdist.launch import launch, parse_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


def test_three_children_get_their_environment(tmp_path, launchers):
    rc, out = launchers.run("--nproc-per-node", "3", CHILD, "env", str(tmp_path), "--flag", "x")
    assert rc == 0, out
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["RANK"] for r in records] == ["0", "1", "2"]
    assert [r["LOCAL_RANK"] for r in records] == ["0", "1", "2"]
    assert {r["WORLD_SIZE"] for r in records} == {"3"}
    assert {r["LOCAL_WORLD_SIZE"] for r in records} == {"3"}
    assert {r["MASTER_ADDR"] for r in records} == {"127.0.0.1"}
    assert len({r["MASTER_PORT"] for r in records}) == 1
    assert 0 < int(records[0]["MASTER_PORT"]) < 65536
    tokens = {r["RPCDIST_TOKEN"] for r in records}
    assert len(tokens) == 1 and len(tokens.pop()) == 32  # one fresh token for the job
    assert {r["RPCDIST_RESTART_COUNT"] for r in records} == {"0"}
    assert all(r["argv"] == ["--flag", "x"] for r in records)
    assert len({r["pid"] for r in records}) == 3
    assert not any(alive(r["pid"]) for r in records)


def test_given_master_port_and_token_reach_the_children(tmp_path, launchers, port):
    argv = ["--nproc-per-node", "2", "--master-port", str(port), "--token", "mine"]
    rc, out = launchers.run(*argv, CHILD, "env", str(tmp_path))
    assert rc == 0, out
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert {(r["MASTER_PORT"], r["RPCDIST_TOKEN"]) for r in records} == {(str(port), "mine")}


def test_failing_child_stops_its_siblings(tmp_path, launchers):
    proc = launchers.start("--nproc-per-node", "2", CHILD, "fail", str(tmp_path))
    sibling = read_pid(tmp_path, 0)
    rc, out = launchers.finish(proc)  # not after the sibling's 60 s sleep: the timeout is 60 s
    assert rc == 3, out
    assert "worker rank 1" in out and "exited with code 3" in out
    assert not alive(sibling)


def test_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, launchers):
    argv = ["--nproc-per-node", "2", "--grace-period", "0.5", CHILD, "stubborn", str(tmp_path)]
    proc = launchers.start(*argv)
    sibling = read_pid(tmp_path, 0)
    rc, out = launchers.finish(proc)
    assert rc == 3, out
    assert "killing 1 worker(s)" in out
    assert not alive(sibling)


def test_max_restarts_reruns_a_failed_group(tmp_path, launchers):
    argv = ["--nproc-per-node", "2", "--max-restarts", "1", CHILD, "flaky", str(tmp_path)]
    rc, out = launchers.run(*argv)
    assert rc == 0, out
    assert "restarting the worker group (1/1)" in out
    lines = [line.split() for line in (tmp_path / "attempts.log").read_text().splitlines()]
    by_attempt = {(rank, attempt) for rank, attempt, _ in lines}
    assert {("0", "0"), ("0", "1"), ("1", "1")} <= by_attempt
    ports = {attempt: port for _, attempt, port in lines}
    assert ports["0"] != ports["1"]  # a fresh store port for the new attempt


def test_without_restarts_the_failure_code_is_returned(tmp_path, launchers):
    rc, out = launchers.run("--nproc-per-node", "2", CHILD, "flaky", str(tmp_path))
    assert rc == 1, out


def test_restart_resumes_from_the_checkpoint_and_matches_an_uninterrupted_run(tmp_path, launchers):
    argv = ["--nproc-per-node", "2", "--max-restarts", "1"]
    rc, out = launchers.run(*argv, TRAIN, str(tmp_path), "--steps", "6", "--crash", "1:3")
    assert rc == 0, out
    starts = read_starts(tmp_path)
    assert starts[:2] == [(0, 2, 0, 0), (0, 2, 1, 0)]  # (restart, world, rank, first step)
    resumed = starts[2:]
    assert [s[:3] for s in resumed] == [(1, 2, 0), (1, 2, 1)]
    assert resumed[0][3] == resumed[1][3] >= 2  # from the checkpoint, not from scratch
    final = rpcdist.load(tmp_path / "final")
    assert (final["restart"], final["world"]) == (1, 2)
    assert (final["w"] == train_module().reference(6, 2)).all()  # bit for bit


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_is_forwarded_and_children_reaped(tmp_path, launchers, sig):
    proc = launchers.start("--nproc-per-node", "2", CHILD, "sleep", str(tmp_path))
    pids = [read_pid(tmp_path, r) for r in range(2)]
    proc.send_signal(sig)
    rc, out = launchers.finish(proc)
    assert rc == 128 + sig, out
    assert "received signal" in out
    assert not any(alive(p) for p in pids)


def test_second_signal_kills_without_waiting_for_the_grace_period(tmp_path, launchers):
    argv = ["--nproc-per-node", "2", "--grace-period", "60", CHILD, "deaf", str(tmp_path)]
    proc = launchers.start(*argv)
    pids = [read_pid(tmp_path, r) for r in range(2)]
    proc.send_signal(signal.SIGTERM)  # forwarded, and ignored by the children
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    proc.send_signal(signal.SIGTERM)  # the second one kills them
    rc, out = launchers.finish(proc, timeout=30)
    assert rc == 128 + signal.SIGTERM, out
    assert not any(alive(p) for p in pids)


def test_workers_die_with_a_launcher_killed_by_sigkill(tmp_path, launchers):
    proc = launchers.start("--nproc-per-node", "2", CHILD, "deaf", str(tmp_path))
    pids = [read_pid(tmp_path, r) for r in range(2)]
    proc.kill()  # the launcher only: it can neither forward nor reap
    proc.wait(timeout=30)
    end = time.monotonic() + 20
    while any(running(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.02)
    assert not any(running(p) for p in pids)  # no orphan, though they ignore SIGTERM


def test_module_mode_runs_python_dash_m(launchers):
    rc, out = launchers.run("--nproc-per-node", "2", "-m", "platform")
    assert rc == 0, out
    assert "all 2 worker(s) finished successfully" in out


def test_rpc_ring_job_through_env_rendezvous(launchers):
    rc, out = launchers.run("--nproc-per-node", "3", str(SCRIPTS / "rpc_ring.py"), timeout=80)
    assert rc == 0, out
    for r in range(3):
        assert f"RING worker{r} -> worker{(r + 1) % 3} value={100 * r + 1} world=3" in out


def test_launch_called_from_a_coroutine_runs_in_a_thread_of_its_own(capfd):
    async def from_a_notebook() -> int:
        return launch(parse_args(["--nproc-per-node", "2", "-m", "platform"], env={}))

    assert asyncio.run(from_a_notebook()) == 0
    out = capfd.readouterr().out
    assert out.count("[rank 0] ") == out.count("[rank 1] ") == 1
