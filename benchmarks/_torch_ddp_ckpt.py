"""PyTorch's side of ``bench_fault_tolerance.py``: one rank of the same
training as ``examples/ddp_fault_tolerant.py --mode plain``, with
``torch.nn.parallel.DistributedDataParallel`` over a Gloo process group.

The digits (scikit-learn's, the example's split), a 64-128-10 MLP, 32
samples per rank and step from a ``DistributedSampler``, SGD (lr 0.05,
momentum 0.9). Rank 0 saves a checkpoint every ``--checkpoint-every``
steps (model, optimizer, sampler epoch and position, step; written to a
temporary file, then renamed); every rank resumes from it when torchrun
restarts the group after a rank died.

Rank 0 keeps a beacon, a small file the benchmark reads while the job
runs: ``BEACON`` float64 fields, written through ``mmap`` after every step.
The benchmark imports this module for :func:`read_beacon` only, so torch is
imported in :func:`main`, not at the top.

Run under torchrun:
``python -m torch.distributed.run --nproc-per-node 4 --max-restarts 1000
benchmarks/_torch_ddp_ckpt.py --workdir DIR``
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import mmap
import struct
import time
from typing import Any

import numpy as np

#: The beacon's fields: the torchrun attempt (1 + its restart count), the last
#: step finished, the step this attempt resumed from, when the attempt
#: finished its first step, the last step checkpointed, when the last step
#: finished (``time.monotonic()``, the same clock in every process).
BEACON = ("attempt", "step", "resumed", "first", "saved", "last")
_FMT = f"{len(BEACON)}d"


def read_beacon(path: str) -> dict[str, float] | None:
    """The beacon's fields (``None`` before rank 0 created it)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(struct.calcsize(_FMT))
    except OSError:
        return None
    if len(raw) < struct.calcsize(_FMT):
        return None
    return dict(zip(BEACON, struct.unpack(_FMT, raw), strict=True))


def digits(seed: int) -> tuple[Any, Any]:
    """The example's training split of the digits (``ps_common.load_digits``)."""
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.data))[int(len(data.data) * 0.2) :]
    x = torch.from_numpy((data.data[order] / 16.0).astype(np.float32))
    return x, torch.from_numpy(data.target[order].astype(np.int64))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="checkpoint and beacon")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps")
    p.add_argument("--batch-size", type=int, default=32, help="per rank and step")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=10**9, help="stop after this many")
    args = p.parse_args()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, y = digits(args.seed)
    torch.manual_seed(args.seed)
    model = DDP(nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(range(len(x)), seed=args.seed)
    step, epoch, pos = 0, 0, 0
    ckpt = os.path.join(args.workdir, "checkpoint.pt")
    if os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        step, epoch, pos = saved["step"], saved["epoch"], saved["pos"]
    beacon = None
    if rank == 0:
        path = os.path.join(args.workdir, "beacon")
        with open(path, "a+b") as f:
            f.truncate(struct.calcsize(_FMT))
            beacon = mmap.mmap(f.fileno(), 0)
        attempt = 1.0 + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resumed = step
    while step < args.steps:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.int64)
        while pos < len(order) and step < args.steps:
            idx = order[pos : pos + args.batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            step, pos = step + 1, pos + len(idx)
            if beacon is None:
                continue
            now = time.monotonic()
            if step == resumed + 1:  # the attempt's first step: the job is back
                struct.pack_into("3d", beacon, 8 * BEACON.index("step"), step, resumed, now)
                struct.pack_into("d", beacon, 0, attempt)
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                state = {"model": model.module.state_dict(), "optim": opt.state_dict()}
                state.update(step=step, epoch=epoch, pos=pos)
                torch.save(state, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
                struct.pack_into("d", beacon, 8 * BEACON.index("saved"), step)
            struct.pack_into("d", beacon, 8 * BEACON.index("last"), now)
            struct.pack_into("d", beacon, 8 * BEACON.index("step"), step)
        epoch, pos = epoch + 1, 0
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
