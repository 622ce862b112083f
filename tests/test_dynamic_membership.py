"""Dynamic membership (``init_rpc`` without a world size): workers join a
running group and leave it, across processes started as the launcher
starts them (``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``RPCDIST_TOKEN``;
no ``WORLD_SIZE``). Each member is ``tests/dynamic_member.py``, driven one
JSON command at a time; every process is killed at the end whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rpcdist import ConfigError
from rpcdist._store import parse_init_method
from rpcdist.launch._hosting import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

MEMBER = Path(__file__).resolve().parent / "dynamic_member.py"
ROOT = Path(__file__).resolve().parent.parent
#: Seconds to wait for one answer from a member.
ANSWER = 60.0


class Member:
    """A running ``dynamic_member.py``: send commands, read answers."""

    def __init__(self, name: str, env: dict[str, str], init_timeout: float = 60.0) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(MEMBER), name, str(init_timeout)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def answer(self) -> dict[str, Any]:
        """The next answer (fails the test after ``ANSWER`` seconds)."""
        try:
            line = self._lines.get(timeout=ANSWER)
        except queue.Empty:
            pytest.fail(f"{self.name} did not answer in {ANSWER} s; stderr: {self.err()}")
        if line is None:
            pytest.fail(f"{self.name} exited ({self.proc.wait()}); stderr: {self.err()}")
        got: dict[str, Any] = json.loads(line)
        return got

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def ok(self, **cmd: Any) -> Any:
        got = self.ask(**cmd)
        assert "ok" in got, (self.name, cmd, got, self.err())
        return got["ok"]

    def shutdown(self) -> None:
        """A graceful shutdown: it leaves no rpcdist thread behind and exits 0."""
        assert self.ok(op="shutdown") == []
        assert self.proc.wait(timeout=ANSWER) == 0, self.err()

    def err(self) -> str:
        return "".join(self.stderr)[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


class Group:
    """Members started with the launcher's environment of one job."""

    def __init__(self, token: str) -> None:
        self.port = free_port()
        self.token = token
        self.members: list[Member] = []

    def env(self, rank: int, token: str | None) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "RPCDIST_TOKEN", "MASTER_ADDR", "MASTER_PORT")
        }
        env.update(
            RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        )
        if token is not None:
            env["RPCDIST_TOKEN"] = token
        return env

    def start(self, name: str, rank: int, *, token: str | None = "", **kw: Any) -> Member:
        member = Member(name, self.env(rank, self.token if token == "" else token), **kw)
        self.members.append(member)
        return member

    def join(self, name: str, rank: int) -> Member:
        """Start a member and wait until it has joined; returns it."""
        member = self.start(name, rank)
        got = member.answer()
        assert "ok" in got, (name, got, member.err())
        assert name in got["ok"]
        return member

    def kill_all(self) -> None:
        for m in self.members:
            m.kill()


@pytest.fixture
def group() -> Iterator[Group]:
    g = Group(token="dynamic-membership-test-token")
    try:
        yield g
    finally:
        g.kill_all()


