"""PyTorch's distributed RNN example (pytorch/examples distributed/rpc/rnn),
in our own words: an embedding table and a decoder live on a parameter
server, the LSTM on the trainer; one distributed backward and a
DistributedOptimizer train all three. Runs under either flavor."""

from __future__ import annotations

from typing import Any

import flavors
import torch
from torch import nn

M: Any = None  # the flavor's modules, set by run()


def call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return M.rpc.rpc_sync(rref.owner(), call_method, args=[method, rref, *args], kwargs=kwargs)


def param_rrefs(module: nn.Module) -> list[Any]:
    return [M.rpc.RRef(p) for p in module.parameters()]


def seed(n: int) -> None:
    torch.manual_seed(n)


class Embedding(nn.Module):
    def __init__(self, ntoken: int, ninp: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        # The server may build the two modules at once (two remote() calls in
        # flight): each draws from a generator of its own, not the global one.
        g = torch.Generator().manual_seed(10)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1, generator=g)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.encoder(tokens))


class Decoder(nn.Module):
    def __init__(self, ntoken: int, nhid: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(
            self.decoder.weight, -0.1, 0.1, generator=torch.Generator().manual_seed(11)
        )

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    def __init__(
        self, ps: str, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.5
    ) -> None:
        super().__init__()
        self.emb_rref = M.rpc.remote(ps, Embedding, args=(ntoken, ninp, dropout))
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.dec_rref = M.rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, tokens: torch.Tensor, hidden: Any) -> Any:
        emb = remote_method(Embedding.forward, self.emb_rref, tokens)
        output, hidden = self.rnn(emb, hidden)
        return remote_method(Decoder.forward, self.dec_rref, output), hidden

    def parameter_rrefs(self) -> list[Any]:
        return [
            *remote_method(param_rrefs, self.emb_rref),
            *param_rrefs(self.rnn),
            *remote_method(param_rrefs, self.dec_rref),
        ]


def train(
    epochs: int = 3, batches: int = 5, sizes: tuple[int, ...] = (5, 7, 2, 3, 6, 4)
) -> list[float]:
    batch, ntoken, ninp, nhid, nindices, nlayers = sizes
    g = torch.Generator().manual_seed(0)
    hidden = (
        torch.randn(nlayers, nindices, nhid, generator=g),
        torch.randn(nlayers, nindices, nhid, generator=g),
    )
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers)
    opt = M.DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05)
    M.rpc.rpc_sync("ps", seed, args=(12,))  # the server's dropout, from here on
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _ in range(epochs):
        for _ in range(batches):
            data = torch.randint(0, ntoken, (batch, nindices), generator=g)
            target = torch.randint(0, ntoken, (batch, nindices), generator=g)
            with M.dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                loss = criterion(output.reshape(-1, ntoken), target.reshape(-1))
                M.dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
                losses.append(loss.item())
    return losses


def run(rank: int, world: int, init_method: str, flavor: str, epochs: int = 3) -> Any:
    global M
    M = flavors.use(flavor)
    torch.manual_seed(rank)
    opts = flavors.options(flavor, init_method)
    out = None
    if rank == 1:
        M.rpc.init_rpc("trainer", rank=rank, world_size=world, rpc_backend_options=opts)
        out = train(epochs)
    else:
        M.rpc.init_rpc("ps", rank=rank, world_size=world, rpc_backend_options=opts)
    M.rpc.shutdown()
    return out
