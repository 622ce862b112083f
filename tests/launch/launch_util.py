"""Helpers of the launcher tests: launcher processes, and the proof that none outlives its test.

Every launcher a test starts runs in its own session, with a tag unique to
the test in its environment (its workers inherit it). On the way out the
fixture kills each launcher's session, then looks through ``/proc`` for any
process that still carries the tag (a worker orphaned by a killed launcher
would): the test fails if one is found, after it was killed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
CHILD = str(SCRIPTS / "child.py")
TRAIN = str(SCRIPTS / "train.py")
TAG = "RPCDIST_LAUNCH_TEST_TAG"


def clean_env() -> dict[str, str]:
    """The test's environment without the variables a launcher sets for its workers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCDIST_")}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def alive(pid: int) -> bool:
    """Whether ``pid`` exists (a zombie counts: it was not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan's reaping is not ours)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def tagged(tag: str) -> list[int]:
    """Running processes whose environment carries ``TAG=tag``."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and running(int(entry.name)):
            found.append(int(entry.name))
    return found


def wait_for_file(path: Path, timeout: float = 30) -> Path:
    """Wait until ``path`` exists (written atomically by a worker)."""
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.02)
    return path


def wait_listening(port: int, timeout: float = 60) -> None:
    """Wait until something accepts connections on 127.0.0.1:``port`` (a launcher's store)."""
    end = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < end, f"nothing listens on 127.0.0.1:{port}"
            time.sleep(0.05)


def read_pid(directory: Path, rank: int, timeout: float = 30) -> int:
    return int(wait_for_file(directory / f"pid{rank}", timeout).read_text())


def read_json(path: Path, timeout: float = 30) -> dict[str, int]:
    record: dict[str, int] = json.loads(wait_for_file(path, timeout).read_text())
    return record


def train_module() -> ModuleType:
    """``scripts/train.py`` imported, for its NumPy reference of the training run."""
    spec = importlib.util.spec_from_file_location("launch_train", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_starts(directory: Path) -> list[tuple[int, ...]]:
    """``train.py``'s start records, sorted: ``(restart, world, rank, first_step)``."""
    lines = (directory / "starts.log").read_text().splitlines()
    return sorted(tuple(int(x) for x in line.split()) for line in lines)


class Launchers:
    """The launchers one test starts (see the module docstring)."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex
        self.procs: list[subprocess.Popen[str]] = []

    def start(
        self,
        *args: str,
        separate: bool = False,
        env: dict[str, str] | None = None,
        netns: str | None = None,
    ) -> subprocess.Popen[str]:
        """Start ``python -m rpcdist.launch ARGS``, its stdout and stderr captured
        together (or apart, with ``separate``); ``env``: more variables;
        ``netns``: in that network namespace (``ip netns exec``, which execs it)."""
        env = {**clean_env(), **(env or {})}
        env[TAG] = self.tag
        where = ["ip", "netns", "exec", netns] if netns is not None else []
        proc = subprocess.Popen(
            [*where, sys.executable, "-m", "rpcdist.launch", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if separate else subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    @staticmethod
    def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
        """Wait for ``proc``: its exit code and output."""
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out

    def run(self, *args: str, timeout: float = 60) -> tuple[int, str]:
        """Run one launcher to completion: exit code and output."""
        return self.finish(self.start(*args), timeout)

    def cleanup(self) -> list[int]:
        """Kill every session; the tagged processes that were still running."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=30)
        end = time.monotonic() + 5  # orphans get their death signal asynchronously
        while (left := tagged(self.tag)) and time.monotonic() < end:
            time.sleep(0.05)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left


@pytest.fixture
def launchers() -> Iterator[Launchers]:
    """Start launchers; none of them, nor any of their workers, survives the test."""
    group = Launchers()
    try:
        yield group
    finally:
        left = group.cleanup()
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def port() -> int:
    """A port for the launchers' rendezvous store, picked by the OS."""
    from rpcdist.launch import free_port

    return free_port()


def node_args(port: int, nnodes: str, *extra: str) -> list[str]:
    """Arguments every launcher of a multi-node job on loopback shares."""
    return ["--nnodes", nnodes, "--master-port", str(port), "--token", "launch-test", *extra]


@pytest.fixture(autouse=True)
def linux_only() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the launcher tests read /proc")
