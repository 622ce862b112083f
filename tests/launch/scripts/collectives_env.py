"""Collectives with ranks from the launcher's environment: ``collectives_env.py BACKEND MODE``.

Rank, world size, address, port and token all come from the launcher.

* ``MODE`` ``pg``: ``init_process_group(backend=BACKEND)`` and nothing else;
  ``tcp``: the same with ``init_method="tcp://MASTER_ADDR:MASTER_PORT"``;
  ``rpc``: ``init_rpc`` first, then the process group on the same agent;
  ``adopt``: the process group first, then ``init_rpc`` adopts its agent.

Every rank runs all_reduce, broadcast, all_gather and barrier, checks the
results against NumPy, and prints ``OK backend=<engine> world=<n>``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import rpcdist
from rpcdist import collectives as dist


def whoami(value: int) -> tuple[str, int]:
    """Runs on the callee: its name and ``value + 1``."""
    return rpcdist.get_worker_info().name, value + 1


def collectives(rank: int, world: int) -> None:
    x = np.arange(6, dtype=np.float64) * (rank + 1)
    dist.all_reduce(x)
    np.testing.assert_array_equal(x, np.arange(6) * sum(range(1, world + 1)))
    b = np.full(5, rank, dtype=np.int64)
    dist.broadcast(b, src=world - 1)
    np.testing.assert_array_equal(b, np.full(5, world - 1))
    out = [np.empty(3, dtype=np.int32) for _ in range(world)]
    dist.all_gather(out, np.full(3, 10 * rank, dtype=np.int32))
    for q, got in enumerate(out):
        np.testing.assert_array_equal(got, np.full(3, 10 * q))
    dist.barrier()
    assert dist.get_rank() == rank and dist.get_world_size() == world


def call_next(rank: int, world: int) -> None:
    name, value = rpcdist.rpc_sync((rank + 1) % world, whoami, args=(rank,))
    assert (name, value) == (f"worker{(rank + 1) % world}", rank + 1), (name, value)


def main() -> None:
    backend, mode = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "rpc":
        rpcdist.init_rpc(f"worker{rank}")
    if mode == "tcp":
        addr = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group(backend=backend, init_method=addr)
    else:
        dist.init_process_group(backend=backend)
    if mode == "adopt":
        rpcdist.init_rpc(f"worker{rank}")
    collectives(rank, world)
    if mode in ("rpc", "adopt"):
        call_next(rank, world)
    print(f"OK backend={dist.get_backend()} world={world}", flush=True)
    dist.destroy_process_group()
    if mode in ("rpc", "adopt"):
        rpcdist.shutdown()


if __name__ == "__main__":
    main()
