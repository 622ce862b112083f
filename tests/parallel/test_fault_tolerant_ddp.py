"""Fault-tolerant DDP: ranks killed (-9) or stopped mid-step, the survivors go on.

Each rank is ``ft_worker.py`` in its own process, with ``RANK`` and
``RPCDIST_FT_ADDR`` in its environment as the launcher gives them; the
coordinator runs here. Faults come from outside: the worker writes a marker
file at the chosen point of the chosen step and waits; the test then sends
SIGKILL (or SIGSTOP). The oracle replays the coordinator's record of every
committed step (which members, which batch each) in one process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ft_worker as fw
import numpy as np
import pytest

import rpcdist
import rpcdist.tensor as rt
from rpcdist.parallel import FaultToleranceCoordinator, _ft_shm

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("ft_worker.py")
ROOT = Path(__file__).resolve().parents[2]


class Ranks:
    """Worker processes of one test; every one is killed on the way out."""

    def __init__(self, coord: FaultToleranceCoordinator, out: Path, steps: int) -> None:
        self.coord, self.out, self.steps = coord, out, steps
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.extra: list[subprocess.Popen[bytes]] = []

    def start(
        self, rank: int, kill: str | None = None, timeout: float = 20.0, hold: int = -1
    ) -> None:
        env = dict(
            os.environ,
            RANK=str(rank),
            RPCDIST_FT_ADDR=self.coord.address,
            PYTHONPATH=str(ROOT),
            FT_TIMEOUT=str(timeout),
            OPENBLAS_NUM_THREADS="1",
            FT_HOLD=str(hold),
        )
        args = [str(self.out), str(self.steps), *([kill] if kill else [])]
        if rank in self.procs:
            self.extra.append(self.procs[rank])
        self.procs[rank] = subprocess.Popen([sys.executable, str(WORKER), *args], env=env)

    def marker(self, rank: int, step: int, deadline: float = 60.0) -> None:
        path = self.out / f"kill{rank}-{step}"
        end = time.monotonic() + deadline
        while not path.exists():
            assert time.monotonic() < end, f"rank {rank} never reached step {step}'s kill point"
            assert self.procs[rank].poll() is None, f"rank {rank} exited early"
            time.sleep(0.01)

    def replace(self, rank: int, survivors: list[int]) -> None:
        """Once the members are ``survivors``, start ``rank``'s replacement (same id, same
        program, no checkpoint); release the rank holding the job once it asked to join."""
        assert self.coord.wait_for(lambda c: c.members() == survivors, 60)
        joins = sum(e[1] == "join" for e in self.coord.events)
        self.start(rank)
        assert self.coord.wait_for(lambda c: sum(e[1] == "join" for e in c.events) > joins, 60)
        (self.out / "go").touch()

    def signal(self, rank: int, sig: int) -> None:
        self.procs[rank].send_signal(sig)

    def wait(self, ranks: list[int], timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        for r in ranks:
            assert self.procs[r].wait(timeout=max(end - time.monotonic(), 0.1)) == 0, r

    def kill_all(self) -> None:
        for p in [*self.procs.values(), *self.extra]:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


@contextlib.contextmanager
def job(tmp_path: Path, world: int, steps: int, timeout: float = 30.0) -> Iterator[Ranks]:
    coord = FaultToleranceCoordinator(world, timeout=timeout)
    ranks = Ranks(coord, tmp_path, steps)
    try:
        yield ranks
    finally:
        ranks.kill_all()
        coord.close()


def kill_one_of_three(tmp_path: Path, steps: int, step: int, point: str, victim: int = 1) -> Any:
    """Ranks 0-2 train ``steps`` steps; ``victim`` is killed (-9) at ``point`` of ``step``."""
    with job(tmp_path, 3, steps=steps) as ranks:
        for r in range(3):
            ranks.start(r, kill=f"{step}:{point}" if r == victim else None)
        ranks.marker(victim, step)
        ranks.signal(victim, signal.SIGKILL)
        ranks.wait([r for r in range(3) if r != victim])
    return ranks.coord


def logs(out: Path, rank: int) -> list[tuple[int, str, str, float]]:
    lines = (out / f"rank{rank}.log").read_text().split()
    return [
        (int(lines[i]), lines[i + 1], lines[i + 2], float(lines[i + 3]))
        for i in range(0, len(lines), 4)
    ]


def replay(commits: list[tuple[int, list[tuple[int, list[int]]]]], opt: str = "sgd") -> Any:
    """One process, the same arithmetic: per committed step, the members' gradients
    summed in member order and divided by their number, then the same SGD."""
    return replay_with_optim(commits, opt)[0]


def replay_with_optim(
    commits: list[tuple[int, list[tuple[int, list[int]]]]], opt_name: str = "sgd"
) -> Any:
    """:func:`replay`'s model and its optimizer (``ft_worker.OPTIMIZERS[opt_name]``)."""
    model = fw.model(1)  # the first quorum heals everyone from the lowest id (0)
    params = list(model.parameters())
    opt_class, options, _ = fw.OPTIMIZERS[opt_name]
    opt = opt_class(params, **options)
    for _, batches in commits:
        total = [np.zeros(p.data.shape) for p in params]
        for _, idx in batches:
            opt.zero_grad()
            fw.loss_of(model, np.asarray(idx)).backward()
            for t, p in zip(total, params, strict=True):
                t += p.grad.data
        for t, p in zip(total, params, strict=True):
            p.grad = rt.Tensor(t / len(batches))
        opt.step()
    return model, opt


