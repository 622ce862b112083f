"""How long realistic workloads hold the GIL: the pauses the failure detector must survive.

A peer's heartbeats are sent by its event-loop thread, which needs the GIL:
while another thread holds it, the peer is silent. This measures the longest
such silences: a watcher thread asks to wake every millisecond and records
how late it woke (its largest lateness is the longest stretch it could not
get the GIL), while the main thread runs each workload:

* a full ``gc.collect()`` of a large heap of small objects (tuples in lists,
  as a data loader's records are);
* a large NumPy sort (``np.sort`` of float64), and a large ``np.dot``;
* a large PyTorch sort and matrix product, when torch is installed;
* unpickling a large object (a list of small dicts, as a checkpoint's
  metadata or a sample cache is);
* for reference, a native call that keeps the GIL (``usleep`` through
  ``ctypes.PyDLL``, 2.5 s).

The figures choose ``RpcOptions.peer_timeout`` and ``pause_timeout``
(``docs/failure-model.md``).

Run: ``python benchmarks/bench_gil_hold.py [--objects N] [--elements N] [--no-write]``
(defaults: 20 million objects, 100 million elements: about 6 GB at peak).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import pickle
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import table, write_section

#: How often the watcher asks to wake (seconds).
TICK = 0.001


class Watcher:
    """A thread that records how late it wakes (the GIL holds it back)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-watcher", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(TICK)
            late = time.perf_counter() - t0 - TICK
            if late > self.worst:
                self.worst = late

    def __enter__(self) -> Watcher:
        self._thread.start()
        time.sleep(0.05)  # (running)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(fn: Callable[[], object]) -> tuple[float, float]:
    """(seconds the workload took, longest time the watcher could not run)."""
    with Watcher() as w:
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
    return took, w.worst


def workloads(objects: int, elements: int) -> list[tuple[str, Callable[[], object], int]]:
    """(name, workload, runs): the quick ones run three times (their holds vary)."""
    out: list[tuple[str, Callable[[], object], int]] = []
    heap: list[object] = []

    def build_heap() -> None:
        chunk = 1_000_000
        for i in range(0, objects, chunk):
            heap.append([(j, i) for j in range(min(chunk, objects - i))])

    out.append((f"build a heap of {objects / 1e6:g} M tuples", build_heap, 1))
    out.append((f"gc.collect() with {objects / 1e6:g} M tuples live", gc.collect, 3))
    keys = np.random.default_rng(0).random(elements)
    out.append((f"np.sort of {elements / 1e6:g} M float64", lambda: np.sort(keys), 1))
    side = int((elements / 25) ** 0.5)
    mat = np.random.default_rng(1).random((side, side))
    out.append((f"np.dot of two {side}x{side} float64", lambda: mat @ mat, 3))
    try:
        import torch

        tkeys = torch.from_numpy(keys)
        tmat = torch.from_numpy(mat)
        out.append((f"torch.sort of {elements / 1e6:g} M float64", lambda: torch.sort(tkeys), 1))
        out.append((f"torch.mm of two {side}x{side} float64", lambda: tmat @ tmat, 3))
    except ImportError:
        pass
    records = [{"id": i, "label": i % 10} for i in range(objects // 4)]
    blob = pickle.dumps(records, protocol=5)
    del records
    out.append(
        (
            f"pickle.loads of {objects // 4 / 1e6:g} M dicts ({len(blob) / 1e6:.0f} MB)",
            lambda: pickle.loads(blob),
            3,
        )
    )
    libc = ctypes.PyDLL(None)
    out.append(("native call keeping the GIL (usleep 2.5 s)", lambda: libc.usleep(2_500_000), 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=20_000_000, help="small objects on the heap")
    ap.add_argument("--elements", type=int, default=100_000_000, help="array elements to sort")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch docs/")
    args = ap.parse_args()
    rows = []
    for name, fn, runs in workloads(args.objects, args.elements):
        got = [measure(fn) for _ in range(runs)]
        took = max(t for t, _ in got)
        holds = ", ".join(f"{w:.2f}" for _, w in got)
        rows.append((name, runs, f"{took:.2f}", holds))
        print(f"{name}: took up to {took:.2f} s, GIL held up to {holds} s", file=sys.stderr)
    body = (
        "The longest time a thread that asks to wake every millisecond could not run "
        "(it waits for the GIL) while the main thread runs each workload: a peer's "
        "heartbeats stop that long. `gc.collect()` is timed with the heap "
        "built in the row above still live (and so is every object made since: the heap "
        "is the program's). Quick workloads run three times: their holds vary with when "
        "the collector runs inside them.\n\n"
        + table(["workload", "runs", "took, longest (s)", "longest GIL hold per run (s)"], rows)
    )
    if args.no_write:
        print(body)
    else:
        write_section("gil-hold", "GIL holds: the pauses the failure detector survives", body)


if __name__ == "__main__":
    main()
