"""RRef API: remote(), RRef(value), to_here, local_value, proxies, errors, directions."""

from __future__ import annotations

import asyncio
import copy
import functools
import pickle

import numpy as np
import pytest
import rref_funcs as rf
from agent_support import frames_in_cycles

import rpcdist
from rpcdist import (
    ClosedError,
    RpcTimeoutError,
    RRef,
    RRefCreationError,
    RRefError,
    SerializationError,
    WorkerInfo,
    WrongThreadError,
)
from rpcdist._serialization import encode
from rpcdist.testing import as_current


def test_remote_returns_at_once_and_to_here_gets_the_value(rrefs2):
    a, b = rrefs2
    with as_current(a):
        rref = rpcdist.remote("worker1", rf.sleep_then, args=(0.2, "v"))
        assert not rref.is_owner() and not rref.confirmed_by_owner()
        assert rref.to_here() == "v"
        assert rref.confirmed_by_owner()
        assert rref.owner() == WorkerInfo("worker1", 1) == rpcdist.get_worker_info("worker1")
        assert hash(rref.owner()) == hash(WorkerInfo("worker1", 1))
        assert rref.owner_name() == "worker1"
        assert rpcdist.remote(1, rf.add, args=(2,), kwargs={"b": 3}).to_here() == 5
        info = rpcdist.get_worker_info("worker1")
        assert rpcdist.remote(info, rf.add, args=(1, 1)).to_here(timeout=5) == 2


