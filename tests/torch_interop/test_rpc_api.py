"""The private helpers of ``torch.distributed.rpc`` that programs and
libraries call (``rpc.api._all_gather``/``_barrier``,
``rpc._get_current_rpc_agent().get_worker_infos()``,
``rpc._is_current_rpc_agent_set()``, ``rpc._set_rpc_timeout``), with
torch's meaning, and bounded waits where torch's wait for ever."""

from __future__ import annotations

import datetime
import threading
import time

import gather_prog
import pytest
from agent_support import on_all

import rpcdist
import rpcdist.torch.rpc as rpc
from rpcdist import RpcOptions
from rpcdist.testing import as_current, local_agents, run_workers

pytestmark = pytest.mark.torch

NAMES = ["worker0", "worker1", "worker2"]


@pytest.fixture(params=["inproc", "tcp"])
def agents(request):
    with local_agents(3, options=RpcOptions(token=None, transport=request.param)) as agents:
        yield agents


def test_all_gather_gives_every_worker_every_object_in_order(agents):
    def program(rank):
        first = rpc.api._all_gather({"rank": rank, "sq": rank * rank})
        second = rpc.api._all_gather(f"round2-{rank}")
        pair = None
        if rank > 0:  # a subset: worker1 leads it
            pair = rpc.api._all_gather(rank * 10, worker_names=["worker2", "worker1"])
        return first, second, pair

    results = on_all(agents, program)
    for rank, (first, second, pair) in enumerate(results):
        assert first == {n: {"rank": r, "sq": r * r} for r, n in enumerate(NAMES)}
        assert second == {n: f"round2-{r}" for r, n in enumerate(NAMES)}
        assert pair == (None if rank == 0 else {"worker1": 10, "worker2": 20})
    assert all(a.statistics()["torch_gather_rounds"] == 0 for a in agents)


def test_barrier_releases_no_worker_before_the_last_arrives(agents):
    arrived: list[int] = []
    lock = threading.Lock()

    def program(rank):
        if rank == 2:
            # The last to arrive: the others must still be inside the barrier.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                with lock:
                    if len(arrived) == 2:
                        break
                time.sleep(0.01)
        with lock:
            arrived.append(rank)
        rpc.api._barrier(NAMES)
        with lock:
            return len(arrived)

    assert on_all(agents, program) == [3, 3, 3]


def test_a_worker_that_never_arrives_fails_the_others_naming_it(agents):
    def program(rank):
        if rank == 2:
            return "absent"
        start = time.monotonic()
        try:
            rpc.api._all_gather(rank, timeout=0.5)
        except rpcdist.RpcTimeoutError as e:
            return str(e), time.monotonic() - start
        return "no error"

    results = on_all(agents, program)
    for msg, elapsed in results[:2]:
        assert "'worker2'" in msg and "did not arrive" in msg
        assert elapsed < 10
    assert agents[0].statistics()["torch_gather_rounds"] == 0


def test_a_lost_worker_fails_the_gather_at_once_not_at_the_timeout(agents):
    with as_current(agents[0]):
        assert rpc.rpc_sync("worker2", max, args=(1, 2)) == 2
    agents[2].shutdown(graceful=False)

    def program(rank):
        start = time.monotonic()
        try:
            rpc.api._all_gather(rank, timeout=60)
        except (rpcdist.WorkerLostError, rpcdist.ConnectError) as e:
            return type(e).__name__, time.monotonic() - start
        return "no error", 0.0

    results = on_all(agents[:2], program, timeout=90)
    for kind, elapsed in results:
        assert kind in ("WorkerLostError", "ConnectError")
        assert elapsed < 30
    assert agents[0].statistics()["torch_gather_rounds"] == 0


def test_the_agent_view_and_the_initialised_check(agents):
    assert rpc._is_current_rpc_agent_set() is False
    with pytest.raises(rpcdist.NotInitializedError):
        rpc._get_current_rpc_agent()

    @rpc.api._require_initialized
    def needs_rpc(x):
        return x + 1

    with pytest.raises(rpcdist.NotInitializedError):
        needs_rpc(1)
    with as_current(agents[1]):
        assert rpc._is_current_rpc_agent_set() is True
        view = rpc._get_current_rpc_agent()
        assert [(w.name, w.id) for w in view.get_worker_infos()] == [
            (n, i) for i, n in enumerate(NAMES)
        ]
        assert view.get_worker_info().name == "worker1"
        assert view.get_worker_info("worker2").id == 2
        assert "pending_calls" in view.get_debug_info()
        assert needs_rpc(1) == 2


def test_set_rpc_timeout_takes_seconds_or_a_timedelta(agents):
    with as_current(agents[0]):
        rpc._set_rpc_timeout(datetime.timedelta(seconds=3))
        assert rpc.get_rpc_timeout() == 3.0
        rpc._set_rpc_timeout(0.25)
        assert rpc.get_rpc_timeout() == 0.25
        with pytest.raises(rpcdist.RpcTimeoutError):
            rpc.rpc_sync("worker1", time.sleep, args=(1,))
        rpc._set_rpc_timeout(0)  # torch's "no timeout"
        assert rpc.get_rpc_timeout() == 0.0
        for bad in (-1, "10", None):
            with pytest.raises(rpcdist.ConfigError, match="_set_rpc_timeout"):
                rpc._set_rpc_timeout(bad)


@pytest.mark.parametrize(
    ("worker_names", "match"),
    [
        (["worker0", "nobody"], "nobody"),
        (["worker1", "worker2"], "not in"),
        ("worker0", "collection of names"),
    ],
)
def test_bad_worker_names_are_refused_before_anything_is_sent(agents, worker_names, match):
    with as_current(agents[0]):
        with pytest.raises(rpcdist.ConfigError, match=match):
            rpc.api._all_gather(1, worker_names=worker_names)
        with pytest.raises(rpcdist.ConfigError, match="timeout"):
            rpc.api._all_gather(1, timeout=-5)
        assert agents[0].statistics().get("torch_gather_rounds", 0) == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_program_using_the_helpers_learns_what_it_learns_under_pytorch_rpc():
    ours = run_workers(gather_prog.run, 3, args=("rpcdist",), timeout=100)
    theirs = run_workers(gather_prog.run, 3, args=("torch",), timeout=100)
    assert ours == theirs
    assert ours[1]["roles"] == {"w0": ("trainer", 0), "w1": ("sampler", 1), "w2": ("sampler", 4)}
    assert ours[2]["pair"] == {"w1": -1, "w2": -2}
    assert [o["me"] for o in ours] == ["w0", "w1", "w2"]
    assert all(o["before"] is False and o["during"] is True and o["after"] is False for o in ours)
