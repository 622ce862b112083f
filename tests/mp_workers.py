"""Worker entry points for multi-process tests (importable by spawned children)."""

from __future__ import annotations

import time

import rpc_funcs as rf

import rpcdist


def ring_and_shutdown(rank, world_size, init_method):
    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init_method, rpc_timeout=30)
    try:
        nxt = f"w{(rank + 1) % world_size}"
        got = rpcdist.rpc_sync(nxt, rf.add, args=(rank, 100))
        pid_other = rpcdist.rpc_sync(nxt, rf.pid)
        chained = rpcdist.rpc_sync(
            nxt, rf.nested_add, args=(f"w{(rank + 2) % world_size}", rank, 1)
        )
        return got, pid_other, chained
    finally:
        rpcdist.shutdown()


def survive_dead_peer(rank, world_size, init_method):
    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init_method, rpc_timeout=30)
    if rank == 1:
        # Serve until rank 0 makes us crash.
        while True:
            time.sleep(0.1)
    start = time.monotonic()
    try:
        rpcdist.rpc_sync("w1", rf.crash, timeout=20)
        outcome = "no error"
    except (rpcdist.WorkerLostError, rpcdist.ConnectError) as e:
        outcome = type(e).__name__
    elapsed = time.monotonic() - start
    try:
        rpcdist.rpc_sync("w1", rf.no_args, timeout=5)
        after = "no error"
    except (rpcdist.WorkerLostError, rpcdist.ConnectError, rpcdist.RpcTimeoutError) as e:
        after = type(e).__name__
    rpcdist.shutdown(graceful=False)
    return outcome, elapsed, after


def duplicate_name(rank, world_size, init_method):
    try:
        rpcdist.init_rpc("same", rank, world_size, init_method=init_method, rpc_timeout=10)
    except rpcdist.ConfigError as e:
        return str(e)
    rpcdist.shutdown(graceful=False)
    return "initialised"
