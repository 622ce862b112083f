"""Collective bandwidth and latency: rpcdist (shared memory, gRPC) against Gloo.

For p = 2 and 4 spawned processes on this machine, in the same run:

* all_reduce bus bandwidth at 4 KB, 1 MB, 16 MB and 64 MB (float32),
  busbw = algbw * 2(p-1)/p as NCCL's tests define it (algbw = bytes / time);
* broadcast of 16 MB (busbw = algbw);
* barrier latency and 4 KB all_reduce latency (mean over a loop).

Each timed sample starts after a barrier and runs the operation back to
back (about 20 ms of work, at least 3 calls, at most 200); a row is the
median over samples of the time per call, as measured on rank 0. Gloo runs through ``torch.distributed``
(CPU, rendezvous over 127.0.0.1) when torch imports.

With ``--device cuda`` the buffers live on the GPU (CuPy arrays for rpcdist,
CUDA tensors for Gloo, every rank on device 0) and each sample ends with a
device synchronisation, so a row counts the staging through host memory that
both libraries do on one GPU; that table goes to its own section.

Usage: ``python benchmarks/bench_collectives.py [--quick] [--no-write] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import free_port, have_torch_distributed, median, table, write_section

from rpcdist.testing import run_workers

SIZES = [4 << 10, 1 << 20, 16 << 20, 64 << 20]
BCAST = 16 << 20
KB4 = 4 << 10


def _loops(nbytes: int) -> int:
    """Operations per timed sample: about 20 ms of work or more."""
    return max(3, min(200, (64 << 20) // max(nbytes, 1) * 3))


def _sample(
    fn: Callable[[], None],
    barrier: Callable[[], None],
    loops: int,
    reps: int,
    sync: Callable[[], None],
) -> float:
    """Median seconds per call of ``fn`` over ``reps`` samples of ``loops`` calls
    (``sync`` waits for the device's queued work before a sample's clock stops)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(reps):
        sync()
        barrier()
        t = time.perf_counter()
        for _ in range(loops):
            fn()
        sync()
        samples.append((time.perf_counter() - t) / loops)
    return median(samples)


def _no_sync() -> None:
    pass


def _measure(
    all_reduce: Callable[[Any], None],
    broadcast: Callable[[Any], None],
    barrier: Callable[[], None],
    make: Callable[[int], Any],
    sizes: list[int],
    reps: int,
    sync: Callable[[], None] = _no_sync,
) -> dict[str, float]:
    """Seconds per operation, keyed by name."""
    out: dict[str, float] = {}
    for n in sizes:
        buf = make(n)
        out[f"ar{n}"] = _sample(lambda b=buf: all_reduce(b), barrier, _loops(n), reps, sync)
    buf = make(BCAST)
    out["bcast"] = _sample(lambda: broadcast(buf), barrier, _loops(BCAST), reps, sync)
    small = make(KB4)
    out["lat_ar"] = _sample(lambda: all_reduce(small), barrier, 200, reps, sync)
    out["lat_barrier"] = _sample(barrier, barrier, 200, reps, _no_sync)
    return out


