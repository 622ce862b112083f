"""Functions rpcdist.spawn runs in its processes (importable by module name)."""

from __future__ import annotations

import os
import signal
import threading

import rpcdist


def double(x):
    return 2 * x


def rpc_job(rank, out_dir):
    """Forms a job from the environment alone and calls the next rank."""
    world = int(os.environ["WORLD_SIZE"])
    rpcdist.init_rpc(f"w{rank}")
    got = rpcdist.rpc_sync(f"w{(rank + 1) % world}", double, args=(rank,))
    rpcdist.shutdown()
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{os.environ['RANK']} {os.environ['LOCAL_RANK']} {world} {got}")


def fail_on_one(rank, out_dir):
    """Rank 1 raises; the others wait to be stopped, leaving their pid."""
    if rank == 1:
        raise ValueError("rank one gives up")
    _park(rank, out_dir)


def die_on_one(rank, out_dir):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _park(rank, out_dir)


def _park(rank, out_dir):
    path = os.path.join(out_dir, f"pid{rank}")
    with open(path + ".tmp", "w") as f:  # (renamed: killed mid-write, no empty pid file)
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    threading.Event().wait()  # until spawn stops this process
