"""FSDP (or DDP) training through the launcher, resuming from a checkpoint at any world size.

``train_fsdp.py DIR --steps S [--hold RANK:STEP] [--ddp]``

A small MLP (float64) fits the rows of ``train.py``'s data set with Adam,
wrapped in ``FullyShardedDataParallel`` (one unit per Linear). Rank ``r``
of ``W`` takes rows ``r::W``; its loss is scaled by ``W`` so that the
averaged gradient is the full data set's, whatever ``W``. After every step
the full model and optimizer state (gathered, so they reshard to any world
size) go to ``DIR/ckpt``; every run starts from it when it exists. With
``--ddp`` the model is wrapped in ``DistributedDataParallel`` instead and the
checkpoint is the plain module's and optimizer's state dicts. Like
``train.py`` it logs ``restart world rank first_step`` to ``DIR/starts.log``,
holds on the first attempt with ``--hold``, and rank 0 saves ``DIR/final``.

:func:`reference` trains the same model in one process.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train import ROWS, data, hold_here


def model() -> Any:
    import rpcdist.tensor as rt
    from rpcdist import nn

    g = rt.Generator().manual_seed(7)
    return nn.Sequential(
        nn.Linear(4, 8, dtype=np.float64, generator=g),
        nn.Tanh(),
        nn.Linear(8, 1, dtype=np.float64, generator=g),
    )


def loss(m: Any, rank: int, world: int) -> Any:
    import rpcdist.tensor as rt

    x, y = data()
    pred = m(rt.tensor(x[rank::world]))
    diff = pred - rt.tensor(y[rank::world].reshape(-1, 1))
    return (diff * diff).sum() * (world / ROWS)


def optimizer(params: Any) -> Any:
    from rpcdist import optim

    return optim.Adam(params, lr=0.05)


def reference(steps: int) -> dict[str, np.ndarray]:
    """The state dict after ``steps`` steps of one process on all rows."""
    m = model()
    o = optimizer(list(m.parameters()))
    for _ in range(steps):
        o.zero_grad()
        loss(m, 0, 1).backward()
        o.step()
    return m.state_dict()


def main() -> int:
    import rpcdist
    from rpcdist import collectives as dist
    from rpcdist import nn
    from rpcdist.parallel import DistributedDataParallel, FullyShardedDataParallel, ModuleWrapPolicy

    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--hold")
    p.add_argument("--ddp", action="store_true")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ["RPCDIST_RESTART_COUNT"])
    hold = tuple(int(v) for v in args.hold.split(":")) if args.hold and restart == 0 else None
    ckpt = os.path.join(args.dir, "ckpt")

    dist.init_process_group()
    if args.ddp:
        wrapped: Any = DistributedDataParallel(model())
    else:
        wrapped = FullyShardedDataParallel(model(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    opt = optimizer(list(wrapped.parameters()))

    def checkpoint() -> dict[str, Any]:  # a collective for FSDP: every rank calls it
        if args.ddp:
            return {"model": wrapped.module.state_dict(), "optim": opt.state_dict()}
        return {"model": wrapped.state_dict(), "optim": wrapped.optim_state_dict(opt)}

    first = 0
    if os.path.exists(ckpt):
        saved = rpcdist.load(ckpt)
        if args.ddp:
            wrapped.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
        else:
            wrapped.load_state_dict(saved["model"])
            wrapped.load_optim_state_dict(opt, saved["optim"])
        first = int(saved["step"])
    with open(os.path.join(args.dir, "starts.log"), "a") as f:
        f.write(f"{restart} {world} {rank} {first}\n")
    for i in range(first, args.steps):
        if hold == (rank, i):
            hold_here(args.dir, world)
        opt.zero_grad()
        loss(wrapped, rank, world).backward()
        opt.step()
        state = {"step": i + 1, **checkpoint()}
        if rank == 0:
            rpcdist.save(state, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    final = checkpoint()["model"]
    if rank == 0:
        rpcdist.save(
            {"model": final, "world": world, "restart": restart}, os.path.join(args.dir, "final")
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
