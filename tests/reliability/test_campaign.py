"""The fault campaign (``benchmarks/bench_reliability.py``), small: one fault
per kind of job, injected from outside, and every survivor ends with a typed
error in time; never a hang.

SIGSTOP and a dropped link in the collectives (DDP, FSDP) are left to the
benchmark's full campaign, which reports them as they are.
"""

from __future__ import annotations

import campaign
import pytest

#: One trial per kind of job: (kind, fault).
SMALL = [
    ("rpc", "SIGSTOP"),
    ("rref", "SIGSTOP"),
    ("autograd", "linkdrop"),
    ("ddp", "SIGKILL"),
    ("fsdp", "SIGKILL"),
]


def test_the_plan_is_seeded_covers_every_pair_and_spares_the_observer():
    first = campaign.plan(15, seed=38)
    assert first == campaign.plan(15, seed=38)
    assert first != campaign.plan(15, seed=39)
    assert {(k, f) for k, f, _ in first} == {
        (k, f) for k in campaign.KINDS for f in campaign.FAULTS
    }
    assert {v for _, _, v in campaign.plan(100, seed=38)} == {1, 2}


def test_the_summary_counts_hangs_untyped_errors_and_times_by_fault():
    ok = campaign.Trial(
        "rpc",
        "SIGKILL",
        1,
        True,
        {0: ("error", "WorkerLostError", 0.01), 2: ("error", "WorkerLostError", 0.02)},
    )
    hung = campaign.Trial(
        "ddp", "SIGSTOP", 2, True, {0: ("error", "CollectiveError", 4.0)}, hung=[1]
    )
    odd = campaign.Trial(
        "rref",
        "linkdrop",
        1,
        True,
        {0: ("error", "KeyError", 3.0), 2: ("completed", "", 9.0)},
        untyped=[0],
    )
    s = campaign.summarize([ok, hung, odd])
    assert s["kinds"]["rpc"] == {"trials": 1, "hangs": 0, "untyped": 0, "failed": 0, "completed": 0}
    assert s["kinds"]["ddp"]["hangs"] == 1 and s["kinds"]["rref"]["untyped"] == 1
    assert s["kinds"]["rref"]["completed"] == 1
    assert s["times"] == {"SIGKILL": [0.01, 0.02], "SIGSTOP": [4.0], "linkdrop": [3.0]}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("kind", "fault"), SMALL, ids=[f"{k}-{f}" for k, f in SMALL])
def test_a_fault_mid_work_ends_every_survivor_with_a_typed_error(kind, fault):
    t = campaign.trial(kind, fault, victim=1 if kind in ("rpc", "ddp", "fsdp") else 2)
    assert t.injected and not t.failed, t
    assert t.hung == [], t
    assert t.untyped == [], t
    survivors = {0, 1, 2} - {t.victim}
    assert set(t.survivors) == survivors, t
    for outcome, error, took in t.survivors.values():
        assert outcome == "error" and error, t
        assert 0 <= took < campaign.CAP, t
