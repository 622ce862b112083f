"""Data-parallel training with ``DistributedDataParallel``: uneven shards, checkpoint, resume.

Run it through the launcher (p = 2 ranks; any p works)::

    python -m rpcdist.launch --nproc-per-node 2 examples/ddp.py

A crash and an automatic resume: rank 1 exits with an error during epoch 3
of the first attempt, the launcher starts the job again, and every rank
resumes from the checkpoint that rank 0 wrote after epoch 2::

    python -m rpcdist.launch --nproc-per-node 2 --max-restarts 1 examples/ddp.py --crash-at-epoch 3

or on its own, which launches itself with ``--workers`` ranks and one restart::

    python examples/ddp.py [--workers 3] [--crash-at-epoch 3]

Every rank holds a replica of the same 64 -> 128 -> 10 perceptron (the digits
classifier of the parameter-server example) and a shard of the training
set. The shards are deliberately uneven (rank r gets a share proportional to
r + 2), so ranks run out of batches at different times. ``Join([model])``
handles that: a rank that has finished its shard keeps answering the others'
gradient all-reduces with zeros until everyone is done, instead of leaving
them waiting.

``model = DistributedDataParallel(Net())`` broadcasts rank 0's weights to
every rank at construction; after that each ``loss.backward()`` returns with
the gradients averaged over the ranks, so the optimizers (one per rank, plain
``rpcdist.optim.SGD``) keep the replicas identical. After each epoch rank 0
writes ``model.module.state_dict()``, the optimizer state and the epoch
number with ``rpcdist.save``; at start-up (``--resume``, or automatically
when the launcher restarted the job: ``RPCDIST_RESTART_COUNT`` > 0) every
rank loads it and continues from the next epoch.

Measured with ``python benchmarks/bench_examples.py`` (2-core VM shared with
other jobs, load average 8; defaults: 2 ranks, 10 epochs, batch 32 per
rank): test accuracy 0.961, 7.1 s from start to exit; with
``--crash-at-epoch 3`` the restarted job resumes at epoch 3 and reaches
0.969, 10.4 s in all (docs/benchmarks.md).
"""

from __future__ import annotations

import os

# One BLAS thread per process: the ranks share the cores.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import sys
import time

import numpy as np
import ps_common
from ps_common import Net

import rpcdist
from rpcdist import collectives as dist
from rpcdist import optim
from rpcdist import tensor as rt
from rpcdist.nn import functional as F
from rpcdist.parallel import DistributedDataParallel as DDP
from rpcdist.parallel import Join


def uneven_shard(n: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s slice of ``n`` samples; rank r's share grows with r + 2."""
    weights = np.arange(2, world + 2, dtype=np.float64)
    bounds = np.concatenate([[0], np.cumsum(weights / weights.sum() * n)]).astype(int)
    return slice(bounds[rank], bounds[rank + 1])


def train(args: argparse.Namespace) -> int:
    dist.init_process_group()  # rank, world size, address and token from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    restarts = int(os.environ.get("RPCDIST_RESTART_COUNT", "0"))
    x_train, y_train, x_test, y_test = ps_common.load_digits(args.seed)
    part = uneven_shard(len(x_train), rank, world)
    x, y = x_train[part], y_train[part]

    rt.manual_seed(args.seed + rank)  # different on purpose: DDP broadcasts rank 0's
    model = DDP(Net())
    opt = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    first = 1
    if (args.resume or restarts > 0) and os.path.exists(args.checkpoint):
        saved = rpcdist.load(args.checkpoint)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        first = int(saved["epoch"]) + 1
        if rank == 0:
            print(f"resumed from {args.checkpoint}: epoch {first - 1} done", flush=True)
    if rank == 0:
        parts = [uneven_shard(len(x_train), r, world) for r in range(world)]
        sizes = [int(p.stop - p.start) for p in parts]
        print(
            f"{world} ranks, shard sizes {sizes} (uneven: Join evens them out); "
            f"attempt {restarts + 1}",
            flush=True,
        )
        print(f"{'epoch':>5}  {'loss (rank 0)':>13}  {'test acc':>8}  {'batches per rank'}")
    rng = np.random.default_rng([args.seed, rank, first])
    for epoch in range(first, args.epochs + 1):
        if epoch == args.crash_at_epoch and restarts == 0 and rank == world - 1:
            print(f"rank {rank}: crashing on purpose in epoch {epoch}", flush=True)
            os._exit(1)  # as a crash would: no cleanup; the launcher restarts the job
        order = rng.permutation(len(x))
        steps = len(x) // args.batch_size
        losses = []
        with Join([model]):  # this rank may run out of batches before the others
            for i in range(steps):
                idx = order[i * args.batch_size : (i + 1) * args.batch_size]
                opt.zero_grad()
                loss = F.cross_entropy(model(rt.tensor(x[idx])), y[idx])
                loss.backward()  # returns with gradients averaged over the ranks
                opt.step()
                losses.append(float(loss.item()))
        counts = np.array([steps], dtype=np.int64)
        everyone = [np.zeros(1, dtype=np.int64) for _ in range(world)]
        dist.all_gather(everyone, counts)
        if rank == 0:
            accuracy = ps_common.accuracy(model.module, x_test, y_test)
            print(
                f"{epoch:>5}  {np.mean(losses):>13.4f}  {accuracy:>8.3f}  "
                f"{[int(c[0]) for c in everyone]}",
                flush=True,
            )
            state = {"model": model.module.state_dict(), "optim": opt.state_dict(), "epoch": epoch}
            rpcdist.save(state, args.checkpoint)
        dist.barrier()  # nobody starts the next epoch before the checkpoint is written
    code = 0
    accuracy = ps_common.accuracy(model.module, x_test, y_test)
    if rank == 0:
        print(f"final test accuracy {accuracy:.4f}; checkpoint {os.path.abspath(args.checkpoint)}")
        if accuracy < args.min_accuracy:
            print(f"FAILED: accuracy {accuracy:.4f} is below {args.min_accuracy}")
            code = 1
    dist.destroy_process_group()
    return code


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="DistributedDataParallel on the digits, with Join, checkpoint and resume.",
        epilog="Run: python -m rpcdist.launch --nproc-per-node 2 examples/ddp.py",
    )
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default="build/ddp/checkpoint.npz")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument(
        "--crash-at-epoch", type=int, default=0, help="last rank exits in this epoch (1st attempt)"
    )
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this")
    p.add_argument("--workers", type=int, default=2, help="ranks when run standalone")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        from rpcdist import launch

        start = time.perf_counter()
        code = launch.main(
            ["--nproc-per-node", str(args.workers), "--max-restarts", "1", __file__, *argv]
        )
        print(f"wall time {time.perf_counter() - start:.1f} s; exit code {code}")
        return code
    os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