def rpcdist_worker(
    rank: int, world: int, init: str, backend: str, sizes: list[int], reps: int, device: str
) -> Any:
    from rpcdist import collectives as dist

    make: Callable[[int], Any] = lambda n: np.zeros(n // 4, np.float32)  # noqa: E731
    sync = _no_sync
    if device == "cuda":
        import cupy

        make = lambda n: cupy.zeros(n // 4, cupy.float32)  # noqa: E731
        sync = cupy.cuda.Device().synchronize

    # "tcp": the ring backend forced onto loopback TCP, as between hosts;
    # "unix": the same ring over the same-host Unix sockets the agent uses
    # by default between workers on one machine.
    if backend in ("tcp", "unix"):
        os.environ["RPCDIST_LOCAL_SOCKETS"] = "1" if backend == "unix" else "0"
        backend = "ring"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=120)
    try:
        got = _measure(
            lambda b: dist.all_reduce(b),
            lambda b: dist.broadcast(b, 0),
            dist.barrier,
            make,
            sizes,
            reps,
            sync,
        )
        assert dist.get_backend() == backend
        return got if rank == 0 else None
    finally:
        dist.destroy_process_group()


def gloo_worker(
    rank: int, world: int, _init: str, port: int, sizes: list[int], reps: int, device: str
) -> Any:
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if device == "cuda" else _no_sync
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        got = _measure(
            lambda b: tdist.all_reduce(b),
            lambda b: tdist.broadcast(b, 0),
            tdist.barrier,
            lambda n: torch.zeros(n // 4, dtype=torch.float32, device=device),
            sizes,
            reps,
            sync,
        )
        return got if rank == 0 else None
    finally:
        tdist.destroy_process_group()


_GPU_NOTE = (
    "\n\nBoth libraries stage GPU buffers through host memory here. On shared memory "
    "(`shm`) rpcdist copies each piece between the GPU and the slots, which it "
    "page-locks for the device at the group's first large CuPy collective, and "
    "reduces on the GPU; an all_reduce or reduce of up to 256 KB, or of any size in "
    "a group of more than two, is instead copied down whole, reduced on the host and "
    "copied back, two device copies in all. The message ring (`tcp`, `unix`) reduces "
    "every CuPy buffer that way. Gloo copies into pinned "
    "buffers it keeps. With one GPU per rank the default backend is NCCL instead, "
    "which one GPU cannot show."
)


def _label(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="p=2 only, fewer sizes")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch docs/")
    ap.add_argument(
        "--impl", default="shm,tcp,unix,gloo", help="shm, tcp, unix, gloo ('grpc': tcp's old name)"
    )
    ap.add_argument("--p", default="2,4")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    sizes = [KB4, 1 << 20, 16 << 20] if args.quick else SIZES
    worlds = [2] if args.quick else [int(x) for x in args.p.split(",")]
    names = ["tcp" if i == "grpc" else i for i in args.impl.split(",")]
    impls = [i for i in names if i != "gloo" or have_torch_distributed()]
    gpu = ""
    if args.device == "cuda":
        import cupy

        gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    reps = 5
    results: dict[tuple[str, int], dict[str, float]] = {}
    for p in worlds:
        for impl in impls:
            t0 = time.perf_counter()
            if impl == "gloo":
                got = run_workers(
                    gloo_worker, p, args=(free_port(), sizes, reps, args.device), timeout=600
                )
            else:
                got = run_workers(
                    rpcdist_worker, p, args=(impl, sizes, reps, args.device), timeout=600
                )
            results[(impl, p)] = got[0]
            print(f"{impl} p={p}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rows = []
    for p in worlds:
        factor = 2 * (p - 1) / p
        for n in sizes:
            row: list[object] = [p, f"all_reduce {_label(n)}"]
            bw = {i: n / results[(i, p)][f"ar{n}"] * factor / 1e9 for i in impls}
            row += [bw[i] for i in impls]
            if "gloo" in bw:
                row += [bw[i] / bw["gloo"] for i in impls if i != "gloo"]
            rows.append(row)
        bw = {i: BCAST / results[(i, p)]["bcast"] / 1e9 for i in impls}
        row = [p, "broadcast 16 MB", *[bw[i] for i in impls]]
        if "gloo" in bw:
            row += [bw[i] / bw["gloo"] for i in impls if i != "gloo"]
        rows.append(row)
    lat_rows = []
    for p in worlds:
        for key, name in (("lat_ar", "all_reduce 4 KB"), ("lat_barrier", "barrier")):
            us = {i: results[(i, p)][key] * 1e6 for i in impls}
            row = [p, name, *[us[i] for i in impls]]
            if "gloo" in us:
                row += [us[i] / us["gloo"] for i in impls if i != "gloo"]
            lat_rows.append(row)
    ratio_cols = [f"{i} / gloo" for i in impls if i != "gloo"] if "gloo" in impls else []
    where = (
        f"Buffers on the GPU ({gpu}, all ranks on device 0; CuPy arrays for rpcdist, "
        "CUDA tensors for Gloo), each sample ending with a device synchronisation. "
        if gpu
        else ""
    )
    body = (
        where + "Bus bandwidth in GB/s (higher is better; all_reduce busbw = algbw * 2(p-1)/p, "
        "broadcast busbw = algbw), float32 buffers, median of timed samples on rank 0.\n\n"
        + table(["p", "operation", *[f"{i} GB/s" for i in impls], *ratio_cols], rows)
        + "\n\nLatency in microseconds per operation (lower is better; mean over loops "
        "of 200 calls, median of 5 samples).\n\n"
        + table(["p", "operation", *[f"{i} us" for i in impls], *ratio_cols], lat_rows)
        + (_GPU_NOTE if gpu else "")
    )
    print(body)
    if not args.no_write:
        if gpu:
            write_section(
                "collectives-gpu",
                "Collectives on GPU buffers (one GPU shared by the ranks) against Gloo",
                body,
            )
        else:
            write_section(
                "collectives",
                "Collectives: rpcdist's shared memory and ring (TCP, Unix sockets) against Gloo",
                body,
            )


if __name__ == "__main__":
    main()