def _port_free(port: int) -> bool:
    """No listener is left on ``port`` (connections it accepted may linger
    in TIME_WAIT, as after any server: a new server binds with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_parse_init_method_without_a_world_size_is_dynamic() -> None:
    spec = parse_init_method("tcp://127.0.0.1:29500", 2, None, env={}, dynamic=True)
    assert spec.dynamic and spec.world_size == 0 and spec.rank == 2
    # WORLD_SIZE in the environment keeps a job static, as before
    spec = parse_init_method("env://", None, None, env=_env(RANK="1", WORLD_SIZE="3"), dynamic=True)
    assert not spec.dynamic and spec.world_size == 3
    with pytest.raises(ConfigError, match="world_size is not known"):
        parse_init_method("tcp://127.0.0.1:29500", 2, None, env={})
    with pytest.raises(ConfigError, match="MASTER_PORT is not set.*dynamic group"):
        parse_init_method("env://", 1, None, env={}, dynamic=True)


def _env(**kw: str) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **kw}


def test_join_calls_both_ways_and_graceful_leave(group: Group) -> None:
    ps = group.join("ps", 0)
    t1 = group.join("trainer1", 1)
    # the new member calls an existing one, and the other way round
    assert t1.ok(op="call", to="ps", x=1) == 2
    assert ps.ok(op="info", name="trainer1") == ["trainer1", 1]
    assert ps.ok(op="call", to="trainer1", x=2) == 3
    t2 = group.join("trainer2", 2)
    assert sorted(t2.ok(op="until", present=True, name="trainer1")) == [
        "ps",
        "trainer1",
        "trainer2",
    ]
    assert t1.ok(op="until", present=True, name="trainer2")
    assert t2.ok(op="call", to="trainer1", x=3) == 4
    assert t1.ok(op="call", to="trainer2", x=4) == 5

    t1.shutdown()  # a graceful leave: the others see it gone, without a loss
    for m in (ps, t2):
        assert m.ok(op="until", present=False, name="trainer1") == sorted(["ps", "trainer2"])
        got = m.ask(op="call", to="trainer1", x=0)
        assert got["error"] == "WorkerLostError" and "left the group" in got["message"], got
        got = m.ask(op="info", name="trainer1")
        assert got["error"] == "WorkerLostError", got
    assert ps.ok(op="call", to="trainer2", x=5) == 6
    t2.shutdown()
    ps.shutdown()
    for m in (ps, t1, t2):
        assert " is lost" not in m.err(), m.err()
    assert _port_free(group.port)  # rank 0 stopped the store


def test_killed_member_is_found_lost_and_removed(group: Group) -> None:
    ps = group.join("ps", 0)
    t1 = group.join("trainer1", 1)
    t2 = group.join("trainer2", 2)
    assert t2.ok(op="call", to="trainer1", x=1) == 2
    t1.kill()  # SIGKILL, from outside
    # rank 0 watches every member; it takes the dead one out and tells the rest
    assert ps.ok(op="until", present=False, name="trainer1") == ["ps", "trainer2"]
    assert t2.ok(op="until", present=False, name="trainer1") == ["ps", "trainer2"]
    for m in (ps, t2):
        got = m.ask(op="call", to="trainer1", x=0)
        assert got["error"] == "WorkerLostError" and "lost" in got["message"], got
    assert ps.ok(op="call", to="trainer2", x=7) == 8
    t2.shutdown()
    ps.shutdown()


def test_a_member_found_lost_stays_out_when_it_resumes(group: Group) -> None:
    ps = group.join("ps", 0)
    t1 = group.join("trainer1", 1)
    t2 = group.join("trainer2", 2)
    os.killpg(t1.proc.pid, signal.SIGSTOP)  # hung, from outside
    try:
        assert ps.ok(op="until", present=False, name="trainer1") == ["ps", "trainer2"]
        assert t2.ok(op="until", present=False, name="trainer1") == ["ps", "trainer2"]
    finally:
        os.killpg(t1.proc.pid, signal.SIGCONT)
    # fail-stop: its old self is refused, whatever it tries
    got = t1.ask(op="call", to="ps", x=1)
    assert got["error"] in ("WorkerLostError", "ConnectError"), got
    got = t1.ask(op="call", to="trainer2", x=1)
    assert got["error"] in ("WorkerLostError", "ConnectError"), got
    assert ps.ok(op="call", to="trainer2", x=2) == 3
    t1.kill()
    t2.shutdown()
    ps.shutdown()


def test_members_go_on_and_leave_when_rank_0_is_killed(group: Group) -> None:
    ps = group.join("ps", 0)
    t1 = group.join("trainer1", 1)
    t2 = group.join("trainer2", 2)
    assert t1.ok(op="call", to="ps", x=1) == 2
    ps.kill()
    assert t1.ok(op="until", present=False, name="ps") == ["trainer1", "trainer2"]
    got = t1.ask(op="call", to="ps", x=0)
    assert got["error"] == "WorkerLostError", got
    assert t1.ok(op="call", to="trainer2", x=1) == 2  # the others still talk
    t1.shutdown()  # no group to tell: it leaves anyway, without hanging
    t2.shutdown()


def test_a_restarted_member_joins_again(group: Group) -> None:
    ps = group.join("ps", 0)
    t1 = group.join("trainer1", 1)
    t2 = group.join("trainer2", 2)
    assert ps.ok(op="call", to="trainer1", x=1) == 2
    t1.kill()
    assert ps.ok(op="until", present=False, name="trainer1")
    again = group.join("trainer1", 1)  # same rank and name, a new process
    assert ps.ok(op="call", to="trainer1", x=10) == 11
    assert t2.ok(op="until", present=True, name="trainer1")
    assert t2.ok(op="call", to="trainer1", x=20) == 21
    assert again.ok(op="call", to="trainer2", x=30) == 31
    for m in (again, t2, ps):
        m.shutdown()


def test_a_lost_members_autograd_context_goes_though_its_rank_is_back(group: Group) -> None:
    """trainer1 holds a distributed autograd context on ps and is killed (-9); a new
    process with its rank (started ahead) joins before the context's lease (5 s)
    ends, so it answers ps's ping for that rank: ps frees the context all the same
    (the new process, asked, does not hold it), and the new process's context ids
    are not its predecessor's (a restarted trainer of a parameter server)."""
    ps = group.join("ps", 0)
    t1 = group.join("trainer1", 1)
    old = t1.ok(op="context", to="ps", keep=True)
    assert ps.ok(op="contexts", count=1) == 1
    env = dict(group.env(1, group.token), DYNAMIC_MEMBER_WAIT="1")
    again = Member("trainer1", env)  # imports done, it waits for a line to join
    group.members.append(again)
    t1.kill()
    assert ps.ok(op="until", present=False, name="trainer1")
    assert again.ask(op="go") == {"ok": ["ps", "trainer1"]}  # (the line it waited for)
    new = again.ok(op="context", to="ps", keep=True)
    assert new >> 48 == old >> 48 == 1 and new != old
    assert ps.ok(op="contexts", count=1, timeout=30) == 1  # the old one went, not the new


