"""The races of RREF_PROTOCOL.md, made deterministic with the fault-injection hook."""

from __future__ import annotations

import gc
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import rref_funcs as rf
from agent_support import until
from rref_support import settle

import rpcdist
from rpcdist import RRef
from rpcdist.testing import FaultInjector, as_current

_tokens = itertools.count(1000)


def _freed(token: int, agents, timeout: float = 10.0) -> bool:
    settle(agents, timeout)
    return not rf.alive(token)


def _made_then_freed(token: int, agents) -> bool:
    """The owner made the value of ``token`` (a late creation ran) and then let
    it go: at once, not at the garbage collector's next run."""
    made = until(lambda: token in rf.LIVE)
    return made and until(lambda: not rf.alive(token)) and _freed(token, agents)


def test_fork_chain_whose_last_delete_arrives_first(start):
    # owner O -> A -> Y -> Z; Y's fork request is delayed, so Z's fork request
    # and Z's delete reach O first. A must still be known (it holds its RRef
    # until Y is confirmed), so the value survives.
    y_faults = FaultInjector()
    y_faults.add("rref.fork_request", "delay", delay=1.0)  # (and no retry meanwhile)
    agents = start(4, faults=[None, None, y_faults, None], intervals=[0.05, 0.05, 5.0, 0.05])
    o = agents[0]
    token = next(_tokens)
    with as_current(o):
        mine = RRef(rf.Tracked(token))
        h_a = rpcdist.rpc_sync("worker1", rf.keep, args=(mine,))
        del mine  # only forks keep the value alive now
        gc.collect()
        pending_on_y, forks, y_confirmed = rpcdist.rpc_sync(
            "worker2", rf.relay_and_report, args=("worker1", h_a, "worker3", "worker0")
        )
    assert pending_on_y == 1 and not y_confirmed  # Y's fork request still in flight
    assert forks == 1  # Z came and went; A's fork is still known
    assert rf.alive(token)
    assert y_faults.log == [("rref.fork_request", "delay")]
    assert _freed(token, agents)


def test_fork_before_the_owner_ran_the_function_parks_later_messages(start):
    # remote() from A is delayed; A forwards the RRef A -> Y -> Z, whose fork
    # requests and to_here reach the owner first: it parks them.
    a_faults = FaultInjector()
    a_faults.add("rref.remote", "delay", delay=0.4)
    agents = start(4, faults=[None, a_faults, None, None])
    with as_current(agents[1]):
        rref = rpcdist.remote("worker0", rf.make_counter, args=(3,))
        t0 = time.monotonic()
        got = rpcdist.rpc_sync("worker2", rf.forward, args=(rref, "worker3"))
        elapsed = time.monotonic() - t0
        assert got == rf.Counter(3) and elapsed >= 0.3
        assert rref.to_here() == rf.Counter(3) and rref.confirmed_by_owner()


def test_rref_passed_back_to_its_owner_survives_its_temporary_copy(rrefs2):
    token = next(_tokens)
    with as_current(rrefs2[0]):
        rref = rpcdist.remote("worker1", rf.make_tracked, args=(token,))
        assert rref.rpc_sync().get_token() == token
        fut = rpcdist.rpc_async("worker1", rf.forks_then_token, args=(rref,))
        del rref  # worker0's copy dies while the call is on its way
        gc.collect()
        forks, got = fut.wait(10)
        # Its fork outlived it: the owner confirms a fork that came back to it
        # in the call's reply, and only then may the sender let go (G2).
        assert (forks, got) == (1, token)
        assert rrefs2[1].statistics()["rref_control_messages"] == 0  # the owner sent none
    assert _freed(token, rrefs2)


def test_owner_confirms_by_control_message_when_the_function_raises(rrefs2):
    token = next(_tokens)
    with as_current(rrefs2[0]):
        rref = rpcdist.remote("worker1", rf.make_tracked, args=(token,))
        assert rref.rpc_sync().get_token() == token
        with pytest.raises(ValueError, match="no"):
            rpcdist.rpc_sync("worker1", rf.raise_value_error_with, args=(rref, "no"))
        del rref
    assert _freed(token, rrefs2)  # only once the owner's accept came may the copy go
    assert rrefs2[1].statistics()["rref_control_messages"] >= 1  # and it came as a message


def test_owner_confirms_by_control_message_when_the_reply_is_lost(start):
    owner_faults = FaultInjector()
    owner_faults.add("reply:rref_funcs:forks_then_token", "drop")
    agents = start(2, faults=[None, owner_faults])
    token = next(_tokens)
    with as_current(agents[0]):
        rref = rpcdist.remote("worker1", rf.make_tracked, args=(token,))
        assert rref.rpc_sync().get_token() == token
        with pytest.raises(rpcdist.RpcTimeoutError):
            rpcdist.rpc_sync("worker1", rf.forks_then_token, args=(rref, 0.0), timeout=1.0)
        del rref
    assert owner_faults.log == [("reply:rref_funcs:forks_then_token", "drop")]
    assert _freed(token, agents)  # the confirmation came as a message: the fork was deleted


