"""GPU arrays across workers: CuPy arrays through rpcdist against CUDA tensors
through PyTorch RPC (TensorPipe with device maps), with host arrays through
rpcdist as the reference, in the same run.

Two spawned processes on one machine, both on CUDA device 0. Worker w0 sends
an array to w1, which returns it (the echo function); one-way GB/s = bytes /
(round trip / 2), the median of the timed round trips after two untimed
ones. Each timed round trip ends with a device synchronisation, so it counts
the whole path: rpcdist stages a CuPy array through host memory on both
sides, or with CUDA IPC (the default between processes of one host) copies
it device to device into a staging block the receiver maps; TensorPipe moves
CUDA tensors with its CUDA channels where the machine allows them.

Needs CuPy and a CUDA device (and a CUDA build of torch for the baseline;
without it that column reads n/a).

Usage: ``python benchmarks/bench_gpu_rpc.py [--quick] [--no-write]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_funcs as bf
from _report import free_port, median, table, time_steps, write_section

from rpcdist.testing import WorkerFailed, run_workers

SIZES = [1 << 20, 16 << 20, 64 << 20]


def _echo_gbps(call: Callable[[], Any], sync: Callable[[], None], nbytes: int, reps: int) -> float:
    def step() -> None:
        call()
        sync()

    return nbytes / (median(time_steps(step, 2, reps)) / 2) / 1e9


def _reps(nbytes: int, quick: bool) -> int:
    return (3 if quick else 5) if nbytes >= 16 << 20 else (10 if quick else 30)


def rpcdist_worker(
    rank: int, world: int, init: str, sizes: list[int], quick: bool, device: str
) -> dict[int, float] | None:
    import numpy as np

    import rpcdist

    ipc = device == "cuda"  # "cuda-host": CuPy arrays through host memory
    opts = rpcdist.RpcOptions(cuda_ipc=ipc)
    rpcdist.init_rpc(f"w{rank}", rank, world, init_method=init, rpc_timeout=120, options=opts)
    try:
        if rank != 0:
            return None
        out = {}
        for n in sizes:
            if device.startswith("cuda"):
                import cupy

                x: Any = cupy.ones(n // 4, cupy.float32)
                sync = cupy.cuda.Device().synchronize
            else:
                x = np.ones(n // 4, np.float32)
                sync = bf.noop
            back = rpcdist.rpc_sync("w1", bf.echo, args=(x,))
            assert type(back) is type(x) and back.shape == x.shape
            for _ in range(50 if ipc else 0):  # the first go by host while the probes run
                if bf.ipc_used():
                    break
                rpcdist.rpc_sync("w1", bf.echo, args=(x,))
            out[n] = _echo_gbps(
                lambda x=x: rpcdist.rpc_sync("w1", bf.echo, args=(x,)), sync, n, _reps(n, quick)
            )
        if ipc:
            out[-1] = rpcdist.statistics()["cuda_ipc_sent"]
        return out
    finally:
        rpcdist.shutdown()


def torch_worker(
    rank: int, world: int, init: str, flavor: str, port: int, sizes: list[int], quick: bool
) -> dict[int, float] | None:
    """CUDA tensors through PyTorch RPC (TensorPipe, an identity device map;
    ``flavor`` "torch") or through rpcdist.torch (the same program with its
    imports swapped; ``flavor`` "rpcdist")."""
    import torch

    if flavor == "torch":
        import torch.distributed.rpc as rpc

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        peer = f"w{1 - rank}"
        opts = rpc.TensorPipeRpcBackendOptions(
            num_worker_threads=16, rpc_timeout=120, device_maps={peer: {0: 0}}
        )
    else:
        import rpcdist.torch.rpc as rpc  # type: ignore[no-redef]

        opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=120)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    try:
        if rank != 0:
            return None
        out = {}
        for n in sizes:
            x = torch.ones(n // 4, dtype=torch.float32, device="cuda:0")
            for _ in range(50 if flavor == "rpcdist" else 1):
                back = rpc.rpc_sync("w1", bf.echo, args=(x,))
                if flavor == "torch" or bf.ipc_used():  # (by host while the probes run)
                    break
            assert back.device == x.device and back.shape == x.shape
            out[n] = _echo_gbps(
                lambda x=x: rpc.rpc_sync("w1", bf.echo, args=(x,)),
                torch.cuda.synchronize,
                n,
                _reps(n, quick),
            )
        return out
    finally:
        rpc.shutdown()


def _torch_cuda() -> bool:
    try:
        import torch
        import torch.distributed.rpc

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer round trips")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch docs/")
    ap.add_argument(
        "--sizes", help="comma-separated array sizes in KiB (default: 1024,16384,65536)"
    )
    args = ap.parse_args()
    try:
        import cupy

        gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception as e:  # no CuPy, no driver, no device: nothing to measure here
        print(f"bench_gpu_rpc: skipped, needs CuPy and a CUDA device ({e})", file=sys.stderr)
        return 0
    sizes = [int(k) << 10 for k in args.sizes.split(",")] if args.sizes else SIZES
    t0 = time.perf_counter()
    host = run_workers(rpcdist_worker, 2, args=(sizes, args.quick, "cpu"), timeout=600)[0]
    staged = run_workers(rpcdist_worker, 2, args=(sizes, args.quick, "cuda-host"), timeout=600)[0]
    dev = run_workers(rpcdist_worker, 2, args=(sizes, args.quick, "cuda"), timeout=600)[0]
    lent = int(dev.pop(-1))
    baseline: dict[int, float] = {}
    ours_torch: dict[int, float] = {}
    why = "torch with CUDA is not installed"
    if _torch_cuda():
        ours_torch = run_workers(
            torch_worker, 2, args=("rpcdist", 0, sizes, args.quick), timeout=600
        )[0]
        try:
            baseline = run_workers(
                torch_worker, 2, args=("torch", free_port(), sizes, args.quick), timeout=600
            )[0]
        except WorkerFailed as e:
            why = f"PyTorch RPC failed: {str(e).splitlines()[-1][:200]}"
    print(f"measured in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    nan = float("nan")
    rows = []
    for n in sizes:
        ratio = dev[n] / baseline[n] if n in baseline else nan
        rows.append(
            [
                f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB",
                host[n],
                staged[n],
                dev[n],
                ours_torch.get(n, nan),
                baseline.get(n, nan),
                ratio,
                ours_torch.get(n, nan) / baseline[n] if n in baseline else nan,
            ]
        )
    body = (
        f"Array echo between two processes on one GPU ({gpu}), one-way GB/s "
        "(higher is better; median of timed round trips, each ending with a device "
        "synchronisation).\n\n"
        + table(
            [
                "size",
                "rpcdist NumPy",
                "rpcdist CuPy, host path",
                "rpcdist CuPy, CUDA IPC",
                "rpcdist.torch CUDA tensors",
                "PyTorch RPC CUDA tensors",
                "CuPy IPC / PyTorch",
                "rpcdist.torch / PyTorch",
            ],
            rows,
        )
        + (f"\n\nPyTorch column: n/a ({why})." if not baseline else "")
        + "\n\nrpcdist's host path (`RpcOptions(cuda_ipc=False)`) stages a CuPy array "
        "through host memory on each side (device to host, the same wire as a NumPy array, "
        "host to device). With CUDA IPC (the default between processes of one host) the "
        "sender copies it into a staging block of device memory and sends the block's "
        "handle; the receiver copies it out device to device and releases the block "
        f"({lent} arrays went by handle in that run). rpcdist.torch sends a CUDA tensor "
        "the same way, through a CuPy view of its memory, when CuPy is installed, and "
        "the receiver copies it straight into a new tensor. "
        "PyTorch's TensorPipe uses its CUDA channels between processes of one machine "
        "where it can."
    )
    print(body)
    if not args.no_write:
        write_section(
            "gpu_rpc",
            "GPU arrays across workers: rpcdist (CuPy) against PyTorch RPC (CUDA tensors)",
            body,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
