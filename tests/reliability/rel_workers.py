"""Worker bodies of the multi-process fault tests (run by ``harness.run_job``)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import numpy as np
import rel_funcs as rf

import rpcdist

#: Every scenario of the kill -9 trials.
SCENARIOS = ("mid-call", "mid-burst", "mid-collective", "rref-held", "during-shutdown")
#: What a survivor's calls may fail with when a peer dies under them.
LOST_ERRORS = {"WorkerLostError", "OwnerLostError", "CollectiveError"}


def _kill_me_after(seconds: float) -> None:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()


def _options(**kw: Any) -> rpcdist.RpcOptions:
    return rpcdist.RpcOptions(shutdown_timeout=10, **kw)


def kill_trial(
    rank: int, world_size: int, init: str, scenario: str, victim: int, seed: int
) -> dict[str, Any]:
    """One kill -9 trial: ``victim`` dies (SIGKILL, by its own hand, at a
    seeded random moment) during ``scenario``; the others report what their
    calls raised and how their graceful shutdown went."""
    rnd = random.Random(seed * 31 + rank)
    rpcdist.init_rpc(
        f"w{rank}", rank, world_size, init_method=init, rpc_timeout=20, options=_options()
    )
    me = rank == victim
    others = [r for r in range(world_size) if r != rank]
    # Every rank is past init_rpc before anyone dies. (Not waiting for the
    # victim's replies: it may die right after its last handler ran.)
    readies = {r: rpcdist.rpc_async(r, rf.ready) for r in others}
    for r, f in readies.items():
        if r != victim:
            f.wait()
    rf.wait_ready(len(others))
    errors: list[str] = []
    delay = rnd.uniform(0.0, 0.05)

    def attempt(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except rpcdist.RpcdistError as e:
            errors.append(type(e).__name__)
            return None

    if scenario == "mid-call":
        if not me:  # the victim dies inside the call, after a random pause
            attempt(rpcdist.rpc_sync, victim, rf.die_after, (delay,))
    elif scenario == "mid-burst":
        if me:
            _kill_me_after(delay)
        futs = [
            rpcdist.rpc_async(r, rf.echo, args=(np.arange(rnd.randrange(1, 5000)),))
            for _ in range(100)
            for r in others
        ]
        for f in futs:
            attempt(f.wait)
    elif scenario == "mid-collective":
        from rpcdist import collectives as dist

        # (The victim may finish its setup and die while a survivor is still
        # in its own: then the survivor's setup fails, with a typed error.)
        attempt(
            dist.init_process_group, init_method=init, rank=rank, world_size=world_size, timeout=20
        )
        joined = not errors
        if me:
            _kill_me_after(delay)
        buf = np.ones(1000, dtype=np.float32)
        deadline = time.monotonic() + 10.0  # the victim dies long before
        while joined and time.monotonic() < deadline:
            buf[:] = 1
            if attempt(dist.all_reduce, buf) is None and errors:
                break
        if joined:
            dist.destroy_process_group()
    elif scenario == "rref-held":
        owner = others[0] if me else victim
        rref = rpcdist.remote(owner, rf.ones, args=(16,))
        attempt(rref.to_here)
        rpcdist.rpc_sync(rank, rf.add, args=(1, 1))  # a local call: everyone holds an RRef now
        if me:
            _kill_me_after(delay)
        else:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and attempt(rref.to_here) is not None:
                time.sleep(0.002)  # use the RRef until its owner is gone
        del rref
    elif scenario == "during-shutdown":
        if me:
            _kill_me_after(delay)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    if me and scenario != "during-shutdown":
        time.sleep(30)  # the kill comes first
    if victim in readies:
        attempt(readies[victim].wait)
    started = time.monotonic()
    lost = rpcdist.shutdown()
    return {
        "errors": sorted(set(errors)),
        "lost": [w.name for w in lost],
        "shutdown_s": time.monotonic() - started,
    }


def sigstop_job(
    rank: int, world_size: int, init: str, interval: float, peer_timeout: float
) -> dict[str, Any]:
    """Rank 2 is stopped (SIGSTOP) by rank 0 once every rank has called it;
    ranks 0 and 1 then make calls without a deadline to it, and use an RRef
    it owns: each must fail, typed, once the detector declares it lost."""
    opts = _options(heartbeat_interval=interval, peer_timeout=peer_timeout)
    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init, rpc_timeout=None, options=opts)
    if rank == 2:
        time.sleep(60)  # stopped meanwhile, then killed by the test
        return {}
    rref = rpcdist.remote(2, rf.ones, args=(8,))
    rref.to_here()
    pid = rpcdist.rpc_sync(2, rf.pid)
    rpcdist.rpc_sync(1 - rank, rf.ready)  # both survivors are done with rank 2
    rf.wait_ready(1)
    if rank == 0:
        os.kill(pid, signal.SIGSTOP)
        rpcdist.rpc_sync(1, rf.set_event)
    elif not rf.EVENT.wait(30):
        raise RuntimeError("rank 0 never stopped rank 2")
    out: dict[str, Any] = {"pid": pid}
    started = time.monotonic()
    for what, call in (
        ("rpc_sync", lambda: rpcdist.rpc_sync(2, rf.add, args=(1, 2), timeout=None)),
        ("rpc_async", lambda: rpcdist.rpc_async(2, rf.add, args=(1, 2), timeout=None).wait()),
        ("to_here", lambda: rref.to_here(timeout=None)),
    ):
        try:
            call()
            out[what] = "returned"
        except rpcdist.RpcdistError as e:
            out[what] = type(e).__name__
            out[what + "_message"] = str(e)
    out["detected_s"] = time.monotonic() - started
    out["survivor_call"] = rpcdist.rpc_sync(1 - rank, rf.add, args=(2, 2), timeout=10)
    rref = None  # released before the shutdown
    out["lost"] = [w.name for w in rpcdist.shutdown()]
    return out


def grpc_kill_job(rank: int, world_size: int, init: str) -> dict[str, Any]:
    """On the gRPC transport, rank 1 is killed inside a call from rank 0."""
    rpcdist.init_rpc(
        f"w{rank}",
        rank,
        world_size,
        init_method=init,
        rpc_timeout=20,
        options=_options(transport="grpc"),
    )
    if rank == 1:
        time.sleep(30)
        return {}
    assert rpcdist.rpc_sync(1, rf.add, args=(1, 2)) == 3
    out: dict[str, Any] = {}
    try:
        rpcdist.rpc_sync(1, rf.die_after, args=(0.05,))
        out["error"] = None
    except rpcdist.RpcdistError as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)
    out["lost"] = [w.name for w in rpcdist.shutdown()]
    return out


def netns_job(
    rank: int, world_size: int, init: str, lab: dict[str, Any], opts: dict[str, Any]
) -> dict[str, Any]:
    """One "host" of the namespace topology: RPC, RRefs and all_reduce across
    hosts, then host 2 is cut off and every side times how long it takes to
    declare the others lost (wall clock, comparable across processes)."""
    import subprocess

    import netlab

    netlab.enter(lab["namespaces"][rank])
    me, ips = lab["ips"][rank], lab["ips"]
    options = rpcdist.RpcOptions(
        token="t", listen_host=me, local_sockets=False, shutdown_timeout=30, **opts
    )
    del init  # the store is served by host 0, on its own address
    store = f"tcp://{ips[0]}:{lab['port']}"
    rpcdist.init_rpc(
        f"h{rank}", rank, world_size, init_method=store, rpc_timeout=60, options=options
    )
    others = [r for r in range(world_size) if r != rank]
    out: dict[str, Any] = {"rtt_ms": {}}
    for r in others:  # RPC both ways between every pair of hosts
        assert rpcdist.rpc_sync(r, rf.add, args=(rank, r)) == rank + r
        x = np.arange(1 << 16, dtype=np.float32)
        np.testing.assert_array_equal(rpcdist.rpc_async(r, rf.echo, args=(x,)).wait(), x)
        times = []
        for _ in range(10):
            t = time.perf_counter()
            rpcdist.rpc_sync(r, rf.add, args=(1, 1))
            times.append(time.perf_counter() - t)
        out["rtt_ms"][f"h{r}"] = sorted(times)[len(times) // 2] * 1e3
    rref = rpcdist.remote((rank + 1) % world_size, rf.ones, args=(1000,))
    out["rref_sum"] = int(rref.to_here().sum())
    from rpcdist import collectives as dist

    dist.init_process_group(backend="ring", init_method=store, rank=rank, world_size=world_size)
    buf = np.full(10_000, rank + 1, dtype=np.float64)
    for _ in range(5):
        buf[:] = rank + 1
        dist.all_reduce(buf)
    out["all_reduce"] = float(buf[0])
    dist.destroy_process_group()
    rref = None
    # Every host is done with the healthy part before host 2 is cut off: all
    # pass a barrier, then tell host 0 (not waiting for its answer, which
    # the cut may swallow).
    readies = [rpcdist.rpc_async(r, rf.ready) for r in others]
    for f in readies:
        f.wait()
    rf.wait_ready(len(others))
    if rank == 0:
        for _ in others:
            if not rf.ARRIVED.acquire(timeout=30):
                raise TimeoutError("a host never arrived")
        out["partitioned_at"] = time.time()
        subprocess.run(lab["partition"], check=True, capture_output=True)
    else:
        arrival = rpcdist.rpc_async(0, rf.arrived)
    detected: dict[str, float] = {}
    targets = [2] if rank != 2 else [0, 1]
    while len(detected) < len(targets):
        futs = {
            r: rpcdist.rpc_async(r, rf.add, args=(1, 1), timeout=None)
            for r in targets
            if f"h{r}" not in detected
        }
        for r, f in futs.items():
            try:
                f.wait()
            except rpcdist.WorkerLostError as e:
                detected[f"h{r}"] = time.time()
                out[f"error_h{r}"] = str(e)
        time.sleep(0.02)
    out["detected_at"] = detected
    if rank != 0:
        try:
            arrival.wait()
        except rpcdist.WorkerLostError:
            pass  # host 2: the answer was cut off
    out["lost"] = [w.name for w in rpcdist.shutdown()]
    return out


def kill_detect_job(rank: int, world_size: int, init: str, stamp: str) -> dict[str, Any]:
    """Rank 1 dies (SIGKILL) inside a call from rank 0, stamping the time of
    death; rank 0 reports when its call failed, and the error."""
    rpcdist.init_rpc(
        f"w{rank}", rank, world_size, init_method=init, rpc_timeout=30, options=_options()
    )
    if rank == 1:
        time.sleep(30)
        return {}
    assert rpcdist.rpc_sync(1, rf.add, args=(1, 2)) == 3
    out: dict[str, Any] = {}
    try:
        rpcdist.rpc_sync(1, rf.die_after_stamp, args=(0.05, stamp))
    except rpcdist.RpcdistError as e:
        out["failed_at"] = time.time()
        out["error"] = type(e).__name__
    started = time.monotonic()
    out["lost"] = [w.name for w in rpcdist.shutdown()]
    out["shutdown_s"] = time.monotonic() - started
    return out
