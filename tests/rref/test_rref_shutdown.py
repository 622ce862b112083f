"""Graceful shutdown drains RRefs and reports leaks; multi-process RRef use."""

from __future__ import annotations

import dataclasses
import os

import pytest
import rref_funcs as rf
import rref_mp
from rref_support import options

import rpcdist
from rpcdist import ClosedError, RRef, RRefError
from rpcdist.testing import as_current, local_agents, run_workers


def test_graceful_shutdown_drains_users_and_children_then_owners():
    with local_agents(3, options=[options() for _ in range(3)], graceful=True) as agents:
        a = agents[0]
        with as_current(a):
            user = rpcdist.remote("worker1", rf.make_counter, args=(1,))
            mine = RRef(rf.Counter(2))
            rpcdist.rpc_sync("worker2", rf.keep, args=(user,))  # held on worker2
            rpcdist.rpc_sync("worker1", rf.keep, args=(mine,))  # held on worker1
            rpcdist.rpc_async("worker2", rf.keep, args=(user,))  # still in flight
            assert user.to_here() == rf.Counter(1)
    # Every worker released its users; every owner drained; no leak was reported.
    for ag in agents:
        stats = ag.statistics()
        assert stats["rref_owners"] == stats["rref_forks"] == stats["rref_pending_users"] == 0
    for r in (user, mine):
        with pytest.raises(ClosedError, match="shut down"):
            r.to_here()
    rf.clear()


@pytest.mark.parametrize("ignore", [False, True])
def test_a_leaked_rref_is_reported_unless_ignored(ignore):
    opts = [dataclasses.replace(options(), ignore_rref_leaks=ignore) for _ in range(2)]
    with as_current_leak_check(ignore):
        with local_agents(2, options=opts, graceful=True, shutdown_timeout=10) as (a, _):
            with as_current(a):  # worker1 drops its RRef but its delete is lost
                assert rpcdist.rpc_sync("worker1", rf.lose, args=(RRef(rf.Counter(1)),))


class as_current_leak_check:
    def __init__(self, ignore: bool) -> None:
        self.ignore = ignore

    def __enter__(self) -> None:
        pass

    def __exit__(self, et, e, tb) -> bool:
        if self.ignore:
            return False
        assert isinstance(e, RRefError), e
        assert "leaked" in str(e) and "worker1" in str(e) and "ignore_rref_leaks" in str(e)
        return True


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_three_processes_share_rrefs_and_shut_down_clean():
    results = run_workers(rref_mp.share_and_shut_down, 3, timeout=90)
    out, _ = results[0]
    assert out == (1, 3, 3, "w1", True, 5)
    for _, stats in results:
        assert stats == dict.fromkeys(stats, 0)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_owner_killed_gives_owner_lost_within_the_deadline():
    outcomes = run_workers(rref_mp.owner_killed, 2, timeout=90, allow_exit={1})[0]
    for what, outcome, elapsed in outcomes:
        assert outcome == "OwnerLostError", (what, outcome)
        assert elapsed < 5.5, (what, elapsed)
    assert os.getpid()
