"""PyTorch's RPC parameter server example (pytorch/examples
distributed/rpc/parameter_server), in our own words and on synthetic data:
trainers run a model that lives on the server through RPC, one distributed
backward per batch, a DistributedOptimizer steps the server's parameters."""

from __future__ import annotations

import threading
from typing import Any

import flavors
import torch
import torch.nn.functional as F
from torch import nn

M: Any = None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.conv2(F.relu(self.conv1(x))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return M.rpc.rpc_sync(rref.owner(), call_method, args=[method, rref, *args], kwargs=kwargs)


class ParameterServer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Net()
        #: Trainers that share the server take turns when asked: the optimizer
        #: steps the parameters in place, which would break the graph another
        #: trainer's backward still needs (under PyTorch RPC too).
        self.turn = threading.Lock()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.model(inp)

    def get_dist_gradients(self, cid: int) -> dict[torch.Tensor, torch.Tensor]:
        return dict(M.dist_autograd.get_gradients(cid).items())

    def take_turn(self) -> None:
        self.turn.acquire()

    def end_turn(self) -> None:
        self.turn.release()

    def get_param_rrefs(self) -> list[Any]:
        return [M.rpc.RRef(p) for p in self.model.parameters()]


_server = None
_lock = threading.Lock()


def get_parameter_server() -> ParameterServer:
    global _server
    with _lock:
        if _server is None:
            _server = ParameterServer()
        return _server


class TrainerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ps_rref = M.rpc.remote("parameter_server", get_parameter_server)

    def get_global_param_rrefs(self) -> list[Any]:
        return remote_method(ParameterServer.get_param_rrefs, self.ps_rref)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remote_method(ParameterServer.forward, self.ps_rref, x)


def data(rank: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable synthetic task: each label adds its own pattern to the noise."""
    patterns = torch.randn(10, 1, 12, 12, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(batches):
        y = torch.randint(0, 10, (16,), generator=g)
        out.append((torch.randn(16, 1, 12, 12, generator=g) + 1.5 * patterns[y], y))
    return out


def train(rank: int, batches: int, turns: bool) -> dict[str, Any]:
    net = TrainerNet()
    opt = M.DistributedOptimizer(torch.optim.SGD, net.get_global_param_rrefs(), lr=0.1)
    losses, grads_seen = [], []
    for x, y in data(rank, batches):
        if turns:
            remote_method(ParameterServer.take_turn, net.ps_rref)
        with M.dist_autograd.context() as cid:
            loss = F.nll_loss(net(x), y)
            M.dist_autograd.backward(cid, [loss])
            grads = remote_method(ParameterServer.get_dist_gradients, net.ps_rref, cid)
            grads_seen.append(len(grads))
            opt.step(cid)
            losses.append(loss.item())
        if turns:
            remote_method(ParameterServer.end_turn, net.ps_rref)
    return {"losses": losses, "grads_seen": grads_seen}


def run(rank: int, world: int, init_method: str, flavor: str, batches: int = 10) -> Any:
    global M
    M = flavors.use(flavor)
    torch.manual_seed(rank)
    opts = flavors.options(flavor, init_method)
    name = "parameter_server" if rank == 0 else f"trainer_{rank}"
    M.rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
    out = train(rank, batches, world > 2) if rank else None
    M.rpc.shutdown()
    return out