def check_survivors(
    out: Path, survivors: list[int], coord: FaultToleranceCoordinator, opt: str = "sgd"
) -> None:
    """Bit-identical every step, equal to the oracle at the end, loss going down."""
    by_step: dict[int, set[str]] = {}
    for r in survivors:
        for step, _, digest, _ in logs(out, r):
            by_step.setdefault(step, set()).add(digest)
    assert all(len(d) == 1 for d in by_step.values()), "parameters differ across ranks"
    finals = [rpcdist.load(str(out / f"rank{r}.npz")) for r in survivors]
    oracle = replay(coord.commits, opt)
    for k, v in oracle.state_dict().items():
        for f in finals:
            np.testing.assert_array_equal(f["params"][k], v, err_msg=k)
    everything = np.arange(fw.N)
    before = fw.loss_of(fw.model(1), everything).item()
    assert fw.loss_of(oracle, everything).item() < 0.9 * before


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("point", "shm"),
    [
        ("before_allreduce", True),
        ("mid_allreduce", True),
        ("after_allreduce", True),
        ("mid_allreduce", False),
        ("after_allreduce", False),
    ],
)
def test_kill_one_of_three_mid_step(tmp_path, monkeypatch, point, shm):
    """``shm``: the all-reduce in shared memory (the ranks share a host), else over the
    TCP mesh (``RPCDIST_FT_SHM=0``: the path between hosts)."""
    if not shm:
        monkeypatch.setenv("RPCDIST_FT_SHM", "0")
    coord = kill_one_of_three(tmp_path, 14, 5, point)
    assert [m for m, _ in coord.commits[-1][1]] == [0, 2]
    assert len(coord.commits) == 14
    # Before the all-reduce ended everywhere, step 6 (index 5) is the redone one: the
    # lost rank's gradient is not in it. In shared memory the all-reduce is the vote:
    # once it ended, step 6 committed with rank 1's gradient everywhere, and step 7 is
    # redone without it. Over TCP the vote comes after it.
    redone = 6 if point == "after_allreduce" and shm else 5
    assert [m for m, _ in coord.commits[redone][1]] == [0, 2]
    assert all(len(b) == 3 for _, b in coord.commits[:redone])
    check_survivors(tmp_path, [0, 2], coord)
    redo = [e for e in coord.events if e[1] == "redo"]
    assert len(redo) == 1
    assert all(rpcdist.load(str(tmp_path / f"rank{r}.npz"))["shm"] == shm for r in (0, 2))


def shm_files(pid: int) -> list[str]:
    """The fault-tolerant shared-memory files in ``/dev/shm`` named with ``pid``."""
    return [n for n in os.listdir("/dev/shm") if n.startswith("rpcdist-ft-") and f"-{pid}-" in n]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [3, 2])
