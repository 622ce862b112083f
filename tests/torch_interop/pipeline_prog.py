"""PyTorch's RPC pipeline example (pytorch/examples distributed/rpc/pipeline),
in our own words with a small conv net instead of ResNet-50: two shards on two
workers, micro-batches flow through them as RRefs (``remote().forward`` then
``rpc_async().forward``), and one distributed backward crosses all three
processes; a DistributedOptimizer steps both shards (the example's earlier
form)."""

from __future__ import annotations

import threading
from typing import Any

import flavors
import torch
from torch import nn

M: Any = None


class Shard(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        torch.manual_seed(1 if first else 2)
        self._lock = threading.Lock()
        if first:
            self.seq = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)
            )
        else:
            self.seq = nn.Sequential(
                nn.Conv2d(8, 8, 3, padding=1),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(8, 4),
            )

    def forward(self, x_rref: Any) -> torch.Tensor:
        x = x_rref.to_here()
        with self._lock:
            return self.seq(x)

    def parameter_rrefs(self) -> list[Any]:
        return [M.rpc.RRef(p) for p in self.parameters()]


class DistNet(nn.Module):
    def __init__(self, split_size: int, workers: list[str]) -> None:
        super().__init__()
        self.split_size = split_size
        self.p1_rref = M.rpc.remote(workers[0], Shard, args=(True,))
        self.p2_rref = M.rpc.remote(workers[1], Shard, args=(False,))

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        futs = []
        for x in xs.split(self.split_size, dim=0):
            y_rref = self.p1_rref.remote().forward(M.rpc.RRef(x))
            futs.append(self.p2_rref.rpc_async().forward(y_rref))
        return torch.cat(M.futures.wait_all(futs))

    def parameter_rrefs(self) -> list[Any]:
        return [
            *self.p1_rref.remote().parameter_rrefs().to_here(),
            *self.p2_rref.remote().parameter_rrefs().to_here(),
        ]


def run_master(split_size: int, batches: int = 4) -> list[float]:
    model = DistNet(split_size, ["worker1", "worker2"])
    opt = M.DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.2)
    loss_fn = nn.MSELoss()
    g = torch.Generator().manual_seed(3)
    labels_of = torch.randint(0, 4, (8, 1), generator=g)
    losses = []
    for _ in range(batches):
        inputs = torch.randn(8, 3, 8, 8, generator=g)
        inputs[:, 0] += labels_of.view(-1, 1, 1).float()
        labels = torch.zeros(8, 4).scatter_(1, labels_of, 1)
        with M.dist_autograd.context() as context_id:
            loss = loss_fn(model(inputs), labels)
            M.dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
            losses.append(loss.item())
    return losses


def run(rank: int, world: int, init_method: str, flavor: str, split_size: int = 4) -> Any:
    global M
    M = flavors.use(flavor)
    opts = flavors.options(flavor, init_method, num_worker_threads=16, rpc_timeout=60)
    name = "master" if rank == 0 else f"worker{rank}"
    M.rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
    out = run_master(split_size) if rank == 0 else None
    M.rpc.shutdown()
    return out
