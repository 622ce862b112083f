"""Data-parallel training: rpcdist DDP against PyTorch DDP over Gloo, same run.

One step = zero_grad + forward + backward + SGD step, batch 128 per rank,
float32 MLPs 784-256-256-10 ("small") and 784-1024-1024-10 ("large"), one
compute thread per rank (OMP/OPENBLAS/MKL threads set to 1 before the ranks
start; ``torch.set_num_threads(1)``). A row is the median over 3 launches of
rank 0's median step time; "alone" is one process without DDP.

Also measured, for rpcdist:

* the fraction of communication hidden under backward: the reductions of a
  step run one after the other, each from its launch (or the previous one's
  end) to its completion; the part of that time before the last gradient was
  computed ran under backward (``DistributedDataParallel.statistics()``);
* bytes on the wire per step and rank for each comm hook (counted at the
  collective calls: ring all-reduce sends 2(p-1)/p of its buffer, all-to-all
  (p-1)/p, all-gather (p-1) times the rank's part);
* ZeroRedundancyOptimizer's optimizer state per rank against plain Adam's.

Usage: ``python benchmarks/bench_ddp.py [--quick] [--no-write]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before NumPy loads its BLAS, here and in the ranks

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import free_port, have_torch_distributed, median, table, time_steps, write_section

from rpcdist.testing import run_workers

BATCH = 128
MODELS = {"small": (784, 256, 256, 10), "large": (784, 1024, 1024, 10)}
HOOKS = ["none", "fp16", "bf16", "powerSGD"]
#: The ring's messages over loopback TCP (what two hosts would use): no Unix
#: sockets, no /dev/shm segments.
LOOPBACK_TCP = {"RPCDIST_LOCAL_SOCKETS": "0", "RPCDIST_SHM_THRESHOLD": "off"}
HOOK_COLUMNS = ["backend", "hook", "MB sent per rank", "reduction", "step (ms)", "/ no hook"]


def _data(rank: int, sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((BATCH, sizes[0])).astype(np.float32)
    return x, rng.integers(0, sizes[-1], BATCH)


# ------------------------------------------------------------------ rpcdist


def _rpcdist_mlp(sizes: tuple[int, ...]) -> Any:
    from rpcdist import nn

    layers: list[Any] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class _Counter:
    """Wraps the collective calls the reducer and hooks make; adds up bytes sent."""

    def __init__(self, dist: Any, world: int) -> None:
        self.dist, self.world, self.bytes = dist, world, 0.0
        self.orig = {n: getattr(dist, n) for n in ("all_reduce", "all_to_all", "all_gather")}
        p = world

        def all_reduce(buf: Any, *a: Any, **k: Any) -> Any:
            self.bytes += 2 * (p - 1) / p * buf.nbytes
            return self.orig["all_reduce"](buf, *a, **k)

        def all_to_all(out: Any, ins: Any, *a: Any, **k: Any) -> Any:
            self.bytes += (p - 1) / p * sum(i.nbytes for i in ins)
            return self.orig["all_to_all"](out, ins, *a, **k)

        def all_gather(out: Any, buf: Any, *a: Any, **k: Any) -> Any:
            self.bytes += (p - 1) * buf.nbytes
            return self.orig["all_gather"](out, buf, *a, **k)

        dist.all_reduce, dist.all_to_all, dist.all_gather = all_reduce, all_to_all, all_gather

    def restore(self) -> None:
        for n, f in self.orig.items():
            setattr(self.dist, n, f)


def rpcdist_worker(
    rank: int,
    world: int,
    init: str,
    sizes: tuple[int, ...],
    hook: str,
    warmup: int,
    steps: int,
    backend: str = "auto",
) -> Any:
    import rpcdist.tensor as rt
    from rpcdist import collectives as dist
    from rpcdist import optim
    from rpcdist.nn import functional as F
    from rpcdist.parallel import DistributedDataParallel as DDP
    from rpcdist.parallel import comm_hooks

    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=300)
    try:
        model = DDP(_rpcdist_mlp(sizes))
        state = None
        if hook == "fp16":
            model.register_comm_hook(None, comm_hooks.fp16_compress_hook)
        elif hook == "bf16":
            model.register_comm_hook(None, comm_hooks.bf16_compress_hook)
        elif hook == "powerSGD":
            state = comm_hooks.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2)
            model.register_comm_hook(state, comm_hooks.powerSGD_hook)
        opt = optim.SGD(model.parameters(), lr=0.01)
        xa, ya = _data(rank, sizes)
        x, y = rt.tensor(xa), rt.tensor(ya)
        stats: list[dict[str, Any]] = []

        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            stats.append(model.statistics())
            opt.step()

        times = time_steps(step, warmup, steps)
        stats = stats[warmup:]
        counter = _Counter(dist, world)
        step()
        wire = counter.bytes
        counter.restore()
        return {
            "step": median(times),
            "wait": median([s["ddp_last_wait_s"] for s in stats]),
            "comm": sum(s["ddp_last_comm_s"] for s in stats) / len(stats),
            "hidden": sum(s["ddp_last_hidden_s"] for s in stats) / len(stats),
            "wire": wire,
            "buckets": len(model.reducer.buckets),
            "powersgd_rate": state.compression_stats()[0] if state else 0.0,
        }
    finally:
        dist.destroy_process_group()


def rpcdist_alone(sizes: tuple[int, ...], warmup: int, steps: int) -> float:
    import rpcdist.tensor as rt
    from rpcdist import optim
    from rpcdist.nn import functional as F

    model = _rpcdist_mlp(sizes)
    opt = optim.SGD(model.parameters(), lr=0.01)
    xa, ya = _data(0, sizes)
    x, y = rt.tensor(xa), rt.tensor(ya)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return median(time_steps(step, warmup, steps))


def zero_worker(rank: int, world: int, init: str, sizes: tuple[int, ...]) -> Any:
    from rpcdist import collectives as dist
    from rpcdist import optim
    from rpcdist.parallel import ZeroRedundancyOptimizer

    dist.init_process_group(init_method=init, rank=rank, world_size=world, timeout=300)
    try:
        model = _rpcdist_mlp(sizes)
        for p in model.parameters():
            p.grad = np.full(p.shape, 1e-3, np.float32)
        z = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, lr=1e-3)
        z.step()
        plain = optim.Adam(model.parameters(), lr=1e-3)
        plain.step()
        full = sum(
            v.nbytes for st in plain.state.values() for v in st.values() if hasattr(v, "nbytes")
        )
        return {"zero": z.statistics()["zero_state_bytes"], "full": full}
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ PyTorch


def _torch_model(sizes: tuple[int, ...]) -> Any:
    import torch

    layers: list[Any] = []
    for a, b in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def torch_worker(
    rank: int, world: int, _init: str, port: int, sizes: tuple[int, ...], warmup: int, steps: int
) -> Any:
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        model = torch.nn.parallel.DistributedDataParallel(_torch_model(sizes))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        xa, ya = _data(rank, sizes)
        x, y = torch.from_numpy(xa), torch.from_numpy(ya)

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        return {"step": median(time_steps(step, warmup, steps))}
    finally:
        tdist.destroy_process_group()


def torch_alone(sizes: tuple[int, ...], warmup: int, steps: int) -> float:
    import torch

    torch.set_num_threads(1)
    model = _torch_model(sizes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xa, ya = _data(0, sizes)
    x, y = torch.from_numpy(xa), torch.from_numpy(ya)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return median(time_steps(step, warmup, steps))


# --------------------------------------------------------------------- main


def _hook_rows(warmup: int, steps: int) -> list[list[Any]]:
    """Comm hooks on the large model at p=2, over shared memory and the ring over loopback TCP.

    The hooks and backends are interleaved (each round runs every pair once;
    a row is the median of the rounds), so a load that comes and goes on a
    shared machine falls on every row alike.
    """
    sizes = MODELS["large"]
    pairs = [(b, h) for b in ("shm", "ring") for h in HOOKS]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {pair: [] for pair in pairs}
    alone: list[float] = []
    for _ in range(3):
        alone.append(rpcdist_alone(sizes, warmup, steps) * 1e3)
        for backend, hook in pairs:
            got = run_workers(
                rpcdist_worker,
                2,
                args=(sizes, hook, warmup, steps, backend),
                timeout=600,
                env=LOOPBACK_TCP if backend == "ring" else None,
            )
            runs[backend, hook].append(got[0])
    rows: list[list[Any]] = []
    for backend, hook in pairs:
        r = runs[backend, hook]
        step = median([x["step"] for x in r]) * 1e3
        base = median([x["step"] for x in runs[backend, "none"]]) * 1e3
        name = hook
        if hook == "powerSGD":
            name = f"powerSGD rank 2 ({r[0]['powersgd_rate']:.0f}x on matrices)"
        wire = r[0]["wire"] / 1e6
        rows.append([backend, name, wire, runs[backend, "none"][0]["wire"] / 1e6 / wire, step])
        rows[-1].append(step / base)
    # The floor under every row: the same step in one process, no communication.
    ring = median([x["step"] for x in runs["ring", "none"]]) * 1e3
    rows.append(["-", "one process, no DDP", 0.0, "-", median(alone), median(alone) / ring])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="p=2 only, one launch, fewer steps")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch docs/")
    ap.add_argument("--p", default="2,4")
    ap.add_argument("--hooks-only", action="store_true", help="only the comm hook table; print it")
    args = ap.parse_args()
    worlds = [2] if args.quick else [int(x) for x in args.p.split(",")]
    reps = 1 if args.quick else 3
    warmup, steps = (3, 10) if args.quick else (5, 40)
    if args.hooks_only:
        print(table(HOOK_COLUMNS, _hook_rows(warmup, steps)))
        return
    torch_ok = have_torch_distributed()
    rows, overlap_rows = [], []
    for name, sizes in MODELS.items():
        alone = rpcdist_alone(sizes, warmup, steps) * 1e3
        talone = torch_alone(sizes, warmup, steps) * 1e3 if torch_ok else float("nan")
        for p in worlds:
            ours, theirs, extra = [], [], []
            for _ in range(reps):
                got = run_workers(
                    rpcdist_worker, p, args=(sizes, "none", warmup, steps), timeout=600
                )
                ours.append(got[0]["step"] * 1e3)
                extra.append(got[0])
                if torch_ok:
                    t = run_workers(
                        torch_worker, p, args=(free_port(), sizes, warmup, steps), timeout=600
                    )
                    theirs.append(t[0]["step"] * 1e3)
            ms = median(ours)
            tms = median(theirs) if theirs else float("nan")
            rows.append([name, p, ms, tms, ms / tms, alone, talone])
            wait = median([e["wait"] for e in extra]) * 1e3
            comm = median([e["comm"] for e in extra]) * 1e3
            hidden = median([e["hidden"] / e["comm"] for e in extra])
            overlap_rows.append([name, p, extra[0]["buckets"], comm, f"{hidden:.0%}", wait])
            print(f"{name} p={p}: rpcdist {ms:.2f} ms, torch {tms:.2f} ms", file=sys.stderr)
    hook_rows = _hook_rows(warmup, steps)
    zero_rows = []
    for p in worlds:
        z = run_workers(zero_worker, p, args=(sizes,), timeout=600)
        per_rank = [r["zero"] / 1e6 for r in z]
        full = z[0]["full"] / 1e6
        zero_rows.append([p, full, max(per_rank), min(per_rank), max(per_rank) / full])
    body = (
        "Step time in ms (median of 3 launches of rank 0's median step; lower is better).\n\n"
        + table(
            [
                "model",
                "p",
                "rpcdist DDP",
                "PyTorch DDP (Gloo)",
                "rpcdist / PyTorch",
                "rpcdist alone",
                "PyTorch alone",
            ],
            rows,
        )
        + "\n\nCommunication hidden under backward (rpcdist, no hook): how long a step's "
        "reductions ran (one after the other, launch to completion, mean per step), the "
        "share of that before backward computed its last gradient, and how long the "
        "reductions still took after it (median; includes waiting for slower ranks).\n\n"
        + table(
            ["model", "p", "buckets", "reductions (ms)", "hidden", "after last gradient (ms)"],
            overlap_rows,
        )
        + "\n\nComm hooks, large model, p=2, over shared memory (shm) and the TCP ring: "
        "bytes each rank sends per step, step time (median of 3 interleaved launches) "
        "and step time over the no-hook step's on the same backend; the last row is the "
        "same step in one process without DDP (over the ring's no-hook step): no hook's "
        "step can be shorter.\n\n"
        + table(HOOK_COLUMNS, hook_rows)
        + "\n\nZeroRedundancyOptimizer (Adam, large model): optimizer state per rank.\n\n"
        + table(
            ["p", "Adam state (MB)", "ZeRO max rank (MB)", "ZeRO min rank (MB)", "max / Adam"],
            zero_rows,
        )
        + "\n\nGoal: rpcdist step time at most 0.6x PyTorch DDP's for both models at p=2 and p=4. "
        "Where p exceeds the cores, ranks share them: communication that needs a core "
        "cannot hide under another rank's compute, and the wait after the last gradient "
        "includes waiting for ranks that got less CPU."
    )
    print(body)
    if not args.no_write:
        write_section(
            "ddp",
            "Data parallelism: rpcdist DDP against PyTorch DDP (Gloo)",
            body,
        )


if __name__ == "__main__":
    main()
