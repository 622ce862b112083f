"""One rank of the fault-tolerant DDP tests, run as its own process (so it can be killed).

Environment: ``RANK`` and ``RPCDIST_FT_ADDR`` as the launcher would give
them. Arguments: ``OUT STEPS [KILL_STEP:KILL_POINT[:RANK]]`` (the kill point
only on RANK if given; never in a restarted worker). After every
committed step it appends ``step members sha256(parameters)`` to
``OUT/rank<id>.log`` and at the end writes its parameters, optimizer state
and sampler state to ``OUT/rank<id>.npz``. With a kill point it writes
``OUT/kill<id>-<step>`` when the step reaches that point and then waits to
be killed from outside (or goes on once ``OUT/release<id>`` exists). It writes ``OUT/started<id>-<restart count>`` once it asked to join.
With ``FT_HOLD=<step>`` it waits at that step
until ``OUT/go`` exists (so a test can have a replacement join mid-run).
``FT_OPT``: ``sgd`` (default; with momentum) or ``adam``. ``FT_MODE``: ``ddp`` (default), ``zero`` (DDP with a fault-tolerant
``ZeroRedundancyOptimizer``) or ``fsdp`` (a fault-tolerant
``FullyShardedDataParallel``); the last two also save their shards (ZeRO: and,
on the last member, its ``consolidate_state_dict`` at the end). FSDP also
appends ``step q:sha256 ...`` for each padded slice it holds to
``OUT/slices<id>.log`` after every committed step, and takes
``FT_MP`` (``float16``, ``bfloat16``) as its ``mixed_precision`` and
``FT_STRATEGY`` as its ``sharding_strategy``; with ``FT_BUFFERS=1`` its
module has two buffers: ``stats`` (drawn from the rank's own seed, as its
parameters) and ``tracked`` (a count of committed steps, as BatchNorm's
``num_batches_tracked``), saved with the full parameters.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from typing import Any

import numpy as np

import rpcdist
import rpcdist.tensor as rt
from rpcdist import collectives as dist
from rpcdist import nn, optim
from rpcdist.data import DistributedSampler
from rpcdist.nn import functional as F
from rpcdist.parallel import DistributedDataParallel as DDP
from rpcdist.parallel import FaultTolerance
from rpcdist.parallel import FullyShardedDataParallel as FSDP
from rpcdist.parallel import ZeroRedundancyOptimizer as ZeRO

F64 = np.float64
N, IN, HID, OUT, B = 90, 6, 16, 3, 4
#: ``FT_OPT``: the optimizer, its options, and the elementwise state the shard checks read.
OPTIMIZERS = {
    "sgd": (optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum_buffer"),
    "adam": (optim.Adam, {"lr": 0.01}, "exp_avg"),
}


def dataset() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, IN))
    return x, np.argmax(x @ rng.standard_normal((IN, OUT)), axis=1)  # learnable


def model(seed: int) -> nn.Module:
    g = rt.Generator().manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, HID, dtype=F64, generator=g),
        nn.Tanh(),
        nn.Linear(HID, OUT, dtype=F64, generator=g),
    )


def loss_of(m: nn.Module, idx: np.ndarray) -> rt.Tensor:
    x, y = dataset()
    return F.cross_entropy(m(rt.tensor(x[idx])), rt.tensor(y[idx]))


def digest(m: nn.Module) -> str:
    h = hashlib.sha256()
    for _, p in m.named_parameters():
        h.update(np.ascontiguousarray(p.data).tobytes())
    return h.hexdigest()


def shard_digests(net: FSDP, rank: int, world: int) -> str:
    """``q:digest`` of each padded slice ``q`` this rank holds, over all units (FSDP)."""
    held: list[int | str] = [rank] if world == 1 else [rank, (rank + 1) % world]
    if net.sharding_strategy == "no_shard":
        held = ["all"]  # every rank holds the whole vector
    parts = []
    for i, q in enumerate(held):
        h = hashlib.sha256()
        for u in net._shared.units:
            n = u.shard_size
            h.update(np.ascontiguousarray(u.shard.data[i * n : (i + 1) * n]).tobytes())
        parts.append(f"{q}:{h.hexdigest()}")
    return ",".join(parts)


def process_group_run(
    rank: int, world: int, init_method: str, commits: list[Any], mp: str | None, strategy: str
) -> dict[str, Any]:
    """The committed steps ``commits`` (one batch per member) replayed by FSDP over a
    process group, without fault tolerance (a ``run_workers`` entry): its full parameters."""
    dist.init_process_group(init_method=init_method, rank=rank, world_size=world, timeout=60)
    net = FSDP(model(1), sharding_strategy=strategy, mixed_precision=mp)
    opt_class, options, _ = OPTIMIZERS["sgd"]
    opt = opt_class(net.parameters(), **options)
    for _, batches in commits:
        opt.zero_grad()
        loss_of(net, np.asarray(batches[rank][1])).backward()
        opt.step()
    params = net.state_dict("full", rank0_only=False)
    dist.destroy_process_group()
    return params


def main(argv: list[str]) -> int:
    out, steps = argv[0], int(argv[1])
    me = int(os.environ["RANK"])
    kill = argv[2].split(":") if len(argv) > 2 else None
    if kill and (
        (len(kill) > 2 and int(kill[2]) != me)
        or os.environ.get("RPCDIST_RESTART_COUNT", "0") != "0"
    ):
        kill = None  # another rank's kill point, or this is the replacement

    def hook(point: str) -> None:
        if kill and int(kill[0]) == ft.step and kill[1] == point:
            marker = os.path.join(out, f"kill{me}-{ft.step}")
            with open(marker + ".tmp", "w") as f:  # (renamed: a reader never sees it empty)
                f.write(str(os.getpid()))
            os.replace(marker + ".tmp", marker)
            release = os.path.join(out, f"release{me}")
            end = time.monotonic() + 120  # killed from outside before this ends, or released
            while not os.path.exists(release) and time.monotonic() < end:
                time.sleep(0.01)

    sampler = DistributedSampler(N, num_replicas=1, rank=0, seed=3)
    ft = FaultTolerance(
        sampler=sampler, batch_size=B, timeout=float(os.environ.get("FT_TIMEOUT", "20")), hook=hook
    )
    mode = os.environ.get("FT_MODE", "ddp")
    # Each rank's model differs on purpose: the first quorum heals them from the lowest id.
    net: nn.Module
    tracked = rt.tensor(np.zeros(1))  # (FT_BUFFERS): +1 at each committed step
    if mode == "fsdp":
        mp = os.environ.get("FT_MP") or None  # mixed_precision: float16, bfloat16
        strategy = os.environ.get("FT_STRATEGY", "full_shard")
        m = model(me + 1)
        if os.environ.get("FT_BUFFERS") == "1":
            m.register_buffer("stats", rt.tensor(np.random.default_rng(me).standard_normal(5)))
            m.register_buffer("tracked", tracked)
        net = FSDP(m, sharding_strategy=strategy, mixed_precision=mp, fault_tolerance=ft)
    else:
        net = DDP(model(me + 1), fault_tolerance=ft)
    opt_class, options, key = OPTIMIZERS[os.environ.get("FT_OPT", "sgd")]
    if mode == "zero":
        opt: optim.Optimizer | ZeRO = ZeRO(
            net.parameters(), opt_class, fault_tolerance=ft, **options
        )
    else:
        opt = opt_class(net.parameters(), **options)
    ft.register_state("optim", opt)
    restarts = os.environ.get("RPCDIST_RESTART_COUNT", "0")
    open(os.path.join(out, f"started{me}-{restarts}"), "w").close()  # joining: sent
    log = open(os.path.join(out, f"rank{me}.log"), "a")  # noqa: SIM115 (closed at exit)
    slices = open(os.path.join(out, f"slices{me}.log"), "a")  # noqa: SIM115 (closed at exit)
    hold = int(os.environ.get("FT_HOLD", "-1"))  # wait for OUT/go before this step
    while ft.step < steps:
        while ft.step == hold and not os.path.exists(os.path.join(out, "go")):
            time.sleep(0.01)
        idx = ft.start_step()
        opt.zero_grad()
        loss = loss_of(net, idx)
        loss.backward()
        if ft.commit():
            opt.step()
            tracked.data += 1.0
            log.write(
                f"{ft.step} {','.join(map(str, ft.members))} {digest(net.module) if mode != 'fsdp' else '-'} {float(loss.item())!r}\n"
            )
            log.flush()
            if mode == "fsdp":  # each slice's digest: its two holders must agree every step
                slices.write(f"{ft.step} {shard_digests(net, ft.rank, ft.world_size)}\n")
                slices.flush()
    state: dict[str, object] = {"sampler": sampler.state_dict()}
    if mode == "ddp":
        shm = int(ft._shm is not None)  # the last quorum's all-reduce was in shared memory
        state.update(params=net.module.state_dict(), optim=opt.state_dict(), shm=shm)
    elif mode == "zero":
        assert isinstance(opt, ZeRO) and opt._ft is not None
        pieces = opt._ft.pieces  # (parameter, lo, hi, piece) of the two slices held here
        assert opt.optim is not None
        state.update(
            world=ft.world_size,
            rank=ft.rank,
            params=net.module.state_dict(),
            pieces=np.array([[i, lo, hi] for i, lo, hi, _ in pieces], np.int64),
            momentum=np.concatenate([opt.optim.state[t][key].ravel() for *_, t in pieces]),
        )
        opt.consolidate_state_dict(to=ft.world_size - 1)  # every member, at the same step
        if ft.rank == ft.world_size - 1:
            state["consolidated"] = opt.state_dict()
    else:
        assert isinstance(net, FSDP) and isinstance(opt, optim.Optimizer)
        units = net._shared.units
        state.update(
            world=ft.world_size,
            rank=ft.rank,
            params=net.state_dict("full", rank0_only=False),
            shard=np.concatenate([u.shard.data for u in units]),
            momentum=np.concatenate([opt.state[u.shard][key] for u in units]),
        )
    rpcdist.save(state, os.path.join(out, f"rank{me}.npz"))
    ft.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