def test_a_duplicate_live_member_is_refused(group: Group) -> None:
    ps = group.join("ps", 0)
    group.join("trainer1", 1)
    twin = group.start("trainer1", 1)
    got = twin.answer()
    assert got["error"] == "ConfigError" and "is taken" in got["message"], got
    assert ps.ok(op="call", to="trainer1", x=1) == 2


@pytest.mark.parametrize("token", ["not-the-job-token", None], ids=["wrong-token", "no-token"])
def test_a_joiner_without_the_token_is_refused(group: Group, token: str | None) -> None:
    ps = group.join("ps", 0)
    stranger = group.start("stranger", 1, token=token, init_timeout=5.0)
    got = stranger.answer()
    assert got["error"] in ("ConnectError", "RpcTimeoutError"), got
    assert stranger.proc.wait(timeout=ANSWER) == 0
    # the group never heard of it, and goes on
    got = ps.ask(op="info", name="stranger")
    assert got["error"] == "ConfigError", got
    t1 = group.join("trainer1", 1)
    assert t1.ok(op="call", to="ps", x=1) == 2
    t1.shutdown()
    ps.shutdown()


def test_a_dynamic_joiner_of_a_static_job_is_refused(group: Group) -> None:
    env = group.env(0, group.token)
    env["WORLD_SIZE"] = "1"  # a static job of one
    static = Member("static0", env)
    group.members.append(static)
    assert static.answer()["ok"] == ["static0"]
    joiner = group.start("joiner", 1)
    got = joiner.answer()
    assert got["error"] == "ConfigError", got
    assert got["message"].startswith(
        "RPC group mixes statically and dynamically initialized members which is not supported."
    )
    static.shutdown()


