"""The RRef state machine alone: no agents, no loop, no I/O."""

from __future__ import annotations

import gc

import pytest

from rpcdist import RRefCreationError
from rpcdist._rref._protocol import (
    ABSENT,
    CREATING,
    FAILED,
    FRESH_START,
    READY,
    Ids,
    OwnerTable,
    UserTable,
)


class FakeRRef:
    def __init__(self, owner: int = 0) -> None:
        self._owner = owner
        self._state = 0
        self._error: BaseException | None = None


def test_ids_are_unique_per_worker():
    ids = Ids(3)
    got = {ids.new() for _ in range(100)}
    assert len(got) == 100 and {r for r, _ in got} == {3}


def test_a_fixed_jobs_ids_start_at_0_and_a_dynamic_groups_do_not_repeat():
    assert [Ids(0).new() for _ in range(2)] == [(0, 0), (0, 0)]  # torch's first local_id
    # a process taking a lost one's rank (a dynamic group) starts elsewhere
    starts = {Ids(1, fresh=True).new() for _ in range(50)}
    assert len(starts) == 50 and all(r == 1 and 0 <= n < FRESH_START for r, n in starts)


def test_value_lives_while_any_fork_is_known():
    t = OwnerTable()
    rec = t.local((0, 1), "v")
    t.add_fork(rec, (0, 2), holder=1)
    t.add_fork(rec, (1, 5), holder=2)
    assert t.statistics() == {"rref_owners": 1, "rref_forks": 2, "rref_tombstones": 0}
    assert t.remove_fork((0, 1), (0, 2)) is None
    assert t.remove_fork((0, 1), (0, 2)) is None  # idempotent
    assert t.remove_fork((0, 1), (1, 5)) is rec  # the last one: no longer live
    assert t.statistics()["rref_owners"] == 0
    assert t.find((0, 1)) is rec  # still known while something (here: us) holds it
    del rec
    gc.collect()
    assert t.find((0, 1)) is None


def test_records_made_before_creation_are_adopted_by_it():
    t = OwnerTable()
    early = t.record((4, 1))  # a fork request or to_here arrived first
    assert early.state == ABSENT and not early.ready.done()
    t.add_fork(early, (2, 9), holder=2)
    rec = t.begin_creation((4, 1), (4, 2), holder=4)
    assert rec is early and rec.state == CREATING and set(rec.forks) == {(2, 9), (4, 2)}
    t.finish_creation(rec, value=42)
    assert rec.ready.done() and rec.get() == 42 and rec.state == READY
    t.finish_creation(rec, error=ValueError("late"))  # the first outcome wins
    assert rec.get() == 42


def test_creation_error_is_kept_and_raised_each_time():
    t = OwnerTable()
    rec = t.begin_creation((1, 1), (1, 2), holder=1)
    try:
        raise KeyError("boom")
    except KeyError as e:
        t.finish_creation(rec, error=e)
    assert rec.state == FAILED
    for _ in range(2):
        with pytest.raises(KeyError, match="boom"):
            rec.get()


def test_finished_creation_without_forks_is_not_live():
    t = OwnerTable()
    rec = t.begin_creation((1, 1), None, holder=1)  # remote() to self
    assert t.statistics()["rref_owners"] == 0
    assert t.finish_creation(rec, value=1) is None
    rec2 = t.begin_creation((1, 3), (1, 4), holder=1)
    assert t.remove_fork((1, 3), (1, 4)) is rec2  # the creator let go while it ran
    assert t.finish_creation(rec2, value=2) is None and t.statistics()["rref_owners"] == 0


def test_abandon_before_creation_leaves_a_tombstone_that_the_creation_consumes():
    t = OwnerTable()
    t.remove_fork((2, 1), (2, 2), abandon=True)  # the creator's remote() timed out
    assert t.statistics()["rref_tombstones"] == 1
    rec = t.record((2, 1))  # anything waiting for it fails at once
    assert rec.ready.done() and rec.state == FAILED
    with pytest.raises(RRefCreationError, match="never created"):
        rec.get()
    again = t.begin_creation((2, 1), (2, 2), holder=2)  # arrives late after all
    assert not again.forks and t.statistics() == {
        "rref_owners": 0,
        "rref_forks": 0,
        "rref_tombstones": 0,
    }


def test_abandon_of_a_placeholder_fails_its_waiters():
    t = OwnerTable()
    rec = t.record((2, 1))
    t.remove_fork((2, 1), (2, 2), abandon=True)
    assert rec.ready.done() and isinstance(rec.error, RRefCreationError)


def test_abandon_after_creation_is_a_plain_delete():
    t = OwnerTable()
    rec = t.begin_creation((2, 1), (2, 2), holder=2)
    t.finish_creation(rec, value="x")
    assert t.remove_fork((2, 1), (2, 2), abandon=True) is rec
    assert t.statistics()["rref_tombstones"] == 0


def test_tombstones_expire():
    now = [0.0]
    t = OwnerTable(tombstone_ttl=10, clock=lambda: now[0])
    t.remove_fork((2, 1), (2, 2), abandon=True)
    now[0] = 11
    t.remove_fork((3, 1), (3, 2), abandon=True)  # purges the old one
    assert t.statistics()["rref_tombstones"] == 1


def test_forget_holder_drops_the_forks_of_a_lost_worker():
    t = OwnerTable()
    rec = t.local((0, 1), "v")
    t.add_fork(rec, (0, 2), holder=1)
    t.add_fork(rec, (1, 3), holder=1)
    other = t.local((0, 4), "w")
    t.add_fork(other, (0, 5), holder=2)
    assert t.forget_holder(1) == [rec]
    assert t.leftovers() == [((0, 4), [2])]


def test_user_table_pending_confirm_and_children():
    u = UserTable()
    r, parent = FakeRRef(owner=0), FakeRRef(owner=0)
    u.add_pending((1, 1), r, 2)
    u.add_child((1, 7), parent)
    assert u.busy() and u.pending_of(0) == [(1, 1)] and u.children_of(0) == [(1, 7)]
    assert u.settle((1, 1), 1) == (r, 2) and r._state == 1
    assert u.settle((1, 1), 1) is None  # once only
    assert u.accept_child((1, 7)) is parent and u.accept_child((1, 7)) is None
    assert not u.busy()
    assert u.statistics() == {"rref_pending_users": 0, "rref_pending_children": 0, "rref_users": 1}
    assert u.live_users() == [r]
    err = RuntimeError("x")
    u.add_pending((1, 2), FakeRRef(), None)
    rr, _ = u.settle((1, 2), 2, err)
    assert rr._error is err
    del r, rr
    gc.collect()
    assert u.statistics()["rref_users"] == 0  # confirmed users are held weakly
