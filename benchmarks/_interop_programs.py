"""The programs ``bench_torch_interop.py`` times, run as their own processes:
PyTorch's RNN example and a parameter-server iteration, under either PyTorch
RPC (``--flavor torch``) or rpcdist.torch (``--flavor rpcdist``), where the
imports are the only difference. Prints one JSON line.

Run: ``python benchmarks/_interop_programs.py {rnn,ps} {torch,rpcdist} [--iters N]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import time_steps

M: Any = None


def use(flavor: str) -> None:
    """The import swap: torch.distributed.* or rpcdist.torch.*."""
    global M
    import types

    if flavor == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.optim import DistributedOptimizer
    else:
        import rpcdist.torch.autograd as dist_autograd
        import rpcdist.torch.rpc as rpc
        from rpcdist.torch.optim import DistributedOptimizer
    M = types.SimpleNamespace(
        rpc=rpc, dist_autograd=dist_autograd, DistributedOptimizer=DistributedOptimizer
    )


# The examples import their RPC modules at the top, so the launching process
# and every spawned one import them: so does this program (the flavor comes
# from the environment, as the command line is parsed later).
if os.environ.get("INTEROP_FLAVOR") in ("torch", "rpcdist"):
    use(os.environ["INTEROP_FLAVOR"])


def _call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return M.rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref, *args], kwargs=kwargs)


def _param_rrefs(module: nn.Module) -> list[Any]:
    return [M.rpc.RRef(p) for p in module.parameters()]


# ------------------------------------------------------------------ the RNN


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken: int, ninp: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.encoder(tokens))


class Decoder(nn.Module):
    def __init__(self, ntoken: int, nhid: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    def __init__(self, ps: str, ntoken: int, ninp: int, nhid: int, nlayers: int) -> None:
        super().__init__()
        self.emb_table_rref = M.rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, 0.5))
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=0.5)
        self.decoder_rref = M.rpc.remote(ps, Decoder, args=(ntoken, nhid, 0.5))

    def forward(self, tokens: torch.Tensor, hidden: Any) -> Any:
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, tokens)
        output, hidden = self.rnn(emb, hidden)
        return _remote_method(Decoder.forward, self.decoder_rref, output), hidden

    def parameter_rrefs(self) -> list[Any]:
        return [
            *_remote_method(_param_rrefs, self.emb_table_rref),
            *_param_rrefs(self.rnn),
            *_remote_method(_param_rrefs, self.decoder_rref),
        ]


def _rnn_trainer() -> None:
    """The example's trainer: 10 epochs of 5 batches, as upstream."""
    batch, ntoken, ninp, nhid, nindices, nlayers = 5, 7, 2, 3, 6, 4
    hidden = (torch.randn(nlayers, nindices, nhid), torch.randn(nlayers, nindices, nhid))
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers)
    opt = M.DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05)
    criterion = nn.CrossEntropyLoss()
    for _ in range(10):
        for _ in range(5):
            data = torch.randint(0, ntoken, (batch, nindices))
            target = torch.randint(0, ntoken, (batch * nindices,))
            with M.dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                loss = criterion(output.reshape(-1, ntoken), target)
                M.dist_autograd.backward(context_id, [loss])
                opt.step(context_id)


def _rnn_worker(rank: int, world_size: int, flavor: str) -> None:
    use(flavor)
    if rank == 1:
        M.rpc.init_rpc("trainer", rank=rank, world_size=world_size)
        _rnn_trainer()
    else:
        M.rpc.init_rpc("ps", rank=rank, world_size=world_size)
    M.rpc.shutdown()


# --------------------------------------------------- a parameter-server step


class Server(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.model(x), dim=1)

    def param_rrefs(self) -> list[Any]:
        return _param_rrefs(self.model)


def _ps_worker(rank: int, world_size: int, flavor: str, iters: int, out: str) -> None:
    use(flavor)
    torch.set_num_threads(1)
    if rank == 1:
        M.rpc.init_rpc("trainer", rank=rank, world_size=world_size)
        server = M.rpc.remote("ps", Server)
        opt = M.DistributedOptimizer(
            torch.optim.SGD, _remote_method(Server.param_rrefs, server), lr=0.05
        )
        x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

        def step() -> None:
            with M.dist_autograd.context() as cid:
                loss = nn.functional.nll_loss(_remote_method(Server.forward, server, x), y)
                M.dist_autograd.backward(cid, [loss])
                opt.step(cid)

        times = time_steps(step, max(5, iters // 10), iters)
        with open(out, "w") as f:
            json.dump(times, f)
    else:
        M.rpc.init_rpc("ps", rank=rank, world_size=world_size)
    M.rpc.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("program", choices=["rnn", "ps"])
    ap.add_argument("flavor", choices=["torch", "rpcdist"])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        sys.exit("set MASTER_PORT")
    if a.program == "rnn":
        mp.spawn(_rnn_worker, args=(2, a.flavor), nprocs=2, join=True)
    else:
        mp.spawn(_ps_worker, args=(2, a.flavor, a.iters, a.out), nprocs=2, join=True)


if __name__ == "__main__":
    main()