def test_sender_waits_for_the_owners_confirmation_not_the_return_value(start):
    y_faults = FaultInjector()
    y_faults.add("rref.fork_request", "delay", delay=0.6)  # (and no retry meanwhile)
    agents = start(3, faults=[None, None, y_faults], intervals=[0.05, 0.05, 5.0])
    o, a, y = agents
    token = next(_tokens)
    with as_current(o):
        mine = RRef(rf.Tracked(token))
        h_a = rpcdist.rpc_sync("worker1", rf.keep, args=(mine,))
        del mine
        h_fwd = rpcdist.rpc_sync("worker1", rf.keep, args=(0,))  # a spare handle
        assert (
            rpcdist.rpc_sync("worker1", rf.forward_async_and_drop, args=(h_a, "worker2")) == "sent"
        )
    # The call returned, worker1 dropped its RRef, but still holds it for Y.
    gc.collect()
    assert a.statistics()["rref_pending_children"] == 1
    assert o.statistics()["rref_forks"] == 1 and rf.alive(token)
    settle([a])  # Y confirmed: worker1 lets go
    assert a.statistics()["rref_pending_children"] == 0 and rf.alive(token)
    with as_current(o):
        rpcdist.rpc_sync("worker1", rf.drop, args=(h_fwd,))
    rf.clear()
    assert _freed(token, agents)


def test_rref_forwarded_through_eight_nested_remote_hops(rrefs4):
    a = rrefs4[0]
    with as_current(a):
        rref = rpcdist.remote("worker1", rf.make_counter, args=(1,))
        names = ["worker2", "worker3", "worker0", "worker1", "worker2", "worker3", "worker0"]
        got = rpcdist.remote("worker1", rf.hop, args=(rref, names)).to_here(timeout=20)
    assert got == rf.Counter(1)


def test_twenty_concurrent_nested_round_trips(rrefs3):
    a = rrefs3[0]

    def one(i: int):
        with as_current(a):
            rref = rpcdist.remote("worker1", rf.make_counter, args=(i,))
            back = rpcdist.rpc_sync("worker2", rf.return_twice, args=([rref, {"k": rref}],))
            refs = [back["a"][0], back["a"][1]["k"], back["b"][0][0], back["b"][1][0][1]["k"]]
            return [r.to_here().n for r in refs]

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    assert results == [[i] * 4 for i in range(20)]


@pytest.mark.parametrize("action", ["drop", "delay"])
def test_control_messages_lost_or_late_still_converge(start, action):
    faults = []
    for _ in range(3):
        f = FaultInjector()
        for kind in ("rref.fork_request", "rref.child_accept", "rref.user_delete"):
            f.add(kind, action, delay=0.15)
            f.add("reply:" + kind, action, nth=2, delay=0.15)
        faults.append(f)
    agents = start(3, faults=faults)
    token = next(_tokens)
    with as_current(agents[0]):
        rref = rpcdist.remote("worker1", rf.make_tracked, args=(token,))
        h = rpcdist.rpc_sync("worker2", rf.keep, args=(rref,))  # user -> user
        assert rpcdist.rpc_sync("worker2", rf.stash_token, args=(h,)) == token
        again = rpcdist.rpc_sync("worker2", rf.take, args=(h,))  # and back
        assert again.owner_name() == "worker1"
        rpcdist.rpc_sync("worker2", rf.drop, args=(h,))
        del rref, again
    assert _freed(token, agents)
    assert all(("rref.user_delete", action) in f.log for f in faults[:1])
    assert any(("rref.fork_request", action) in f.log for f in faults)
    assert any(("rref.child_accept", action) in f.log for f in faults)


def test_slow_creation_after_remote_timed_out_is_freed(rrefs2):
    token = next(_tokens)
    with as_current(rrefs2[0]):
        rref = rpcdist.remote("worker1", rf.make_tracked, args=(token, 0.4), timeout=0.1)
        with pytest.raises(rpcdist.RRefCreationError):
            rref.to_here()
        del rref  # its abandon-delete reaches the owner while it still runs the function
        gc.collect()  # (the error's traceback holds the RRef in a cycle)
    assert _made_then_freed(token, rrefs2)


def test_remote_arriving_after_its_abandon_creates_nothing(start):
    a_faults = FaultInjector()
    a_faults.add("rref.remote", "delay", delay=0.4)
    owner_faults = FaultInjector()
    owner_faults.add("error:*", "delay", delay=0.0)  # passes it on at once, and logs it
    agents = start(2, faults=[a_faults, owner_faults])
    token = next(_tokens)
    with as_current(agents[0]):
        rref = rpcdist.remote("worker1", rf.make_tracked, args=(token,), timeout=0.1)
        with pytest.raises(rpcdist.RRefCreationError):
            rref.to_here()
        del rref
        gc.collect()
    # The late request reaches the owner past its deadline, which refuses it.
    assert until(lambda: owner_faults.log), "the owner never answered the late remote()"
    assert owner_faults.log[0][0].startswith("error:")
    assert _freed(token, agents)
    assert token not in rf.LIVE
    assert agents[1].statistics()["rref_tombstones"] <= 1