def test_collectives_refuse_a_dynamic_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    import rpcdist
    import rpcdist.collectives

    for var in ("RANK", "WORLD_SIZE", "RPCDIST_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    port = free_port()
    opts = rpcdist.RpcOptions(init_timeout=1.0)  # (its shutdown waits that long for a joiner)
    rpcdist.init_rpc("alone", rank=0, init_method=f"tcp://127.0.0.1:{port}", options=opts)
    try:
        with pytest.raises(ConfigError, match="dynamic group"):
            rpcdist.collectives.init_process_group(init_method=f"tcp://127.0.0.1:{port}")
    finally:
        rpcdist.shutdown()
    assert _port_free(port)


_IDLE = {"rref_owners": 0, "rref_forks": 0, "rref_pending_users": 0, "rref_pending_children": 0}


def test_a_restarted_member_makes_rrefs_its_predecessor_did_not(group: Group) -> None:
    """trainer1 made RRefs owned by ps (ps shares one back, and keeps it) and
    RRefs it owns that ps holds, and is killed (-9); a new process with its
    rank joins and does the same: its RRefs are its own (right values, ps's
    records go back to none), its predecessor's stay failed, ps keeps its own
    value, and ps may use the new process's RRefs (it owns some again)."""
    ps = group.join("ps", 0)
    t1 = group.join("trainer1", 1)
    t1.ok(op="remote", key="a", to="ps", value="old-a")
    t1.ok(op="remote", key="b", to="ps", value="old-b")
    t1.ok(op="share", key="b", to="ps", **{"as": "b"})  # ps keeps b itself
    ps.ok(op="share", key="b", to="trainer1", **{"as": "b0"})  # and shares it back
    t1.ok(op="own", key="c", value="old-c")
    t1.ok(op="share", key="c", to="ps", **{"as": "c"})
    assert t1.ok(op="fetch", key="b0") == "old-b"
    assert ps.ok(op="fetch", key="c") == "old-c"
    env = dict(group.env(1, group.token), DYNAMIC_MEMBER_WAIT="1")
    again = Member("trainer1", env)  # imports done, it waits for a line to join
    group.members.append(again)
    t1.kill()
    assert ps.ok(op="until", present=False, name="trainer1")
    ps.ok(op="rrefs", want=_IDLE)  # the forks trainer1 held went with it
    got = ps.ask(op="fetch", key="c")
    assert got["error"] == "OwnerLostError", got
    assert again.ask(op="go") == {"ok": ["ps", "trainer1"]}

    # the new trainer1 makes as many RRefs, in the same order
    again.ok(op="remote", key="x", to="ps", value="new-x")
    again.ok(op="remote", key="y", to="ps", value="new-y")
    again.ok(op="share", key="y", to="ps", **{"as": "y"})
    again.ok(op="own", key="z", value="new-z")
    again.ok(op="share", key="z", to="ps", **{"as": "z"})
    ps.ok(op="remote", key="w", to="trainer1", value="ps-w")
    ps.ok(op="share", key="w", to="trainer1", **{"as": "w"})
    for m, key, value in [
        (again, "x", "new-x"),
        (again, "y", "new-y"),
        (again, "y", "new-y"),  # (again: the first may have come with remote()'s reply)
        (ps, "y", "new-y"),
        (ps, "b", "old-b"),
        (ps, "z", "new-z"),
        (ps, "w", "ps-w"),
        (again, "w", "ps-w"),
    ]:
        assert m.ok(op="fetch", key=key) == value, (m.name, key)
    got = ps.ask(op="fetch", key="c")  # the predecessor's stays failed
    assert got["error"] == "OwnerLostError", got
    assert ps.ok(op="rrefs", want={"rref_owners": 2}) == {"rref_owners": 2}  # x and y
    assert again.ok(op="rrefs", want={"rref_owners": 2}) == {"rref_owners": 2}  # z and w
    for m, keys in [(again, "xyzw"), (ps, "yzwbc")]:
        for key in keys:
            m.ok(op="drop", key=key)
    for m in (ps, again):
        assert m.ok(op="rrefs", want=_IDLE) == _IDLE, m.name
    again.shutdown()
    ps.shutdown()


def test_a_static_jobs_rref_ids_start_at_0(group: Group) -> None:
    env = group.env(0, group.token)
    env["WORLD_SIZE"] = "1"
    static = Member("static0", env)
    group.members.append(static)
    assert static.answer()["ok"] == ["static0"]
    assert static.ok(op="own", key="v", value=1) == (
        "OwnerRRef(GloballyUniqueId(created_on=0, local_id=0))"
    )
    static.shutdown()
