"""PyTorch's DDP + RPC example (pytorch/examples distributed/rpc/ddp_rpc), in
our own words and on CPU: an EmbeddingBag on a parameter server behind a
RemoteModule (made by the master and sent to the trainers), a DDP-wrapped
Linear on each of two trainers (gloo), one distributed backward in which
torch DDP's reducer all-reduces, and a DistributedOptimizer over both."""

from __future__ import annotations

import random
from typing import Any

import flavors
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

M: Any = None
NUM_EMBEDDINGS, EMBEDDING_DIM = 100, 16


class HybridModel(torch.nn.Module):
    def __init__(self, remote_emb_module: Any) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        torch.manual_seed(0)
        self.fc = DDP(torch.nn.Linear(16, 8))

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.remote_emb_module.forward(indices, offsets))


def batches(rank: int, n: int) -> Any:
    rnd = random.Random(rank)
    g = torch.Generator().manual_seed(rank)
    for _ in range(n):
        num_indices = rnd.randint(20, 50)
        indices = torch.randint(0, NUM_EMBEDDINGS, (num_indices,), generator=g)
        offsets, start = [], 0
        while start < num_indices:
            offsets.append(start)
            start += rnd.randint(1, 10)
        target = (indices[torch.tensor(offsets)] % 8).long()  # learnable from the bag's first index
        yield indices, torch.tensor(offsets), target


def run_trainer(remote_emb_module: Any, rank: int, steps: int) -> dict[str, Any]:
    model = HybridModel(remote_emb_module)
    rrefs = model.remote_emb_module.remote_parameters()
    rrefs += [M.rpc.RRef(p) for p in model.fc.parameters()]
    opt = M.DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    losses, first_grads = [], None
    for indices, offsets, target in batches(rank, steps):
        with M.dist_autograd.context() as context_id:
            loss = criterion(model(indices, offsets), target)
            M.dist_autograd.backward(context_id, [loss])
            if first_grads is None:
                grads = M.dist_autograd.get_gradients(context_id)
                first_grads = [grads[p].numpy().copy() for p in model.fc.parameters()]
                grad_left_alone = all(p.grad is None for p in model.fc.parameters())
            opt.step(context_id)
            losses.append(loss.item())
    # NumPy, not torch, through the test's result queue (torch shares tensors by fd)
    return {
        "losses": losses,
        "first_grads": first_grads,
        "grad_left_alone": grad_left_alone,
        "fc": {k: v.numpy().copy() for k, v in model.fc.module.state_dict().items()},
    }


def run(rank: int, world: int, init_method: str, flavor: str, pg_init: str, steps: int) -> Any:
    global M
    M = flavors.use(flavor)
    opts = flavors.options(flavor, init_method)
    out = None
    if rank == 2:
        M.rpc.init_rpc("master", rank=rank, world_size=world, rpc_backend_options=opts)
        emb = M.RemoteModule(
            "ps",
            torch.nn.EmbeddingBag,
            args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
            kwargs={"mode": "sum"},
        )
        futs = [M.rpc.rpc_async(f"trainer{r}", run_trainer, args=(emb, r, steps)) for r in (0, 1)]
        out = [f.wait() for f in futs]
    elif rank <= 1:
        dist.init_process_group(backend="gloo", rank=rank, world_size=2, init_method=pg_init)
        M.rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    else:
        M.rpc.init_rpc("ps", rank=rank, world_size=world, rpc_backend_options=opts)
    M.rpc.shutdown()
    if rank <= 1:
        dist.destroy_process_group()
    return out
