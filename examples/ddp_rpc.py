"""DDP and RPC together: a remote embedding table on a server, a replicated dense part.

Run it through the launcher (1 parameter server + 2 trainers)::

    python -m rpcdist.launch --nproc-per-node 3 examples/ddp_rpc.py

or on its own, which launches itself the same way::

    python examples/ddp_rpc.py [--epochs 8]

The shape of a recommendation model, on real data: each handwritten digit
(scikit-learn's digits, 8x8 pixels) becomes 64 sparse features, "pixel p
has grey level v" (levels rounded to 5), i.e. 64 ids out of 64 x 5 = 320.
The model is

* an embedding bag, ``Bag``: a 320 x 32 table whose rows for a digit's 64
  ids are averaged. It lives on rank 0 (``"ps"``) only: the trainers reach it
  through ``rpcdist.nn.RemoteModule("ps", shared_bag)``. ``shared_bag`` is a
  factory that returns the server's one table, so both trainers' remote
  modules front the same rows (a class would make one table per trainer);
* a dense part, ``Dense``: 32 -> 64 -> 10, replicated on the two trainers
  with ``DistributedDataParallel`` over a process group of the trainers only
  (``collectives.new_group([1, 2])``).

One ``DistributedOptimizer`` (Adam) holds RRefs to both: the table's
parameters on the server (``remote_parameters()``) and each trainer's dense
parameters (``rpcdist.RRef(p)``). A step::

    with dist_autograd.context() as cid:
        features = bag(ids)                   # RPC to the server
        loss = F.cross_entropy(dense(features), labels)
        dist_autograd.backward(cid, [loss])   # DDP averages the dense gradients
                                              # across trainers; the table's go
                                              # back to the server
        opt.step(cid)

Measured with ``python benchmarks/bench_examples.py`` (2-core VM shared with
other jobs, load average 7; defaults: 2 trainers, 8 epochs, batch 32 per
trainer): test accuracy 0.955, 7.8 s from start to exit (docs/benchmarks.md).
"""

from __future__ import annotations

import os

# One BLAS thread per process: the workers share the cores.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import sys
import threading
import time

import numpy as np
import ps_common

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist import collectives as dist
from rpcdist import nn, optim
from rpcdist import tensor as rt
from rpcdist.nn import functional as F
from rpcdist.parallel import DistributedDataParallel as DDP

PIXELS, LEVELS, DIM = 64, 5, 32


def to_ids(x: np.ndarray) -> np.ndarray:
    """Digits (scaled to [0, 1]) as 64 sparse feature ids each: pixel * LEVELS + level."""
    levels = np.rint(x * (LEVELS - 1)).astype(np.int64)
    return np.arange(PIXELS) * LEVELS + levels


class Bag(nn.Module):
    """An embedding bag: the mean of the table rows of each sample's ids."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(PIXELS * LEVELS, DIM)

    def forward(self, ids: np.ndarray) -> rt.Tensor:
        return self.table(ids).mean(axis=1)


class Dense(nn.Module):
    """The replicated part: 32 -> 64 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: rt.Tensor) -> rt.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


# ------------------------------------------------------------- on the server


_BAG: Bag | None = None
_BAG_LOCK = threading.Lock()
_TRAINERS_DONE = threading.Semaphore(0)


def shared_bag() -> Bag:
    """The server's one embedding bag, made on first use (a RemoteModule factory)."""
    global _BAG
    with _BAG_LOCK:
        if _BAG is None:
            rt.manual_seed(0)
            _BAG = Bag()
        return _BAG


def trainer_done() -> None:
    """A trainer finished; the server stops serving when all have."""
    _TRAINERS_DONE.release()


# ------------------------------------------------------------- on the trainers


def train(rank: int, trainers: int, group: dist.ProcessGroup, args: argparse.Namespace) -> None:
    x_train, y_train, x_test, y_test = ps_common.load_digits(args.seed)
    x, y = ps_common.shard(to_ids(x_train), y_train, rank - 1, trainers)
    bag = nn.RemoteModule("ps", shared_bag)  # type: ignore[arg-type]  # a factory, see above
    rt.manual_seed(args.seed + rank)  # DDP broadcasts the first trainer's weights
    dense = DDP(Dense(), process_group=group)
    params = bag.remote_parameters() + [rpcdist.RRef(p) for p in dense.parameters()]
    opt = optim.DistributedOptimizer(optim.Adam, params, lr=args.lr)
    rng = np.random.default_rng([args.seed, rank])
    steps = len(x) // args.batch_size  # the same on both trainers: equal shards
    if rank == 1:
        print(f"{'epoch':>5}  {'loss (trainer1)':>15}  {'test acc':>8}", flush=True)
    for epoch in range(1, args.epochs + 1):
        order, losses = rng.permutation(len(x)), []
        for i in range(steps):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            with dist_autograd.context() as cid:
                loss = F.cross_entropy(dense(bag(x[idx])), y[idx])
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
            losses.append(float(loss.item()))
        if rank == 1:
            with rt.no_grad():
                logits = dense.module(bag(to_ids(x_test)))
            acc = float((logits.data.argmax(axis=1) == y_test).mean())
            print(f"{epoch:>5}  {np.mean(losses):>15.4f}  {acc:>8.3f}", flush=True)
    if rank == 1:
        print(f"final test accuracy {acc:.4f}")
        if acc < args.min_accuracy:
            print(f"FAILED: accuracy {acc:.4f} is below {args.min_accuracy}")
            sys.exit(1)


def worker_main(args: argparse.Namespace) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpcdist.init_rpc("ps" if rank == 0 else f"trainer{rank}")
    dist.init_process_group()  # on top of the RPC agent: the same connections
    group = dist.new_group(list(range(1, world)))  # every process calls it; DDP's group
    if rank == 0:
        for _ in range(world - 1):  # serve the table until every trainer is done
            _TRAINERS_DONE.acquire()
    else:
        train(rank, world - 1, group, args)
        rpcdist.rpc_sync("ps", trainer_done)
    dist.destroy_process_group()
    rpcdist.shutdown()
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Remote embedding table (RemoteModule) + DDP dense part + one "
        "DistributedOptimizer, on the digits.",
        epilog="Run: python -m rpcdist.launch --nproc-per-node 3 examples/ddp_rpc.py",
    )
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per trainer and step")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this")
    p.add_argument("--workers", type=int, default=3, help="processes when run standalone")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        from rpcdist import launch

        start = time.perf_counter()
        code = launch.main(["--nproc-per-node", str(args.workers), __file__, *argv])
        print(f"wall time {time.perf_counter() - start:.1f} s; exit code {code}")
        return code
    if int(os.environ["WORLD_SIZE"]) < 3:
        print("ddp_rpc.py needs at least 3 processes (1 server, 2 trainers)")
        return 2
    return worker_main(args)


if __name__ == "__main__":
    sys.exit(main())
