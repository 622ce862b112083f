"""Context switches per no-op ``rpc_sync``, thread by thread, both sides.

Two workers on this host (TCP transport); rank 0 makes ``--calls`` no-op
``rpc_sync`` calls to rank 1 and reads every thread's voluntary and
involuntary context switches (``/proc/<pid>/task/<tid>/status``) of both
processes before and after. ``--pipe`` measures the same for a bare
two-process pipe ping-pong (the least a round trip can cost: one voluntary
switch per side). ``--busy N`` runs N busy loops at normal priority
meanwhile (the crowded host of ``bench_rpc.py --crowded``); ``--work-us``
makes each call's handler compute that long (how the tail grows with the
CPU a call takes). Prints one line per thread that switched: switches, time
on a CPU and time runnable but waiting for one, per call; the busy-poll
counters; the round trip's p50/p99; and the same threads over as long
again without calls (what their timers cost). Run::

    python benchmarks/probe_switches.py [--busy 2] [--calls 2000] [--pipe] [--work-us 0]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import threading
import time
from typing import Any

Counts = dict[int, tuple[str, int, int, int, int]]


def switches(pid: int) -> Counts:
    """``tid -> (comm, voluntary, involuntary, run_ns, wait_ns)`` of each
    thread of ``pid`` (``schedstat``: time on a CPU, and runnable waiting for one)."""
    out: Counts = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"{base}/{tid}/schedstat") as f:
                run, wait = (int(x) for x in f.read().split()[:2])
        except OSError:
            continue
        out[int(tid)] = (
            fields["Name"].strip(),
            int(fields["voluntary_ctxt_switches"]),
            int(fields["nonvoluntary_ctxt_switches"]),
            run,
            wait,
        )
    return out


def thread_names() -> tuple[int, dict[int, str]]:
    """This process's pid and its Python threads' names by native id."""
    return os.getpid(), {t.native_id or 0: t.name for t in threading.enumerate()}


def poll_counts() -> tuple[int, int, int]:
    """This worker's busy polls: waits that polled, hits, polls cut short."""
    from rpcdist._rpc._context import current_agent

    bp = current_agent().busy_poll
    return bp.polls, bp.hits, bp.yields


def _spin() -> None:
    while True:
        pass


def _report(side: str, names: dict[int, str], a: Counts, b: Counts, calls: int) -> None:
    for tid, (comm, v1, n1, r1, w1) in sorted(b.items()):
        _, v0, n0, r0, w0 = a.get(tid, (comm, 0, 0, 0, 0))
        if v1 - v0 + n1 - n0 < 3:
            continue  # (a thread that slept through: timers)
        name = names.get(tid, comm)
        print(
            f"  {side:6} {name[:28]:28} vol {(v1 - v0) / calls:6.3f}  invol {(n1 - n0) / calls:6.3f}"
            f"  on-cpu {(r1 - r0) / calls / 1e3:6.1f} us  runnable-waiting "
            f"{(w1 - w0) / calls / 1e3:6.1f} us"
        )


def _latency(lat: list[float]) -> str:
    lat.sort()
    n = len(lat)
    slow = sum(t > 1e-3 for t in lat) / n
    return (
        f"p50 {lat[n // 2] * 1e6:.0f} us, p99 {lat[int(n * 0.99)] * 1e6:.0f} us "
        f"(p90 {lat[int(n * 0.9)] * 1e6:.0f}, {slow:.1%} over 1 ms)"
    )


def _rpc_worker(rank: int, init: str, calls: int, work: float, q: Any) -> None:
    import rpcdist

    rpcdist.init_rpc(f"w{rank}", rank=rank, world_size=2, init_method=init, rpc_timeout=120)
    try:
        if rank == 0:
            for _ in range(500):
                rpcdist.rpc_sync("w1", thread_names)
            pid1, names1 = rpcdist.rpc_sync("w1", thread_names)
            pid0, names0 = thread_names()
            p0, p1 = poll_counts(), rpcdist.rpc_sync("w1", poll_counts)
            a0, a1 = switches(pid0), switches(pid1)
            lat = []
            for _ in range(calls):
                t = time.perf_counter()
                rpcdist.rpc_sync("w1", _work, args=(work,))
                lat.append(time.perf_counter() - t)
            b0, b1 = switches(pid0), switches(pid1)
            polls = [
                [y - x for x, y in zip(before, after, strict=True)]
                for before, after in (
                    (p0, poll_counts()),
                    (p1, rpcdist.rpc_sync("w1", poll_counts)),
                )
            ]
            took = sum(lat)
            time.sleep(took)  # as long again without calls: what timers wake
            c0, c1 = switches(pid0), switches(pid1)
            q.put((names0, a0, b0, c0, names1, a1, b1, c1, lat, polls))
    finally:
        rpcdist.shutdown()


def _work(seconds: float) -> None:
    """Computes for ``seconds`` (0: a no-op)."""
    end = time.thread_time() + seconds
    while seconds and time.thread_time() < end:
        pass


def _rpc(calls: int, work: float) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rdv"
        procs = [ctx.Process(target=_rpc_worker, args=(r, init, calls, work, q)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            names0, a0, b0, c0, names1, a1, b1, c1, lat, polls = q.get(timeout=300)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
    what = f"{work * 1e6:g} us of work" if work else "no-op"
    print(f"rpcdist rpc_sync ({what}), {calls} calls: {_latency(lat)}; switches per call:")
    _report("caller", names0, a0, b0, calls)
    _report("callee", names1, a1, b1, calls)
    for side, (n, hits, yields) in zip(("caller", "callee"), polls, strict=True):
        print(f"  {side:6} busy polls {n}, hits {hits}, cut short {yields}")
    print(f"  as long again ({sum(lat):.2f} s) without calls, per {calls} calls:")
    _report("caller", names0, b0, c0, calls)
    _report("callee", names1, b1, c1, calls)


def _echo(r: int, w: int) -> None:
    while True:
        os.write(w, os.read(r, 8))


def _pipe(calls: int) -> None:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    echo = mp.get_context("fork").Process(target=_echo, args=(r1, w2), daemon=True)
    echo.start()
    try:
        for _ in range(500):
            os.write(w1, b"12345678")
            os.read(r2, 8)
        pid = echo.pid or 0
        a0, a1 = switches(os.getpid()), switches(pid)
        lat = []
        for _ in range(calls):
            t = time.perf_counter()
            os.write(w1, b"12345678")
            os.read(r2, 8)
            lat.append(time.perf_counter() - t)
        b0, b1 = switches(os.getpid()), switches(pid)
    finally:
        echo.kill()
        echo.join()
    print(f"pipe ping-pong, {calls} round trips: {_latency(lat)}; switches per round trip:")
    _report("caller", {}, a0, b0, calls)
    _report("echo", {}, a1, b1, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--busy", type=int, default=0, help="busy loops at normal priority")
    ap.add_argument("--pipe", action="store_true", help="also the bare pipe ping-pong")
    ap.add_argument("--work-us", type=float, default=0, help="CPU time each call's handler takes")
    a = ap.parse_args()
    busy = [mp.get_context("fork").Process(target=_spin, daemon=True) for _ in range(a.busy)]
    for p in busy:
        p.start()
    try:
        if a.pipe:
            _pipe(a.calls)
        _rpc(a.calls, a.work_us * 1e-6)
    finally:
        for p in busy:
            p.kill()
            p.join()


if __name__ == "__main__":
    main()
