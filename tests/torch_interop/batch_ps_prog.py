"""PyTorch's batch-update parameter server (pytorch/examples
distributed/rpc/batch/parameter_server.py), in our own words: trainers send
gradients to an ``@async_execution`` method whose ``torch.futures.Future``
completes once every trainer reported, when the server steps and replies with
the whole model (an ``nn.Module`` on the wire). Like the original it first
makes a gloo process group with ``env://``, so torch's store already listens
on ``MASTER_PORT`` when RPC starts."""

from __future__ import annotations

import threading
from typing import Any

import flavors
import torch
import torch.distributed as dist
from torch import nn

M: Any = None
NUM_CLASSES, BATCH, BATCHES = 5, 8, 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, NUM_CLASSES),
    )


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size: int) -> None:
        self.model = make_model()
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self) -> nn.Module:
        return self.model

    @staticmethod
    def update_and_fetch_model(ps_rref: Any, grads: list[torch.Tensor]) -> Any:
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


def _decorate() -> None:
    """``@rpc.functions.async_execution`` under ``@staticmethod``, from the flavor."""
    fn = BatchUpdateParameterServer.__dict__["update_and_fetch_model"].__func__
    fn = getattr(fn, "__wrapped__", fn)
    decorated = staticmethod(M.rpc.functions.async_execution(fn))
    BatchUpdateParameterServer.update_and_fetch_model = decorated  # type: ignore[method-assign]


class Trainer:
    def __init__(self, ps_rref: Any, rank: int) -> None:
        self.ps_rref = ps_rref
        self.loss_fn = nn.MSELoss()
        self.g = torch.Generator().manual_seed(rank)
        self.one_hot = torch.randint(0, NUM_CLASSES, (BATCH, 1), generator=self.g)

    def batches(self) -> Any:
        for _ in range(BATCHES):
            inputs = torch.randn(BATCH, 3, 8, 8, generator=self.g)
            inputs[:, 0] += self.one_hot.view(-1, 1, 1).float()
            yield inputs, torch.zeros(BATCH, NUM_CLASSES).scatter_(1, self.one_hot, 1)

    def train(self) -> list[float]:
        losses = []
        m = self.ps_rref.rpc_sync().get_model()
        for inputs, labels in self.batches():
            loss = self.loss_fn(m(inputs), labels)
            loss.backward()
            losses.append(loss.item())
            m = M.rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.parameters()]),
            )
        return losses


def run_trainer(ps_rref: Any) -> list[float]:
    return Trainer(ps_rref, M.rpc.get_worker_info().id).train()


def run_ps(trainers: list[str]) -> list[list[float]]:
    ps_rref = M.rpc.RRef(BatchUpdateParameterServer(len(trainers)))
    futs = [M.rpc.rpc_async(t, run_trainer, args=(ps_rref,)) for t in trainers]
    return M.futures.wait_all(futs)


def run(rank: int, world: int, init_method: str, flavor: str) -> Any:
    global M
    M = flavors.use(flavor)
    _decorate()
    dist.init_process_group(backend="gloo", rank=rank, world_size=world)  # env://
    options = M.rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    out = None
    if rank:
        M.rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    else:
        M.rpc.init_rpc("ps", rank=rank, world_size=world, rpc_backend_options=options)
        out = run_ps([f"trainer{r}" for r in range(1, world)])
    M.rpc.shutdown()
    dist.destroy_process_group()
    return out
