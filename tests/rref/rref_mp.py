"""Worker entry points for multi-process RRef tests (importable by spawned children)."""

from __future__ import annotations

import gc
import time

import rref_funcs as rf

import rpcdist
from rpcdist._rpc._context import current_agent

_GAUGES = ("rref_owners", "rref_forks", "rref_pending_users", "rref_pending_children")


def share_and_shut_down(rank, world_size, init_method):
    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init_method, rpc_timeout=30)
    agent = current_agent()
    out = None
    try:
        if rank == 0:
            rref = rpcdist.remote("w1", rf.make_counter, args=(1,))
            got = rpcdist.rpc_sync("w2", rf.forward, args=(rref, "w1"))  # user->user->owner
            bumped = rref.rpc_sync().incr(2)
            back = rpcdist.rpc_sync("w2", rf.return_twice, args=(rref,))["b"][1][0]
            kept = rpcdist.rpc_sync("w2", rf.keep, args=(rpcdist.RRef(rf.Counter(9)),))
            mine = rpcdist.RRef(rf.Counter(5))
            out = (got.n, bumped, back.to_here().n, back.owner_name(), kept > 0, mine.to_here().n)
            del rref, back, got
            gc.collect()
    finally:
        rpcdist.shutdown()  # graceful: raises if an RRef leaked
    stats = agent.statistics()
    return out, {k: stats.get(k, 0) for k in _GAUGES}


def owner_killed(rank, world_size, init_method):
    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init_method, rpc_timeout=30)
    if rank == 1:
        while True:  # serve until rank 0 makes us crash
            time.sleep(0.1)
    rref = rpcdist.remote("w1", rf.make_counter, args=(3,))
    assert rref.to_here(timeout=10) == rf.Counter(3)
    slow = rref.rpc_async(timeout=20).slow(5)  # in flight when the owner dies
    time.sleep(0.2)
    rpcdist.rpc_async("w1", rf.crash)
    outcomes = []
    for what in ("in flight", "to_here", "rpc_sync", "remote"):
        start = time.monotonic()
        try:
            if what == "in flight":
                slow.wait()
            elif what == "to_here":
                rref.to_here(timeout=5)
            elif what == "rpc_sync":
                rref.rpc_sync(timeout=5).get()
            else:
                rpcdist.remote("w1", rf.add, args=(1, 1), timeout=5).to_here()
            outcomes.append((what, "no error", time.monotonic() - start))
        except rpcdist.OwnerLostError as e:
            outcomes.append((what, type(e).__name__, time.monotonic() - start))
        except Exception as e:
            outcomes.append((what, f"{type(e).__name__}: {e}", time.monotonic() - start))
    rpcdist.shutdown(graceful=False)
    return outcomes