def test_local_owner_rref(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        value = {"x": [1, 2]}
        rref = RRef(value)
        assert rref.is_owner() and rref.confirmed_by_owner()
        assert rref.local_value() is value and rref.to_here() is value
        assert rref.owner_name() == "worker0"
        # Sent to a user and back: the owner sees its own value again.
        assert rpcdist.rpc_sync("worker1", rf.echo, args=(rref,)).local_value() is value
        assert rpcdist.rpc_sync("worker1", rf.to_here, args=(rref,)) == value


def test_remote_to_self_is_an_owner_rref(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        rref = rpcdist.remote("worker0", rf.make_counter, args=(3,))
        assert rref.is_owner()
        assert rref.to_here().n == 3 and rref.local_value().n == 3
        assert rref.rpc_sync().incr(2) == 5


def test_local_value_on_a_user_names_user_and_owner(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        rref = rpcdist.remote("worker1", rf.add, args=(1, 2))
        with pytest.raises(RRefError, match="user RRef on worker 'worker0'.*owner 'worker1'"):
            rref.local_value()
        assert rpcdist.rpc_sync("worker1", rf.owner_and_value, args=(rref,)) == (True, 3)


def test_proxies_call_methods_on_the_owner_and_state_persists(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        rref = rpcdist.remote("worker1", rf.make_counter, args=(10,))
        assert rref.rpc_sync().incr(5) == 15
        assert rref.rpc_async().incr().wait() == 16
        assert rref.remote().incr(k=4).to_here() == 20
        assert rref.rpc_sync().get() == 20
        assert rref.to_here().n == 20  # a copy
        assert rref.rpc_sync().twice(21) == 42  # static
        assert rref.rpc_sync().name() == "Counter"  # class
        assert rref.rpc_sync().aincr(2) == 22  # async def method
        assert rref.rpc_sync().later(1) == 2  # @async_execution static method
        assert rref.remote().twice(4).to_here() == 8
        with pytest.raises(KeyError, match="counter failure"):
            rref.rpc_sync().fail()


def test_missing_attribute_raises_at_the_caller_in_all_modes(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        for rref in (rpcdist.remote("worker1", rf.make_counter), RRef(rf.Counter())):
            with pytest.raises(AttributeError, match="has no attribute 'nope'"):
                rref.rpc_sync().nope()
            with pytest.raises(AttributeError, match="has no attribute 'nope'"):
                rref.rpc_async().nope().wait()
            with pytest.raises(AttributeError, match="has no attribute 'nope'"):
                rref.remote().nope()


def test_failed_rref_calls_leave_no_reference_cycles(rrefs2):
    # A failure kept in a Future (or on the owner's record) and raised again
    # gains the raising stack in its traceback; when one of those frames holds
    # the keeper, that is a cycle holding the frames (and the arguments and
    # buffers they refer to) until the garbage collector runs. Each kind of
    # call below used to leave one, at the caller or at the owner.
    a, _ = rrefs2
    with as_current(a):

        def fail(rref: RRef[rf.Counter]) -> None:
            for mode in ("sync", "async", "remote"):
                for call in (lambda p: p.nope(), lambda p: p.incr(1, 2, 3)):
                    with pytest.raises((AttributeError, TypeError)):
                        if mode == "sync":
                            call(rref.rpc_sync())
                        elif mode == "async":
                            call(rref.rpc_async()).wait()
                        else:
                            call(rref.remote()).to_here()
            with pytest.raises(ValueError):
                rpcdist.remote("worker1", rf.raise_value_error, args=("x",)).to_here()

        left = frames_in_cycles(functools.partial(fail, rpcdist.remote("worker1", rf.make_counter)))
    assert left == set()


def test_remote_error_is_kept_on_the_owner_with_its_type(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        rref = rpcdist.remote("worker1", rf.raise_value_error, args=("bad input",))
        for _ in range(2):
            with pytest.raises(ValueError, match="bad input") as ei:
                rref.to_here()
            assert "raise_value_error" in ei.value.remote_traceback
        with pytest.raises(ValueError, match="bad input"):
            rref.rpc_sync().anything()
        with pytest.raises(ValueError, match="bad input"):
            rref.rpc_async().anything().wait()
        with pytest.raises(ValueError, match="bad input"):
            rref.remote().anything()
        assert rref.confirmed_by_owner()
        mine = rpcdist.remote("worker0", rf.raise_value_error, args=("here",))
        with pytest.raises(ValueError, match="here"):
            mine.to_here()
        with pytest.raises(ValueError, match="here"):
            mine.local_value()


def test_timeouts_on_remote_to_here_and_proxies(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        slow = rpcdist.remote("worker1", rf.sleep_then, args=(0.5, 1), timeout=0.1)
        with pytest.raises(RRefCreationError, match="RRef creation") as ei:
            slow.to_here()
        assert isinstance(ei.value.__cause__, RpcTimeoutError)
        with pytest.raises(RRefCreationError):
            slow.rpc_sync().get()
        assert not slow.confirmed_by_owner()
        waits = rpcdist.remote("worker1", rf.sleep_then, args=(0.5, 2))
        with pytest.raises(RpcTimeoutError):
            waits.to_here(timeout=0.1)
        assert waits.to_here() == 2
        counter = rpcdist.remote("worker1", rf.make_counter)
        with pytest.raises(RpcTimeoutError):
            counter.rpc_sync(timeout=0.1).slow(0.5)
        with pytest.raises(RpcTimeoutError):
            counter.rpc_async(timeout=0.1).slow(0.5).wait()
        assert counter.remote(timeout=0.1).slow(0.3) is not None  # returns at once
        mine = rpcdist.remote("worker0", rf.sleep_then, args=(0.5, 3))
        with pytest.raises(RpcTimeoutError):
            mine.to_here(timeout=0.1)


def test_rrefs_nested_in_containers_in_all_four_directions(rrefs3):
    a, _, _ = rrefs3
    with as_current(a):
        user = rpcdist.remote("worker1", rf.make_counter, args=(7,))  # owned by worker1
        mine = RRef(rf.Counter(1))
        payload = {"u": [user, (user,)], "m": {"k": mine}}
        # user -> user (worker0 -> worker2) and owner -> user, then back to their owners.
        back = rpcdist.rpc_sync("worker2", rf.echo, args=(payload,))
        assert back["m"]["k"].local_value() is mine.local_value()  # back to the creator/owner
        assert [r.to_here().n for r in back["u"][0:1] + list(back["u"][1])] == [7, 7]
        # user -> owner: worker1 gets its own value
        assert rpcdist.rpc_sync("worker1", rf.owner_and_value, args=(user,))[0] is True
        got = rpcdist.rpc_sync("worker2", rf.return_twice, args=(user,))
        assert {got["a"].to_here().n, got["b"][1][0].to_here().n} == {7}


def test_rref_of_a_list_of_rrefs(rrefs3):
    a, _, _ = rrefs3
    with as_current(a):
        outer = rpcdist.remote("worker1", rf.nested_rrefs, args=("worker2",))
        assert rpcdist.rpc_sync("worker2", rf.fetch_nested, args=(outer,)) == ["mine", "theirs"]
        inner = outer.to_here().to_here()
        assert [r.to_here() for r in inner] == ["mine", "theirs"]
        assert [r.owner_name() for r in inner] == ["worker1", "worker2"]


def test_async_forms_from_asyncio_and_async_handlers(rrefs3):
    a, _, _ = rrefs3

    async def main():
        with as_current(a):
            rref = rpcdist.remote("worker1", rf.make_counter, args=(1,))
            value = await rref.to_here_async()
            bumped = await rref.rpc_async().incr(1)
            return value.n, bumped

    assert asyncio.run(main()) == (1, 2)
    with as_current(a):
        rref = rpcdist.remote("worker1", rf.make_counter, args=(5,))
        value, bumped = rpcdist.rpc_sync("worker2", rf.async_to_here, args=(rref,))
        assert (value.n, bumped) == (5, 6)

    async def on_loop():
        with as_current(a):
            rref = rpcdist.remote("worker1", rf.add, args=(1, 1))
            with pytest.raises(WrongThreadError):
                rref.to_here()
            with pytest.raises(WrongThreadError):
                rref.rpc_sync().get()
            return await rref.to_here_async()

    assert a.run(on_loop()) == 2


def test_rrefs_cannot_be_pickled_or_encoded_outside_an_rpc(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        rref = RRef(1)
        user = rpcdist.remote("worker1", rf.add, args=(1, 1))
        for r in (rref, user):
            with pytest.raises(RRefError, match="can only be sent as an argument"):
                pickle.dumps(r)
            with pytest.raises(RRefError, match="can only be sent"):
                copy.copy(r)
            with pytest.raises(RRefError, match="part of an RPC|can only be sent"):
                encode([r])
        assert user.to_here() == 2


def test_a_failed_send_leaves_nothing_behind(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        user = rpcdist.remote("worker1", rf.add, args=(1, 1))
        mine = RRef(2)
        with pytest.raises(SerializationError, match=r"args\[2\]"):
            rpcdist.rpc_async("worker1", rf.echo, args=(user, mine, object()))
        with pytest.raises(SerializationError, match=r"args\[1\]"):
            rpcdist.remote("worker1", rf.echo, args=(mine, object()))
        with pytest.raises(SerializationError, match=r"args\[1\]"):
            user.rpc_async().anything(mine, object())
        stats = a.statistics()
        assert stats["rref_pending_children"] == 0 and stats["rref_forks"] == 0


def test_use_after_shutdown_is_a_clear_error(start):
    a, b = start(2)
    with as_current(a):
        user = rpcdist.remote("worker1", rf.add, args=(1, 1))
        assert user.to_here() == 2
        mine = RRef(1)
    a.shutdown(graceful=False)
    b.shutdown(graceful=False)
    for r in (user, mine):
        with pytest.raises(ClosedError, match="shut down"):
            r.to_here()
        with pytest.raises(ClosedError, match="shut down"):
            r.rpc_sync().get()
    with pytest.raises(ClosedError):
        mine.local_value()
    with as_current(a), pytest.raises(rpcdist.NotInitializedError):
        RRef(1)


def test_statistics_count_owners_forks_and_pending(rrefs3):
    a, b, c = rrefs3
    with as_current(a):
        user = rpcdist.remote("worker1", rf.make_counter)
        user.to_here()
        assert b.statistics()["rref_owners"] == 1 and b.statistics()["rref_forks"] == 1
        h = rpcdist.rpc_sync("worker2", rf.keep, args=(user,))
        assert rpcdist.rpc_sync("worker2", rf.stash_to_here, args=(h,)).n == 0
        # worker2 confirmed: worker1 knows two forks, worker0 holds no pending child.
        assert rpcdist.rpc_sync("worker1", rf.wait_for_forks, args=(2,)) == 2
        rpcdist.rpc_sync("worker2", rf.drop, args=(h,))
        assert rpcdist.rpc_sync("worker1", rf.wait_for_forks, args=(1,)) == 1
        del user
        assert rpcdist.rpc_sync("worker1", rf.wait_for_forks, args=(0,)) == 0
    assert b.statistics()["rref_owners"] == 0


def test_remote_of_async_and_async_execution_functions(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        assert rpcdist.remote("worker1", rf.async_make_counter, args=(4,)).to_here().n == 4
        assert rpcdist.remote("worker1", rf.later_counter, args=(5,)).to_here().n == 5
        assert rpcdist.remote("worker0", rf.async_make_counter, args=(6,)).to_here().n == 6
        assert rpcdist.remote("worker1", rf.Counter.later, args=(1,)).to_here() == 2


def test_values_of_every_size_and_several_waiting_to_heres(rrefs2):
    a, _ = rrefs2
    with as_current(a):
        for n in (0, 10, 100_000):  # the small ones come back with remote()'s reply
            rref = rpcdist.remote("worker1", rf.big_array, args=(n, 0.05))
            first, second = rref.to_here_async(), rref.to_here_async()
            x, y = first.wait(10), second.wait(10)
            assert x.shape == (n,) and np.array_equal(x, np.arange(n)) and x is not y
            assert rref.to_here().shape == (n,)
        counter = rpcdist.remote("worker1", rf.make_counter, args=(1,))
        first = counter.to_here_async()
        counter.rpc_sync().incr()
        assert first.wait(10).n in (1, 2) and counter.to_here().n == 2


def test_get_type_asks_the_owner_once_and_remembers(rrefs2):
    # torch's RRef._get_type, which programs use to check what a callee is
    a, _ = rrefs2
    with as_current(a):
        rref = rpcdist.remote("worker1", rf.make_counter, args=(3,))
        assert rref._get_type() is rf.Counter
        sent = a.statistics()["calls_sent"]
        fut = rref._get_type(timeout=-1, blocking=False)  # (torch's "default" timeout)
        assert isinstance(fut, rpcdist.Future) and fut.wait() is rf.Counter
        assert a.statistics()["calls_sent"] == sent  # remembered: no call
        assert RRef([1])._get_type() is list  # an owner RRef answers itself
        assert rpcdist.remote("worker1", rf.add, args=(1, 2))._get_type(timeout=5) is int
        nameless = rpcdist.remote("worker1", rf.of_a_local_class)
        with pytest.raises(rpcdist.SerializationError, match="cannot send class .*Here"):
            nameless._get_type()
        failed = rpcdist.remote("worker1", rf.raise_value_error, args=("no value",))
        with pytest.raises(ValueError, match="no value"):
            failed._get_type()