def test_a_member_killed_before_it_shares_its_segment_leaves_no_file(tmp_path, world):
    """Rank 1 is killed (-9) between creating its ``/dev/shm`` file and the exchange that
    tells the others its name (the first quorum's setup): nobody else knows the file, yet
    it is unlinked, its process being gone: by the survivors' next quorum (its setup), or
    (one survivor: no other quorum) by the survivor's ``close()``."""
    survivors = [r for r in range(world) if r != 1]
    with job(tmp_path, world, steps=8) as ranks:
        for r in range(world):
            ranks.start(r, kill="0:shm_created" if r == 1 else None)
        ranks.marker(1, 0)
        pid = int((tmp_path / "kill1-0").read_text())
        assert len(shm_files(pid)) == 1  # created, its name known only to rank 1
        ranks.signal(1, signal.SIGKILL)
        ranks.wait(survivors)  # (rank 1 not reaped yet: a zombie)
        coord = ranks.coord
    assert [m for m, _ in coord.commits[0][1]] == survivors  # step 1 redone without it
    assert len(coord.commits) == 8
    check_survivors(tmp_path, survivors, coord)
    shm = [int(rpcdist.load(str(tmp_path / f"rank{r}.npz"))["shm"]) for r in survivors]
    assert shm == [int(world > 2)] * len(survivors)  # alone: no shared memory
    assert shm_files(pid) == []


def test_the_sweep_unlinks_only_files_of_ended_processes_of_its_namespace():
    """A live process's file stays, and so does one named in another pid namespace
    (its pid means nothing here); an ended process's goes."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    ns = _ft_shm._pid_namespace()
    if not ns or not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm and /proc")
    names = [
        f"rpcdist-ft-{ns}-{os.getpid()}-live",
        f"rpcdist-ft-{ns}-{done.pid}-gone",
        f"rpcdist-ft-{ns + 1}-{done.pid}-othernamespace",
    ]
    paths = [Path("/dev/shm", n) for n in names]
    try:
        for p in paths:
            p.touch()
        removed = _ft_shm.sweep(ns)  # (and any other job's leftovers)
        assert names[1] in removed and not {names[0], names[2]} & set(removed)
        assert [p.exists() for p in paths] == [True, False, True]
    finally:
        for p in paths:
            p.unlink(missing_ok=True)


@pytest.mark.timeout(180)
def test_the_first_member_killed_between_the_vote_and_its_record(tmp_path):
    """Rank 0 sends the coordinator the record of each step committed in shared memory;
    killed after the vote, before sending it, the survivors' next vote carries it."""
    coord = kill_one_of_three(tmp_path, 14, 5, "after_allreduce", victim=0)
    assert len(coord.commits) == 14
    assert [m for m, _ in coord.commits[5][1]] == [0, 1, 2]  # committed, then recorded
    assert all(len(b) == 2 for _, b in coord.commits[6:])
    assert sum(e[1] == "redo" for e in coord.events) == 1
    check_survivors(tmp_path, [1, 2], coord)


@pytest.mark.timeout(240)
def test_two_kills_in_a_row_a_replacement_and_exact_coverage(tmp_path):
    """4 ranks: rank 3 dies at step 4, rank 2 at step 5; a replacement for rank 3
    joins; 50 steps of 4 samples over 90 samples cross two epochs."""
    with job(tmp_path, 4, steps=50) as ranks:
        for r in range(4):
            kill = {3: "4:mid_allreduce", 2: "5:before_allreduce"}.get(r)
            ranks.start(r, kill=kill, hold=12 if r == 0 else -1)
        ranks.marker(3, 4)
        ranks.signal(3, signal.SIGKILL)
        ranks.marker(2, 5)
        ranks.signal(2, signal.SIGKILL)
        ranks.replace(3, survivors=[0, 1])
        ranks.wait([0, 1, 3])
        coord = ranks.coord
    a, b = check_replacement(tmp_path, coord, 4, [0, 1, 3], 3)
    assert_same_tree(a["optim"], b["optim"])
    assert a["sampler"]["start"] == b["sampler"]["start"]
    assert a["sampler"]["epoch"] == b["sampler"]["epoch"]
    # Epoch 0 was trained across three world sizes (4, 2, 3 or 4, 3, 2, 3).
    epochs = sorted({e for e, _ in coord.commits})
    assert len(epochs) >= 2
    for e in epochs[:-1]:  # the replacement joined in a later one
        seen = coord.seen(e)
        assert sorted(seen) == list(range(fw.N)), f"a sample of epoch {e} was never trained on"
        assert sum(seen.values()) - fw.N < 4, f"epoch {e}: samples seen twice beyond padding"


