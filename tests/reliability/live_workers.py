"""Worker bodies of the liveness tests (run by ``harness.run_job``).

Every job takes its rank from the launcher's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), as a user's program does,
and uses the detector's default settings unless a test says otherwise.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any

import numpy as np
import rel_funcs as rf

import rpcdist
from rpcdist._faults import FaultInjector
from rpcdist.collectives._group import ABORT

#: ``usleep`` called through ``PyDLL`` keeps the GIL for the whole call, as
#: a native library that does not release it does.
_LIBC = ctypes.PyDLL(None)


def hold_gil(seconds: float) -> float:
    """Hold this process's GIL for ``seconds`` (no thread of it runs Python)."""
    started = time.monotonic()
    _LIBC.usleep(int(seconds * 1e6))
    return time.monotonic() - started


def _env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def _options(**kw: Any) -> rpcdist.RpcOptions:
    return rpcdist.RpcOptions(shutdown_timeout=30, **kw)


def _start_with_victim(rank: int, world_size: int, port: int, victim: int) -> int | None:
    """``init_rpc`` from the environment; every rank but ``victim`` learns its
    pid and waits until the others did (``None`` on the victim, which waits
    to be stopped and killed)."""
    _env(rank, world_size, port)
    rpcdist.init_rpc(f"w{rank}", rpc_timeout=None, options=_options())
    if rank == victim:
        time.sleep(120)  # stopped meanwhile, then killed by the test
        return None
    pid: int = rpcdist.rpc_sync(victim, rf.pid)
    others = [r for r in range(world_size) if r not in (rank, victim)]
    for r in others:
        rpcdist.rpc_sync(r, rf.ready)
    rf.wait_ready(len(others))
    return pid


def gil_and_sigstop(rank: int, world_size: int, init: str, port: int) -> dict[str, Any]:
    """Rank 1 holds its GIL (2.5 s, then 4 s) while rank 0 stops rank 2
    (SIGSTOP): rank 2 must be declared lost, rank 1 never."""
    pid2 = _start_with_victim(rank, world_size, port, 2)
    if pid2 is None:
        return {}
    out: dict[str, Any] = {}
    if rank == 0:
        held = rpcdist.rpc_async(1, hold_gil, args=(2.5,), timeout=None)
        time.sleep(0.2)  # (the hold has begun: rank 1 is silent from now on)
        os.kill(pid2, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            rpcdist.rpc_sync(2, rf.add, args=(1, 2), timeout=None)
            out["w2"] = "returned"
        except rpcdist.RpcdistError as e:
            out["w2"] = type(e).__name__
            out["w2_message"] = str(e)
        out["detected_s"] = time.monotonic() - stopped
        out["held"] = [held.wait(30), rpcdist.rpc_sync(1, hold_gil, args=(4.0,), timeout=None)]
        rpcdist.rpc_sync(1, rf.set_event, timeout=10)
    elif not rf.EVENT.wait(60):
        raise RuntimeError("rank 0 never finished")
    out["after"] = rpcdist.rpc_sync(1 - rank, rf.add, args=(2, 2), timeout=10)
    out["lost"] = [w.name for w in rpcdist.shutdown()]
    return out


def sigstop_collective(
    rank: int,
    world_size: int,
    init: str,
    port: int,
    way: str,
    windows: tuple[float, ...] | None = None,
    slow_notice: float = 0.0,
) -> dict[str, Any]:
    """The last rank is stopped (SIGSTOP, by rank 0) in the middle of an
    ``all_reduce`` loop; the others report what their collective raised and
    when. ``way``: ``"shm"``, ``"ring-unix"`` / ``"ring-tcp"`` (the message
    ring over same-host Unix sockets or TCP), ``"ring-rpc"`` (the ring on
    the agent ``init_rpc`` started) or ``"ring-grpc"``. ``windows``: each
    rank's failure-detector window (``peer_timeout``), on an agent
    ``init_rpc`` starts; ``slow_notice``: seconds rank 1's notices that a
    collective failed wait before they leave (a busy machine's delay)."""
    from rpcdist import collectives as dist

    del init
    _env(rank, world_size, port)
    os.environ["RPCDIST_LOCAL_SOCKETS"] = "0" if way == "ring-tcp" else "1"
    os.environ["RPCDIST_TRANSPORT"] = "grpc" if way == "ring-grpc" else "auto"
    victim = world_size - 1
    if way == "ring-rpc" or windows is not None:
        kw: dict[str, Any] = {} if windows is None else {"peer_timeout": windows[rank]}
        if slow_notice and rank == 1:
            kw["faults"] = FaultInjector()
            kw["faults"].add(ABORT, "delay", times=None, delay=slow_notice)
        rpcdist.init_rpc(f"w{rank}", rpc_timeout=None, options=_options(**kw))
    dist.init_process_group(backend="shm" if way == "shm" else "ring", timeout=120)
    buf = np.ones(1 << 16, dtype=np.float32)
    dist.all_reduce(buf)  # everyone is in
    pids = [np.zeros(1, dtype=np.int64) for _ in range(world_size)]
    dist.all_gather(pids, np.array([os.getpid()], dtype=np.int64))
    out: dict[str, Any] = {"backend": dist.get_backend()}
    if rank == victim:
        while True:  # stopped in here by rank 0, then killed by the test
            dist.all_reduce(buf)
    stopped = None
    rounds = 0
    try:
        while True:
            if rank == 0 and rounds == 50:
                os.kill(int(pids[victim][0]), signal.SIGSTOP)
                stopped = time.monotonic()
            dist.all_reduce(buf)
            rounds += 1
    except rpcdist.RpcdistError as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)
    out["failed_at"] = time.monotonic()
    out["stopped_at"] = stopped
    out["rounds"] = rounds
    return out


def store_host_stopped(rank: int, world_size: int, init: str, port: int) -> dict[str, Any]:
    """Rank 1 stops rank 0 (the store host, SIGSTOP) and every other rank
    shuts down: each must return, naming rank 0 only."""
    pid0 = _start_with_victim(rank, world_size, port, 0)
    if pid0 is None:
        return {}
    others = [r for r in range(1, world_size) if r != rank]
    if rank == 1:
        os.kill(pid0, signal.SIGSTOP)
        for r in others:
            rpcdist.rpc_sync(r, rf.set_event, timeout=10)
    elif not rf.EVENT.wait(60):
        raise RuntimeError("rank 1 never stopped rank 0")
    started = time.monotonic()
    lost = rpcdist.shutdown()
    return {"lost": [w.name for w in lost], "shutdown_s": time.monotonic() - started}
