"""How long an event loop is held when a link's large /dev/shm segment goes.

A 256 MB segment (the sender's pool) is written and mapped by a receiver,
as a large call leaves it. Then, on a running loop with a 1 ms ticker:

* ``sender``: the pool is closed (a transport stopping, a link dropped)
  after the receiver let go of its mapping (it died, or was done first), so
  the sender's teardown frees the pages;
* ``receiver``: the receiver lets go of its mapping after the sender
  retired the segment, so the receiver's unmapping frees them.

Reported: how long the call took on the loop, and the longest gap between
two ticks around it (what every other callback waited). And ``take``: how
long a small message's ``write`` takes on the sending thread when the pool
retires a spare segment of the same size then (it keeps ``KEEP_FREE``).
Run it against another checkout with ``PYTHONPATH=<checkout>`` to compare.

    python benchmarks/probe_shm_teardown.py [--mb 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

import numpy as np

from rpcdist._transport._shm import SegmentReader, SegmentWriter


def _prepare(nbytes: int) -> tuple[SegmentWriter, object, SegmentReader, str]:
    w = SegmentWriter()
    pool, reader = w.pool(), SegmentReader()
    path, _ = pool.write([memoryview(np.ones(nbytes, np.uint8))])
    views = reader.buffers(path, [nbytes])
    del views
    gc.collect()
    return w, pool, reader, path


async def _held(action: object) -> tuple[float, float]:
    """(seconds ``action()`` ran on the loop, longest gap between 1 ms ticks)."""
    gaps: list[float] = []
    stop = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    t0 = time.perf_counter()
    action()  # type: ignore[operator]
    took = time.perf_counter() - t0
    await asyncio.sleep(0.3)  # (the teardown, wherever it runs, is over)
    stop = True
    await task
    return took, max(gaps)


async def _run_one(case: str, nbytes: int) -> tuple[float, float]:
    w, pool, reader, _ = _prepare(nbytes)
    if case == "sender":
        reader.close()
        gc.collect()
        held = await _held(pool.close)  # type: ignore[attr-defined]
    else:
        pool.close()  # type: ignore[attr-defined]
        await asyncio.sleep(0.5)
        held = await _held(reader.close)
    clean = getattr(w, "aclean", None)
    if clean is not None:
        await clean()
    else:
        w.cleanup()
    return held


def _take(nbytes: int) -> float:
    """Seconds a 1-byte write takes when it retires one spare ``nbytes`` segment."""
    from rpcdist._transport._shm import KEEP_FREE, SegmentPool

    w = SegmentWriter()
    pool = w.pool()
    big = memoryview(np.ones(nbytes, np.uint8))
    segs = [pool.write([big])[1] for _ in range(KEEP_FREE + 1)]
    for seg in segs:
        SegmentPool.release(seg)
    del segs
    t0 = time.perf_counter()
    pool.write([memoryview(b"x")])
    took = time.perf_counter() - t0
    w.cleanup()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    for case in ("sender", "receiver"):
        runs = [asyncio.run(_run_one(case, a.mb << 20)) for _ in range(a.runs)]
        took = statistics.median(r[0] for r in runs) * 1e3
        gap = statistics.median(r[1] for r in runs) * 1e3
        print(
            f"{case:9s} {a.mb} MB: call on the loop {took:7.2f} ms (median of {a.runs}), "
            f"longest tick gap {gap:7.2f} ms"
        )
    took = statistics.median(_take(a.mb << 20) for _ in range(a.runs)) * 1e3
    print(f"take      {a.mb} MB: a write retiring a spare segment {took:7.2f} ms (median)")


if __name__ == "__main__":
    main()
