"""Two checkouts of rpcdist side by side: no-op ``rpc_sync`` p50 and
``rpc_async`` calls/s (64 in flight), two processes on this host.

Rounds alternate between the checkouts (before, after, before, ...), so that
the machine's drift falls on both alike; the medians over rounds are
compared. Made for changes on the call path that must not cost anything
(the callable policy's exposure model, for instance)::

    git worktree add /tmp/before <commit>
    python benchmarks/ab_checkouts.py /tmp/before . --rounds 4 --name policy
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _report import free_port, table, write_section

#: The measurement, run with one checkout on ``PYTHONPATH`` (rank 0 prints
#: ``p50_us rate``).
_WORKER = r"""
import multiprocessing as mp, statistics, sys, time


def noop():
    return None


def worker(rank, port, q):
    import rpcdist

    rpcdist.init_rpc(f"w{rank}", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                     options=rpcdist.RpcOptions(token="ab"))
    if rank == 0:
        import __main__
        for _ in range(500):
            rpcdist.rpc_sync("w1", __main__.noop)
        lat = []
        for _ in range(CALLS):
            t = time.perf_counter()
            rpcdist.rpc_sync("w1", __main__.noop)
            lat.append(time.perf_counter() - t)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < SECONDS:
            for f in [rpcdist.rpc_async("w1", __main__.noop) for _ in range(64)]:
                f.wait()
            n += 64
        q.put((statistics.median(lat) * 1e6, n / (time.perf_counter() - t0)))
    rpcdist.shutdown()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = int(sys.argv[1])
    procs = [ctx.Process(target=worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    p50, rate = q.get(timeout=120)
    for p in procs:
        p.join(60)
    print(f"{p50:.2f} {rate:.1f}")
"""


def _measure(checkout: str, calls: int, seconds: float) -> tuple[float, float]:
    code = _WORKER.replace("CALLS", str(calls)).replace("SECONDS", str(seconds))
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    with tempfile.TemporaryDirectory(prefix="rpcdist-ab-") as tmp:
        script = os.path.join(tmp, "ab_worker.py")  # (spawned workers import their main)
        with open(script, "w") as f:
            f.write(code)
        out = subprocess.run(
            [sys.executable, script, str(free_port())],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
            cwd=os.path.abspath(checkout),
        ).stdout.split()
    return float(out[-2]), float(out[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", help="the checkout before the change")
    ap.add_argument("after", help="the checkout after it")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=5000, help="rpc_sync calls timed per round")
    ap.add_argument("--seconds", type=float, default=3.0, help="rpc_async seconds per round")
    ap.add_argument("--name", default="", help="write a section ab-NAME to docs/benchmarks.md")
    args = ap.parse_args()
    got: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for arm in ("before", "after"):
            got[arm].append(_measure(getattr(args, arm), args.calls, args.seconds))
            print(
                f"round {r + 1} {arm}: p50 {got[arm][-1][0]:.1f} µs, "
                f"{got[arm][-1][1]:,.0f} calls/s",
                flush=True,
            )
        time.sleep(0.5)  # (lets the last pair's sockets close before the next)
    p50 = {a: statistics.median(x[0] for x in v) for a, v in got.items()}
    rate = {a: statistics.median(x[1] for x in v) for a, v in got.items()}
    rows = [
        [
            "rpc_sync no-op p50 (µs)",
            f"{p50['before']:.0f}",
            f"{p50['after']:.0f}",
            f"{p50['after'] / p50['before']:.2f}",
        ],
        [
            "rpc_async calls/s (64 in flight)",
            f"{rate['before']:,.0f}",
            f"{rate['after']:,.0f}",
            f"{rate['after'] / rate['before']:.2f}",
        ],
    ]
    text = table(["metric", "before", "after", "after / before"], rows)
    print(text)
    if args.name:
        body = (
            f"Medians of {args.rounds} alternating rounds (before, after, ...), each a fresh "
            f"pair of processes: {args.calls} no-op `rpc_sync` calls timed one by one, then "
            f"`rpc_async` in windows of 64 for {args.seconds:g} s.\n\n{text}"
        )
        write_section(f"ab-{args.name}", f"Before and after: {args.name}", body)


if __name__ == "__main__":
    main()
