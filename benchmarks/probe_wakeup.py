"""The scheduler's floor for a wake-up on a crowded host, without rpcdist.

Two processes ping-pong 8 bytes over pipes (each side sleeps in ``read``)
while one busy loop per CPU runs at normal priority: each round trip is two
wake-ups, the least any RPC needs. Optionally each side asks the kernel for
a shorter slice (``sched_setattr``'s ``sched_runtime`` for SCHED_OTHER,
Linux 6.12+ EEVDF), which lets a woken task preempt a running one sooner.
Prints p50/p99/max of the round trip. Run:
``python benchmarks/probe_wakeup.py [--slice-us 100] [--seconds 3]``.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import time

_SYS_SCHED_SETATTR = 314  # x86_64


class _SchedAttr(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("policy", ctypes.c_uint32),
        ("flags", ctypes.c_uint64),
        ("nice", ctypes.c_int32),
        ("priority", ctypes.c_uint32),
        ("runtime", ctypes.c_uint64),
        ("deadline", ctypes.c_uint64),
        ("period", ctypes.c_uint64),
        ("util_min", ctypes.c_uint32),
        ("util_max", ctypes.c_uint32),
    ]


def set_slice(ns: int) -> None:
    """Ask for a ``ns``-nanosecond slice for the calling thread (0: leave it)."""
    if not ns:
        return
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), nice=os.getpriority(os.PRIO_PROCESS, 0))
    attr.runtime = ns
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_SCHED_SETATTR, 0, ctypes.byref(attr), 0) != 0:
        raise OSError(ctypes.get_errno(), "sched_setattr failed")


def _busy() -> None:
    while True:
        pass


def _echo(r: int, w: int, slice_ns: int) -> None:
    set_slice(slice_ns)
    while True:
        os.write(w, os.read(r, 8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slice-us", type=int, default=0, help="0: the kernel's default slice")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)))
    a = ap.parse_args()
    slice_ns = a.slice_us * 1000
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    echo = mp.Process(target=_echo, args=(r1, w2, slice_ns), daemon=True)
    busy = [mp.Process(target=_busy, daemon=True) for _ in range(a.busy)]
    for p in [echo, *busy]:
        p.start()
    try:
        set_slice(slice_ns)
        lat: list[int] = []
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            t = time.perf_counter_ns()
            os.write(w1, b"12345678")
            os.read(r2, 8)
            lat.append(time.perf_counter_ns() - t)
            time.sleep(0.0005)
    finally:
        for p in [echo, *busy]:
            p.kill()
            p.join()
    lat.sort()
    n = len(lat)
    print(
        f"slice {a.slice_us or 'default'} us, {a.busy} busy loops, {n} round trips: "
        f"p50 {lat[n // 2] / 1e3:.0f} us, p99 {lat[int(n * 0.99)] / 1e3:.0f} us, "
        f"max {lat[-1] / 1e3:.0f} us"
    )


if __name__ == "__main__":
    main()
