"""The launcher, ``rpcdist-run`` / ``python -m rpcdist.launch``.

Argument checks and the child environment are tested in-process; the rest
runs the launcher as a subprocess (in its own session, so that a failing test
can kill it and every child with one ``killpg``) on the tiny scripts in
``tests/launch_scripts/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rpcdist import ConfigError
from rpcdist.launch import child_env, main, parse_args

SCRIPTS = Path(__file__).parent / "launch_scripts"
CHILD = str(SCRIPTS / "child.py")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCDIST_")}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


@contextlib.contextmanager
def launcher(*args: str) -> Iterator[subprocess.Popen[str]]:
    """Start ``python -m rpcdist.launch ARGS``; kill its whole session on the way out."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rpcdist.launch", *args],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


def run(*args: str, timeout: float = 60) -> tuple[int, str, float]:
    """Run the launcher to completion: exit code, output, seconds taken."""
    start = time.monotonic()
    with launcher(*args) as proc:
        out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out, time.monotonic() - start


def alive(pid: int) -> bool:
    """Whether ``pid`` exists (a zombie counts: it was not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def read_pid(directory: Path, rank: int, timeout: float = 30) -> int:
    path = directory / f"pid{rank}"
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.02)
    return int(path.read_text())


# ------------------------------------------------------------------ in-process


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([CHILD], "--nproc-per-node"),
        (["--nproc-per-node", "0", CHILD], "--nproc-per-node must be >= 1"),
        (["--nproc-per-node", "x", CHILD], "invalid int value"),
        (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", CHILD], "--node-rank"),
        (["--nproc-per-node", "2", "--master-port", "70000", CHILD], "--master-port"),
        (["--nproc-per-node", "2", "--max-restarts", "-1", CHILD], "--max-restarts"),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--token", "t", CHILD],
            "--master-port is required",
        ),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--master-port", "1234", CHILD],
            "token is required",
        ),
        (["--nproc-per-node", "2", "no/such/script.py"], "not found"),
        (["--nproc-per-node", "2"], "script"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RPCDIST_TOKEN", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: rpcdist-run" in err and message in err
    with pytest.raises(ConfigError):
        parse_args(argv, env={})


def test_script_arguments_are_passed_through_untouched():
    cfg = parse_args(["--nproc-per-node", "2", CHILD, "--epochs", "3", "-h"], env={})
    assert cfg.command == (CHILD, "--epochs", "3", "-h")
    mod = parse_args(["--nproc-per-node", "1", "-m", "pkg.mod", "--x"], env={})
    assert mod.command == ("-m", "pkg.mod", "--x")


def test_token_comes_from_flag_then_environment_then_is_random():
    base = ["--nproc-per-node", "1", CHILD]
    assert parse_args(["--token", "flag", *base], env={"RPCDIST_TOKEN": "env"}).token == "flag"
    assert parse_args(base, env={"RPCDIST_TOKEN": "env"}).token == "env"
    a, b = parse_args(base, env={}).token, parse_args(base, env={}).token
    assert a != b and len(a) == 32


def test_child_env_for_a_second_node():
    argv = "--nproc-per-node 4 --nnodes 3 --node-rank 1 --master-addr 10.0.0.1"
    argv += " --master-port 29500 --token tok"
    cfg = parse_args([*argv.split(), CHILD], env={})
    env = child_env(cfg, 2, 29500, restart_count=1, base={"KEEP": "1", "RANK": "9"})
    assert env == {
        "KEEP": "1",
        "RANK": "6",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "12",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "RPCDIST_TOKEN": "tok",
        "RPCDIST_RESTART_COUNT": "1",
        "RPCDIST_MAX_RESTARTS": "0",
    }


# ---------------------------------------------------------------- processes


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_three_children_get_their_environment(tmp_path):
    rc, out, _ = run("--nproc-per-node", "3", CHILD, "env", str(tmp_path), "--flag", "x")
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


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_second_node_ranks_and_shared_settings(tmp_path):
    rc, out, _ = run(
        "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
        "--master-port", "29999", "--token", "shared", CHILD, "env", str(tmp_path),
    )  # fmt: skip
    assert rc == 0, out
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (2, 3)]
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) for r in records] == [
        ("2", "0", "4"),
        ("3", "1", "4"),
    ]
    assert {(r["MASTER_PORT"], r["RPCDIST_TOKEN"]) for r in records} == {("29999", "shared")}


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_failing_child_stops_its_siblings(tmp_path):
    with launcher("--nproc-per-node", "2", CHILD, "fail", str(tmp_path)) as proc:
        sibling = read_pid(tmp_path, 0)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert time.monotonic() - start < 20  # not the sibling's 60 s sleep
    assert "worker rank 1" in out and "exited with code 3" in out
    assert not alive(sibling)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    with launcher(
        "--nproc-per-node", "2", "--grace-period", "0.5", CHILD, "stubborn", str(tmp_path)
    ) as proc:
        sibling = read_pid(tmp_path, 0)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "killing 1 worker(s)" in out
    assert not alive(sibling)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_max_restarts_reruns_a_failed_group(tmp_path):
    rc, out, _ = run("--nproc-per-node", "2", "--max-restarts", "1", CHILD, "flaky", str(tmp_path))
    assert rc == 0, out
    assert "restarting the worker group (1/1)" in out
    lines = [line.split() for line in (tmp_path / "attempts.log").read_text().splitlines()]
    by_attempt = {(rank, attempt) for rank, attempt, _ in lines}
    assert {("0", "0"), ("0", "1"), ("1", "1")} <= by_attempt
    ports = {attempt: port for _, attempt, port in lines}
    assert ports["0"] != ports["1"]  # a fresh store port for the new attempt


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_without_restarts_the_failure_code_is_returned(tmp_path):
    rc, out, _ = run("--nproc-per-node", "2", CHILD, "flaky", str(tmp_path))
    assert rc == 1, out


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_is_forwarded_and_children_reaped(tmp_path, sig):
    with launcher("--nproc-per-node", "2", CHILD, "sleep", str(tmp_path)) as proc:
        pids = [read_pid(tmp_path, r) for r in range(2)]
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, out
    assert "received signal" in out
    assert not any(alive(p) for p in pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_second_signal_kills_without_waiting_for_the_grace_period(tmp_path):
    with launcher(
        "--nproc-per-node", "2", "--grace-period", "60", CHILD, "deaf", str(tmp_path)
    ) as proc:
        pids = [read_pid(tmp_path, r) for r in range(2)]
        proc.send_signal(signal.SIGTERM)  # forwarded, and ignored by the children
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
        proc.send_signal(signal.SIGTERM)  # the second one kills them
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert not any(alive(p) for p in pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_module_mode_runs_python_dash_m():
    rc, out, _ = run("--nproc-per-node", "2", "-m", "platform")
    assert rc == 0, out
    assert "all 2 worker(s) finished successfully" in out


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_rpc_ring_job_through_env_rendezvous():
    rc, out, _ = run("--nproc-per-node", "3", str(SCRIPTS / "rpc_ring.py"), timeout=80)
    assert rc == 0, out
    for r in range(3):
        assert f"RING worker{r} -> worker{(r + 1) % 3} value={100 * r + 1} world=3" in out
