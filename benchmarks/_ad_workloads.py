"""The models and worker processes of ``bench_dist_autograd.py``, for rpcdist and PyTorch.

Three workers: ``trainer`` (rank 0), ``ps1`` and ``ps2``. Each workload is
one training iteration: open a context, forward across the workers,
backward, step a DistributedOptimizer. The same model runs in one process
for the "alone" column. Module-level so that both frameworks find these
functions and classes by name on every worker.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from _report import time_steps

WORKLOADS = ("ps-tiny", "ps-mlp", "rnn")
BATCH = {"ps-tiny": 4, "ps-mlp": 128, "rnn": 20}
SEQ, VOCAB, EMB, HIDDEN = 35, 1000, 64, 128


def _data(name: str) -> tuple[Any, Any]:
    rng = np.random.default_rng(0)
    if name == "ps-tiny":
        return rng.standard_normal((4, 16)).astype(np.float32), None
    if name == "ps-mlp":
        x = rng.standard_normal((128, 784)).astype(np.float32)
        return x, rng.integers(0, 10, 128)
    tokens = rng.integers(0, VOCAB, (SEQ, BATCH["rnn"]))
    return tokens, rng.integers(0, VOCAB, SEQ * BATCH["rnn"])


# ------------------------------------------------------------------ rpcdist


def rd_tiny() -> Any:
    from rpcdist import nn

    return nn.Linear(16, 16)


def rd_first() -> Any:
    from rpcdist import nn

    return nn.Linear(784, 256)


def rd_embedding() -> Any:
    from rpcdist import nn

    return nn.Embedding(VOCAB, EMB)


def rd_decoder() -> Any:
    from rpcdist import nn

    return nn.Linear(HIDDEN, VOCAB)


class _RdRest:
    """The trainer's local part of each model (rpcdist)."""

    def __init__(self, name: str) -> None:
        from rpcdist import nn

        self.name = name
        if name == "ps-mlp":
            self.mods = [nn.Linear(256, 256), nn.Linear(256, 10)]
        elif name == "rnn":
            self.mods = [nn.LSTM(EMB, HIDDEN, num_layers=2)]
        else:
            self.mods = []

    def params(self) -> list[Any]:
        return [p for m in self.mods for p in m.parameters()]


def rd_iteration_fn(name: str, remote: bool) -> Any:
    """A callable running one iteration (``remote``: across the workers)."""
    import rpcdist
    import rpcdist.autograd as dist_autograd
    from rpcdist import nn, optim
    from rpcdist import tensor as rt
    from rpcdist.nn import functional as F

    x, y = _data(name)
    rest = _RdRest(name)
    if remote:
        mods = {
            "ps-tiny": [nn.RemoteModule("ps1", rd_tiny)],
            "ps-mlp": [nn.RemoteModule("ps1", rd_first)],
            "rnn": [nn.RemoteModule("ps1", rd_embedding), nn.RemoteModule("ps2", rd_decoder)],
        }[name]
        params = [p for m in mods for p in m.remote_parameters()]
        params += [rpcdist.RRef(p) for p in rest.params()]
        opt: Any = optim.DistributedOptimizer(optim.SGD, params, lr=0.01)
    else:
        mods = {
            "ps-tiny": [rd_tiny()],
            "ps-mlp": [rd_first()],
            "rnn": [rd_embedding(), rd_decoder()],
        }[name]
        local_opt = optim.SGD([p for m in mods for p in m.parameters()] + rest.params(), lr=0.01)

    def forward() -> Any:
        if name == "ps-tiny":
            out = mods[0](rt.tensor(x))
            return (out * out).sum()
        if name == "ps-mlp":
            h = rt.relu(mods[0](rt.tensor(x)))
            h = rt.relu(rest.mods[0](h))
            return F.cross_entropy(rest.mods[1](h), y)
        emb = mods[0](x)  # (T, B, E)
        out, _ = rest.mods[0](emb)
        logits = mods[1](out.reshape(SEQ * BATCH["rnn"], HIDDEN))
        return F.cross_entropy(logits, y)

    if remote:

        def step() -> None:
            with dist_autograd.context() as cid:
                loss = forward()
                dist_autograd.backward(cid, [loss])
                opt.step(cid)

    else:

        def step() -> None:
            local_opt.zero_grad()
            forward().backward()
            local_opt.step()

    return step


# -------------------------------------------------------------------- torch


def th_tiny() -> Any:
    import torch

    return torch.nn.Linear(16, 16)


def th_first() -> Any:
    import torch

    return torch.nn.Linear(784, 256)


def th_embedding() -> Any:
    import torch

    return torch.nn.Embedding(VOCAB, EMB)


def th_decoder() -> Any:
    import torch

    return torch.nn.Linear(HIDDEN, VOCAB)


class ThModule:
    """A torch module made by one of the factories above (RemoteModule wants a class)."""

    def __new__(cls, factory: str) -> Any:  # type: ignore[misc]
        return globals()[factory]()


