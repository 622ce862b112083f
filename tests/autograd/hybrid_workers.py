"""The DDP + RPC hybrid, run by ``test_ddp_in_dist_autograd.py`` on three processes:
embedding tables on a parameter server (rank 0; each trainer makes its own
through RemoteModule), a DDP dense part on two trainers (ranks 1 and 2), one
DistributedOptimizer per trainer over both."""

from __future__ import annotations

from typing import Any

import numpy as np

import rpcdist
import rpcdist.autograd as dist_autograd
import rpcdist.tensor as rt
from rpcdist import collectives as dist
from rpcdist import nn, optim
from rpcdist.nn import functional as F
from rpcdist.parallel import DistributedDataParallel as DDP

VOCAB, DIM, OUT, B, LR, STEPS = 10, 4, 3, 5, 0.1, 3


def table() -> nn.Module:
    return nn.Embedding(VOCAB, DIM, dtype=np.float64, generator=rt.Generator().manual_seed(7))


def dense() -> nn.Module:
    g = rt.Generator().manual_seed(8)
    return nn.Sequential(
        nn.Linear(DIM, 6, dtype=np.float64, generator=g),
        nn.Tanh(),
        nn.Linear(6, OUT, dtype=np.float64, generator=g),
    )


def batch(step: int, trainer: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(1000 * step + trainer)
    return rng.integers(0, VOCAB, B), rng.integers(0, OUT, B)


def run(rank: int, world: int, init_method: str) -> dict[str, Any]:
    rpcdist.init_rpc(
        f"w{rank}",
        rank=rank,
        world_size=world,
        init_method=init_method,
        options=rpcdist.RpcOptions(token=None),
    )
    dist.init_process_group()
    trainers = dist.new_group([1, 2])
    out: dict[str, Any] = {}
    if rank == 0:
        dist.barrier()  # the trainers are done
        rpcdist.shutdown()
        return out
    emb = nn.RemoteModule("w0", table)
    model = DDP(dense(), process_group=trainers)
    params = emb.remote_parameters() + [rpcdist.RRef(p) for p in model.parameters()]
    opt = optim.DistributedOptimizer(optim.SGD, params, lr=LR)
    for step in range(STEPS):
        ids, y = batch(step, rank)
        with dist_autograd.context() as cid:
            loss = F.cross_entropy(model(emb(ids)), y)
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
            if step == 0:
                out["dense_grads"] = [grads[p] for p in model.parameters()]
                out["grad_left_alone"] = all(p.grad is None for p in model.parameters())
            dist.barrier(group=trainers)  # both trainers' averages are in: step in turn
            if rank == 1:
                opt.step(cid)
            dist.barrier(group=trainers)
            if rank == 2:
                opt.step(cid)
            dist.barrier(group=trainers)
    out["dense"] = {k: v for k, v in model.module.state_dict().items()}
    out["table"] = rpcdist.rpc_sync("w0", _table_weight, args=(emb.get_module_rref(),))
    del emb, params, opt
    dist.barrier()
    rpcdist.shutdown()
    return out


def _table_weight(module_rref: Any) -> Any:
    return module_rref.local_value().weight.data.copy()


def oracle() -> dict[str, Any]:
    """The same training in one process: each trainer's table steps with its own
    gradient; the dense part (one replica, as DDP keeps them identical) with
    the average of the two trainers' gradients."""
    tabs, den = {1: table(), 2: table()}, dense()
    dense_grads0: list[Any] = []
    for step in range(STEPS):
        per: dict[int, tuple[list[Any], Any]] = {}
        for trainer in (1, 2):
            ids, y = batch(step, trainer)
            tab = tabs[trainer]
            for p in [*tab.parameters(), *den.parameters()]:
                p.grad = None
            F.cross_entropy(den(tab(ids)), y).backward()
            per[trainer] = (
                [p.grad.data.copy() for p in den.parameters()],
                tab.weight.grad.data.copy(),
            )
        avg = [(a + b) / 2 for a, b in zip(per[1][0], per[2][0])]
        if step == 0:
            dense_grads0 = avg
        with rt.no_grad():
            for p, g in zip(den.parameters(), avg):
                p.data -= LR * g
            for trainer in (1, 2):
                tabs[trainer].weight.data -= LR * per[trainer][1]
    return {
        "dense_grads": dense_grads0,
        "dense": den.state_dict(),
        "table": {t: tabs[t].weight.data for t in (1, 2)},
    }
