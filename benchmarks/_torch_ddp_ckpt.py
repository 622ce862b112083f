"""PyTorch's side of ``bench_fault_tolerance.py``: one rank of the same
training as ``examples/ddp_fault_tolerant.py --mode plain``, with
``torch.nn.parallel.DistributedDataParallel`` over a Gloo process group.

The digits (scikit-learn's, the example's split), a 64-128-10 MLP, 32
samples per rank and step from a ``DistributedSampler``, SGD (lr 0.05,
momentum 0.9). Rank 0 saves a checkpoint every ``--checkpoint-every``
steps (model, optimizer, sampler epoch and position, step; written to a
temporary file, then renamed); every rank resumes from it when torchrun
restarts the group after a rank died. Rank 0 keeps the benchmark's beacon
as the example's plain mode does.

Run under torchrun:
``python -m torch.distributed.run --nproc-per-node 4 --max-restarts 1000
benchmarks/_torch_ddp_ckpt.py --workdir DIR``
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import struct
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler


def digits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The example's training split of the digits (``ps_common.load_digits``)."""
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
    beacon = -1  # the same 6 float64 as the example's plain mode
    if rank == 0:
        beacon = os.open(os.path.join(args.workdir, "beacon"), os.O_RDWR | os.O_CREAT)
    attempt = 1 + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resumed = checkpointed = step
    first = 0.0
    while step < args.steps:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.int64)
        while pos < len(order) and step < args.steps:
            idx = order[pos : pos + args.batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            step, pos = step + 1, pos + len(idx)
            if beacon < 0:
                continue
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                state = {"model": model.module.state_dict(), "optim": opt.state_dict()}
                state.update(step=step, epoch=epoch, pos=pos)
                torch.save(state, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
                checkpointed = step
            now = time.monotonic()
            first = first or now
            os.pwrite(
                beacon, struct.pack("6d", attempt, step, resumed, first, checkpointed, now), 0
            )
        epoch, pos = epoch + 1, 0
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
