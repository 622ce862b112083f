"""CPU time per no-op ``rpc_async`` call, by process and kind of thread.

Two workers on this host (default TCP transport); rank 0 issues windows of
64 no-op ``rpc_async`` calls (issue all, wait for all: the pattern of
``ab_checkouts.py`` and ``profile_calls.py``) for ``--seconds``, and reads
every thread's time on a CPU (``/proc/<pid>/task/<tid>/schedstat``) of both
processes before and after. No profiler: these are the real costs, which
add up to about one core when the two processes take turns (one GIL each,
and a window waits for its last reply). Prints calls/s and µs on a CPU per
call: the caller's thread, its loop, the callee's loop and its handler
threads together. Run::

    python benchmarks/probe_call_cpu.py [--seconds 4] [--rounds 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_funcs as bf
from probe_switches import Counts, switches, thread_names

WINDOW = 64


def _by_kind(names: dict[int, str], a: Counts, b: Counts, calls: int) -> dict[str, float]:
    """µs on a CPU per call, summed by kind of thread (loop, handlers, the rest)."""
    out: dict[str, float] = {}
    for tid, (comm, *_, run, _wait) in b.items():
        name = names.get(tid, comm)
        kind = "loop" if "loop" in name else "handlers" if "worker" in name else "thread"
        out[kind] = out.get(kind, 0.0) + (run - a.get(tid, (comm, 0, 0, 0, 0))[3]) / calls / 1e3
    return out


def _worker(rank: int, init: str, seconds: float, q: Any) -> None:
    import rpcdist

    rpcdist.init_rpc(f"w{rank}", rank=rank, world_size=2, init_method=init, rpc_timeout=120)
    try:
        if rank == 0:
            for _ in range(50):
                for f in [rpcdist.rpc_async("w1", bf.noop) for _ in range(WINDOW)]:
                    f.wait()
            (pid1, names1), (pid0, names0) = rpcdist.rpc_sync("w1", thread_names), thread_names()
            a0, a1 = switches(pid0), switches(pid1)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                for f in [rpcdist.rpc_async("w1", bf.noop) for _ in range(WINDOW)]:
                    f.wait()
                n += WINDOW
            rate = n / (time.perf_counter() - t0)
            b0, b1 = switches(pid0), switches(pid1)
            q.put((rate, _by_kind(names0, a0, b0, n), _by_kind(names1, a1, b1, n)))
    finally:
        rpcdist.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    for _ in range(a.rounds):
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{tmp}/rdv"
            procs = [ctx.Process(target=_worker, args=(r, init, a.seconds, q)) for r in range(2)]
            for p in procs:
                p.start()
            try:
                rate, caller, callee = q.get(timeout=300)
            finally:
                for p in procs:
                    p.join(60)
                    if p.is_alive():
                        p.kill()
        print(
            f"{rate:,.0f} calls/s; us on a CPU per call: caller {sum(caller.values()):.1f} "
            f"(thread {caller.get('thread', 0):.1f}, loop {caller.get('loop', 0):.1f}), "
            f"callee {sum(callee.values()):.1f} (loop {callee.get('loop', 0):.1f}, "
            f"handlers {callee.get('handlers', 0):.1f}, other {callee.get('thread', 0):.1f})"
        )


if __name__ == "__main__":
    main()
