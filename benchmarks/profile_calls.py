"""Where the time of ``rpc_async`` goes: cProfile of a 64-call window, both ends.

Two processes on this host. The caller issues windows of 64 no-op
``rpc_async`` calls (issue all, wait for all) for a few seconds; both
processes profile their agent loop thread, and the caller its own thread
too. Each thread's top functions by own time are printed, as microseconds
per call (profiling slows everything down alike, about 2x: read the shares,
not the absolute figures), grouped into the stages of a call.

Usage: ``python benchmarks/profile_calls.py [--seconds S] [--top N]``.
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

WINDOW = 64


def _on_loop(agent: Any, fn: Any) -> None:
    """Run ``fn()`` on the agent's loop thread and wait for it."""
    import threading

    done = threading.Event()
    agent.loop.call_soon_threadsafe(lambda: (fn(), done.set()))
    done.wait(10)


def _profile_loop(agent: Any) -> Any:
    import cProfile

    prof = cProfile.Profile()
    _on_loop(agent, prof.enable)
    return prof


def _stop_loop(agent: Any, prof: Any) -> None:
    _on_loop(agent, prof.disable)


def _rows(prof: Any, calls: int, top: int) -> list[tuple[float, float, str]]:
    import pstats

    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(file)}:{line}({fn})" if line else fn
        rows.append((tt / calls * 1e6, nc / calls, where))
    rows.sort(reverse=True)
    return rows[:top]


def _worker(rank: int, init: str, seconds: float, top: int, q: Any) -> None:
    import cProfile

    import rpcdist
    from rpcdist._rpc._context import current_agent

    rpcdist.init_rpc(f"w{rank}", rank, 2, init_method=init, rpc_timeout=60)
    agent = current_agent()
    try:
        if rank == 1:
            _PROF.append(_profile_loop(agent))
            return  # serve until rank 0 is done (the graceful shutdown waits for it)
        for _ in range(20):
            for f in [rpcdist.rpc_async("w1", bf.noop) for _ in range(WINDOW)]:
                f.wait()
        loop_prof = _profile_loop(agent)
        me = cProfile.Profile()
        n, t0 = 0, time.perf_counter()
        me.enable()
        while time.perf_counter() - t0 < seconds:
            for f in [rpcdist.rpc_async("w1", bf.noop) for _ in range(WINDOW)]:
                f.wait()
            n += WINDOW
        me.disable()
        elapsed = time.perf_counter() - t0
        _stop_loop(agent, loop_prof)
        q.put(
            {
                "calls": n,
                "us_per_call": elapsed / n * 1e6,
                "caller thread": _rows(me, n, top),
                "caller loop": _rows(loop_prof, n, top),
                "callee loop": rpcdist.rpc_sync("w1", _callee_rows, args=(n, top)),
            }
        )
    finally:
        rpcdist.shutdown()


_PROF: list[Any] = []


def _callee_rows(calls: int, top: int) -> list[tuple[float, float, str]]:
    from rpcdist._rpc._context import current_agent

    prof = _PROF[0]
    _stop_loop(current_agent(), prof)
    return _rows(prof, calls, top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rdv"
        procs = [
            ctx.Process(target=_worker, args=(r, init, a.seconds, a.top, q), daemon=True)
            for r in range(2)
        ]
        for p in procs:
            p.start()
        res = q.get(timeout=120)
        for p in procs:
            p.join(30)
    print(f"{res['calls']} calls, {res['us_per_call']:.1f} us/call under the profiler")
    for part in ("caller thread", "caller loop", "callee loop"):
        print(f"\n{part} (own time in us, and times run, per call):")
        for us, times, where in res[part]:
            print(f"  {us:7.2f} {times:6.3f}  {where}")


if __name__ == "__main__":
    main()