def th_iteration_fn(name: str, remote: bool) -> Any:
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.nn.functional as F
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef

    x, y = _data(name)
    xt = torch.from_numpy(x)
    yt = None if y is None else torch.from_numpy(y)
    if name == "ps-mlp":
        rest: list[Any] = [torch.nn.Linear(256, 256), torch.nn.Linear(256, 10)]
    elif name == "rnn":
        rest = [torch.nn.LSTM(EMB, HIDDEN, num_layers=2)]
    else:
        rest = []
    factories = {
        "ps-tiny": [("ps1", "th_tiny")],
        "ps-mlp": [("ps1", "th_first")],
        "rnn": [("ps1", "th_embedding"), ("ps2", "th_decoder")],
    }[name]
    rest_params = [p for m in rest for p in m.parameters()]
    if remote:
        mods: list[Any] = [RemoteModule(f"{w}/cpu", _th_wrapped(f), args=()) for w, f in factories]
        params = [p for m in mods for p in m.remote_parameters()]
        params += [RRef(p) for p in rest_params]
        opt: Any = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    else:
        mods = [globals()[f]() for _, f in factories]
        local_opt = torch.optim.SGD(
            [p for m in mods for p in m.parameters()] + rest_params, lr=0.01
        )

    def forward() -> Any:
        if name == "ps-tiny":
            out = mods[0](xt) if not remote else mods[0].forward(xt)
            return (out * out).sum()
        if name == "ps-mlp":
            h = torch.relu(mods[0].forward(xt) if remote else mods[0](xt))
            h = torch.relu(rest[0](h))
            return F.cross_entropy(rest[1](h), yt)
        emb = mods[0].forward(xt) if remote else mods[0](xt)
        out, _ = rest[0](emb)
        flat = out.reshape(SEQ * BATCH["rnn"], HIDDEN)
        logits = mods[1].forward(flat) if remote else mods[1](flat)
        return F.cross_entropy(logits, yt)

    if remote:

        def step() -> None:
            with dist_autograd.context() as cid:
                loss = forward()
                dist_autograd.backward(cid, [loss])
                opt.step(cid)

    else:

        def step() -> None:
            local_opt.zero_grad()
            forward().backward()
            local_opt.step()

    return step


_TH_CLASSES: dict[str, Any] = {}


def _th_wrapped(factory: str) -> Any:
    """A module class whose instances are made by ``factory`` (torch's
    RemoteModule takes a class and pickles it by name: one class per factory)."""
    return globals()[f"Th_{factory}"]


def _make_th_classes() -> None:
    try:
        import torch
    except ImportError:
        return
    for factory in ("th_tiny", "th_first", "th_embedding", "th_decoder"):

        def init(self: Any, _f: str = factory) -> None:
            torch.nn.Module.__init__(self)
            self.inner = globals()[_f]()

        def fwd(self: Any, x: Any) -> Any:
            return self.inner(x)

        cls = type(f"Th_{factory}", (torch.nn.Module,), {"__init__": init, "forward": fwd})
        cls.__module__ = __name__
        globals()[cls.__name__] = cls


_make_th_classes()


# ------------------------------------------------------------------ workers


def rss_mb() -> float:
    """This process's resident set size in MB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def footprint() -> tuple[float, int]:
    """``(RSS MB, live autograd contexts)`` of the worker running it."""
    import rpcdist

    return rss_mb(), rpcdist.statistics()["autograd_contexts"]


def _settled(probes: list[Any], timeout: float = 5.0) -> list[Any]:
    """Every worker's footprint once none has a live context left (releases
    leave in batches a few ms after the last ``with``), or at ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        got = [probe() for probe in probes]
        if all(n == 0 for _, n in got) or time.monotonic() >= end:
            return got


def rd_worker(rank: int, world: int, init: str, plan: list[tuple[str, int, int]], q: Any) -> None:
    """An rpcdist worker; rank 0 runs ``plan`` and puts the timings on ``q``.

    A plan entry ``("leak", n, warmup)`` runs ``ps-tiny`` n times and reports
    every worker's RSS and live contexts before and after.
    """
    import gc

    import rpcdist

    names = ["trainer", "ps1", "ps2"]
    rpcdist.init_rpc(
        names[rank],
        rank=rank,
        world_size=world,
        init_method=init,
        options=rpcdist.RpcOptions(token=None),
    )
    if rank == 0:
        out: dict[str, Any] = {}
        for name, iters, warmup in plan:
            if name != "leak":
                out[name] = time_steps(rd_iteration_fn(name, True), warmup, iters)
                continue
            step = rd_iteration_fn("ps-tiny", True)
            for _ in range(warmup):
                step()
            gc.collect()
            before = [rpcdist.rpc_sync(w, footprint) for w in names]
            for _ in range(iters):
                step()
            gc.collect()
            out["leak"] = (
                before,
                _settled([lambda w=w: rpcdist.rpc_sync(w, footprint) for w in names]),
            )
        q.put(out)
    rpcdist.shutdown()


def th_worker(rank: int, world: int, port: int, plan: list[tuple[str, int, int]], q: Any) -> None:
    """A PyTorch RPC worker (TensorPipe); rank 0 runs ``plan``."""
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    names = ["trainer", "ps1", "ps2"]
    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8
    )
    rpc.init_rpc(names[rank], rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        out = {}
        for name, iters, warmup in plan:
            out[name] = time_steps(th_iteration_fn(name, True), warmup, iters)
        q.put(out)
    rpc.shutdown()


def single_thread_env() -> None:
    """One compute thread per process, for both frameworks (3 processes on 2 cores)."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