def check_replacement(
    out: Path,
    coord: FaultToleranceCoordinator,
    world: int,
    final: list[int],
    new: int,
    opt: str = "sgd",
) -> tuple[Any, Any]:
    """Four steps at ``world``, two members at some point, ``final`` at the end, trained as
    the oracle; the replacement ``new``'s parameters equal rank 0's bit for bit. Returns
    rank 0's and the replacement's saved states."""
    worlds = [len(b) for _, b in coord.commits]
    assert worlds[:4] == [world] * 4 and 2 in worlds and worlds[-1] == len(final)
    check_survivors(out, final, coord, opt)
    a, b = (rpcdist.load(str(out / f"rank{r}.npz")) for r in (0, new))
    assert_same_tree(a["params"], b["params"])
    return a, b


def assert_same_tree(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_tree(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tree(x, y)
    else:
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.timeout(180)
def test_a_stopped_rank_is_declared_lost_and_the_job_goes_on(tmp_path):
    with job(tmp_path, 3, steps=10, timeout=2.0) as ranks:
        for r in range(3):
            ranks.start(r, kill="4:before_allreduce" if r == 2 else None, timeout=2.0)
        ranks.marker(2, 4)
        ranks.signal(2, signal.SIGSTOP)
        try:
            ranks.wait([0, 1])
        finally:
            ranks.signal(2, signal.SIGKILL)
        coord = ranks.coord
    assert any(e[1] == "lost" and e[2] == (2, "no vote in time") for e in coord.events)
    assert [m for m, _ in coord.commits[-1][1]] == [0, 1]
    check_survivors(tmp_path, [0, 1], coord)


@pytest.mark.timeout(180)
def test_a_rank_stopped_past_the_timeout_then_resumed_commits_with_the_others(tmp_path):
    """Rank 2 is stopped (SIGSTOP) before its vote in shared memory; the others' vote
    times out and they ask the coordinator. It is resumed before the coordinator's own
    timeout: it votes, finds every vote in, commits the step and tells the coordinator,
    which tells the others to commit it too. Nobody redoes a step or is lost."""
    with job(tmp_path, 3, steps=10, timeout=60.0) as ranks:
        for r in range(3):
            ranks.start(r, kill="4:mid_allreduce" if r == 2 else None, timeout=2.0)
        ranks.marker(2, 4)
        ranks.signal(2, signal.SIGSTOP)
        coord = ranks.coord
        try:
            assert coord.wait_for(lambda c: sorted(c._votes) == [0, 1], 60), "no votes came"
        finally:
            (tmp_path / "release2").touch()
            ranks.signal(2, signal.SIGCONT)
        ranks.wait([0, 1, 2])
    assert not [e for e in coord.events if e[1] == "redo"]
    last_commit = max(t for t, kind, _ in coord.events if kind == "commit")
    assert all(t > last_commit for t, kind, _ in coord.events if kind == "lost")  # at the end
    assert [len(b) for _, b in coord.commits] == [3] * 10
    check_survivors(tmp_path, [0, 1, 2], coord)
    assert all(rpcdist.load(str(tmp_path / f"rank{r}.npz"))["shm"] == 1 for r in range(3))


@pytest.mark.timeout(240)
def test_the_launcher_restarts_only_the_dead_rank(tmp_path):
    """``--restart-policy rank``: the launcher runs the coordinator and restarts
    rank 1 alone after its kill -9; the replacement pulls the live state."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), FT_HOLD="12", OPENBLAS_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "rpcdist.launch",
        "--nproc-per-node",
        "3",
        "--restart-policy",
        "rank",
        "--max-restarts",
        "1",
        str(WORKER),
        str(tmp_path),
        "30",
        "5:mid_allreduce:1",
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        marker = tmp_path / "kill1-5"
        end = time.monotonic() + 120
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < end and proc.poll() is None, "rank 1 never reached step 5"
            time.sleep(0.01)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        while not (tmp_path / "started1-1").exists():
            assert time.monotonic() < end and proc.poll() is None, "rank 1 was not restarted"
            time.sleep(0.01)
        (tmp_path / "go").touch()  # the others held at step 12 until the replacement joined
        out, _ = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == 0, out
    assert "restarting only rank 1 (1/1)" in out
    finals = [rpcdist.load(str(tmp_path / f"rank{r}.npz")) for r in range(3)]
    for f in finals[1:]:
        assert_same_tree(finals[0], f)
    steps = {s for s, members, _, _ in logs(tmp_path, 1) if members == "0,1,2"}
    assert max(steps) == 30  # the replacement trained to the end with the full membership
