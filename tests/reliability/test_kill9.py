"""Kill -9 at random points: no hang, typed errors, graceful shutdowns on the survivors.

Fifty trials of three worker processes each. In every trial one worker (any
rank, rank 0 and its store included) kills itself with SIGKILL at a seeded
random moment of one scenario: inside a call it is serving, in the middle of
a burst of calls both ways, during a stream of all_reduces, while RRefs it
owns and holds are in use, or during the graceful shutdown itself. The
survivors must see only typed errors naming a lost peer, and their graceful
shutdown must finish (its bound is 10 s: a stall would raise) and name the
dead worker. Two trials run at a time.
"""

from __future__ import annotations

import concurrent.futures
import random

import harness
import pytest
import rel_workers as rw

pytestmark = pytest.mark.multiprocess

TRIALS = 50


def _plan(n: int) -> list[tuple[str, int, int]]:
    rnd = random.Random(16)
    return [(rw.SCENARIOS[i % len(rw.SCENARIOS)], rnd.randrange(3), 1000 + i) for i in range(n)]


def _trial(scenario: str, victim: int, seed: int) -> tuple[str, int, harness.JobResult]:
    survivors = {0, 1, 2} - {victim}
    res = harness.run_job(rw.kill_trial, 3, (scenario, victim, seed), timeout=60, expect=survivors)
    return scenario, victim, res


@pytest.mark.timeout(600)
def test_fifty_kill9_trials_leave_no_hang_and_survivors_shut_down_gracefully():
    plan = _plan(TRIALS)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda p: _trial(*p), plan))
    assert len(outcomes) == TRIALS
    for scenario, victim, res in outcomes:
        where = f"{scenario}, victim rank {victim}"
        survivors = {0, 1, 2} - {victim}
        assert not res.hung, f"{where}: ranks {res.hung} hung"
        assert not res.errors, f"{where}: {res.errors}"
        # (The victim reports too if it finished its shutdown before its kill.)
        assert survivors <= set(res.values), f"{where}: reports from {sorted(res.values)}"
        for rank in survivors:
            v = res.values[rank]
            lost = set(v["lost"])
            assert res.exitcodes[rank] == 0, f"{where}: rank {rank} exit {res.exitcodes[rank]}"
            assert set(v["errors"]) <= rw.LOST_ERRORS, f"{where}: rank {rank}: {v['errors']}"
            if victim == 0 and res.exitcodes[0] == -9 and scenario != "during-shutdown":
                # Without rank 0's store the survivors cannot coordinate: one
                # that finished first looks lost to the others.
                assert "w0" in lost and lost <= {"w0", "w1", "w2"} - {f"w{rank}"}, (where, lost)
            elif res.exitcodes[victim] == -9 and scenario != "during-shutdown":
                assert lost == {f"w{victim}"}, f"{where}: rank {rank} lost {v['lost']}"
            else:  # it may have finished its shutdown before dying
                assert lost <= {"w0", "w1", "w2"} - {f"w{rank}"}, f"{where}: rank {rank}: {lost}"
                if victim != 0:
                    assert lost <= {f"w{victim}"}, f"{where}: rank {rank}: {lost}"
        if scenario in ("mid-call", "rref-held", "mid-collective") and res.exitcodes[victim] == -9:
            # The survivors used what died: they saw it fail, typed.
            assert all(res.values[r]["errors"] for r in survivors), where
    assert sum(res.exitcodes[victim] == -9 for _, victim, res in outcomes) >= TRIALS * 3 // 4
