"""Sharded data parallelism: rpcdist FSDP against rpcdist DDP and PyTorch FSDP (Gloo), same run.

Model: an MLP of 4 Linear(2048, 2048) layers (ReLU between), float32, one
FSDP unit per layer; batch 32 per rank; one step = zero_grad + forward +
backward + Adam step; one compute thread per rank. A row is the median over
3 launches of rank 0's median step time; the launches of the three systems
are interleaved (DDP, FSDP, PyTorch FSDP, then again), so that load from
other processes on the machine falls on all three alike.

Memory per rank, after warm-up:

* *param+grad+optim*: bytes of the parameters, gradients and Adam state a
  rank holds between steps (rpcdist: counted from the arrays; PyTorch: from
  the tensors' storages, sharded flat parameters for FSDP);
* *peak incl. gathered*: rpcdist FSDP also counts, at its peak, the gathered
  units and the flat gradients in flight (``statistics()['peak_transient_bytes']``);
* *peak RSS*: the process's peak resident memory (``ru_maxrss``) minus its
  resident memory before the model was built (activations, communication
  buffers and allocator slack included).

Usage: ``python benchmarks/bench_fsdp.py [--quick] [--no-write] [--p 2,4]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before NumPy loads its BLAS, here and in the ranks

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import free_port, have_torch_distributed, median, table, time_steps, write_section

from rpcdist.testing import run_workers

WIDTH, LAYERS, BATCH = 2048, 4, 32


def _data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    return x, rng.integers(0, WIDTH, BATCH)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _nbytes(optimizer: Any) -> int:
    return sum(
        v.nbytes for st in optimizer.state.values() for v in st.values() if hasattr(v, "nbytes")
    )


def rpcdist_worker(rank: int, world: int, init: str, kind: str, warmup: int, steps: int) -> Any:
    import rpcdist.tensor as rt
    from rpcdist import collectives as dist
    from rpcdist import nn, optim
    from rpcdist.nn import functional as F
    from rpcdist.parallel import DistributedDataParallel as DDP
    from rpcdist.parallel import FullyShardedDataParallel as FSDP
    from rpcdist.parallel import ModuleWrapPolicy

    dist.init_process_group(init_method=init, rank=rank, world_size=world, timeout=600)
    try:
        base = _rss()
        layers: list[Any] = []
        for _ in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        mlp = nn.Sequential(*layers[:-1])
        if kind == "ddp":
            model: Any = DDP(mlp)
        else:
            model = FSDP(mlp, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        opt = optim.Adam(model.parameters(), lr=1e-4)
        xa, ya = _data(rank)
        x, y = rt.tensor(xa), rt.tensor(ya)

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        times = time_steps(step, warmup, steps)
        params = sum(p.data.nbytes for p in model.parameters())
        grads = sum(p.grad.data.nbytes for p in model.parameters() if p.grad is not None)
        held = params + grads + _nbytes(opt)
        peak = held
        if kind == "fsdp":
            peak += model.statistics()["peak_transient_bytes"]
        return {"step": median(times), "held": held, "peak": peak, "rss": _peak_rss() - base}
    finally:
        dist.destroy_process_group()


def torch_worker(rank: int, world: int, _init: str, port: int, warmup: int, steps: int) -> Any:
    import functools

    import torch
    import torch.distributed as tdist
    from torch.distributed.fsdp import FullyShardedDataParallel as TFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.set_num_threads(1)
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        base = _rss()
        layers: list[Any] = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        policy = ModuleWrapPolicy({torch.nn.Linear})
        make = functools.partial(TFSDP, auto_wrap_policy=policy, device_id=torch.device("cpu"))
        model = make(torch.nn.Sequential(*layers[:-1]))
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        xa, ya = _data(rank)
        x, y = torch.from_numpy(xa), torch.from_numpy(ya)

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        times = time_steps(step, warmup, steps)
        held = 0
        for p in model.parameters():
            held += p.numel() * p.element_size()
            if p.grad is not None:
                held += p.grad.numel() * p.grad.element_size()
        for st in opt.state.values():
            held += sum(v.numel() * v.element_size() for v in st.values() if v.dim() > 0)
        return {"step": median(times), "held": held, "rss": _peak_rss() - base}
    finally:
        tdist.destroy_process_group()


def _torch_fsdp(p: int, warmup: int, steps: int) -> tuple[dict[str, Any] | None, str]:
    if not have_torch_distributed():
        return None, "torch not installed"
    try:
        got = run_workers(torch_worker, p, args=(free_port(), warmup, steps), timeout=600)
    except Exception as exc:  # report why the baseline did not run
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}"
    return got[0], ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch docs/")
    ap.add_argument("--p", default="2,4")
    args = ap.parse_args()
    worlds = [int(x) for x in args.p.split(",")]
    warmup, steps = (2, 4) if args.quick else (2, 6)
    reps = 1 if args.quick else 3
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    notes: list[str] = []
    for _ in range(reps):  # interleaved, so that load from elsewhere hits all three alike
        for p in worlds:
            for kind in ("ddp", "fsdp"):
                got = run_workers(rpcdist_worker, p, args=(kind, warmup, steps), timeout=600)
                runs.setdefault((p, kind), []).append(got[0])
            torch_r, why = _torch_fsdp(p, warmup, steps)
            if torch_r is not None:
                runs.setdefault((p, "torch"), []).append(torch_r)
            elif why and f"p={p}" not in " ".join(notes):
                notes.append(f"p={p}: PyTorch FSDP did not run ({why}).")
    rows, mem_rows = [], []
    mb = 1e6
    nan = float("nan")

    def med(p: int, kind: str, key: str) -> float:
        vals = [r[key] for r in runs.get((p, kind), [])]
        return median(vals) if vals else nan

    for p in worlds:
        d_ms, f_ms, t_ms = (med(p, k, "step") * 1e3 for k in ("ddp", "fsdp", "torch"))
        rows.append([p, d_ms, f_ms, t_ms, f_ms / d_ms, f_ms / t_ms])
        ddp_held, fsdp_held, fsdp_peak = (
            med(p, "ddp", "held"),
            med(p, "fsdp", "held"),
            med(p, "fsdp", "peak"),
        )
        mem_rows.append(
            [
                p,
                ddp_held / mb,
                fsdp_held / mb,
                fsdp_peak / mb,
                med(p, "torch", "held") / mb,
                fsdp_held / ddp_held * p,
                fsdp_peak / ddp_held * p,
                med(p, "ddp", "rss") / mb,
                med(p, "fsdp", "rss") / mb,
                med(p, "torch", "rss") / mb,
            ]
        )
        print(f"p={p}: DDP {d_ms:.1f} ms, FSDP {f_ms:.1f} ms, torch {t_ms:.1f} ms", file=sys.stderr)
    body = (
        f"MLP {LAYERS} x Linear({WIDTH}, {WIDTH}), float32, Adam, batch {BATCH} per rank, "
        f"one FSDP unit per layer (`full_shard`). Step time in ms: median over {reps} "
        "interleaved launches of rank 0's median step (lower is better).\n\n"
        + table(
            [
                "p",
                "rpcdist DDP",
                "rpcdist FSDP",
                "PyTorch FSDP (Gloo)",
                "FSDP / DDP",
                "FSDP / PyTorch FSDP",
            ],
            rows,
        )
        + "\n\nMemory per rank (MB): parameters + gradients + Adam state held between "
        "steps; rpcdist FSDP's peak adds the gathered units and flat gradients in flight; "
        "`x p / DDP` is the FSDP figure times p over DDP's (goal <= 1.2); peak RSS growth "
        "over the process's resident size before the model was built.\n\n"
        + table(
            [
                "p",
                "DDP held",
                "FSDP held",
                "FSDP peak incl. gathered",
                "PyTorch FSDP held",
                "FSDP held x p / DDP",
                "FSDP peak x p / DDP",
                "DDP peak RSS",
                "FSDP peak RSS",
                "PyTorch FSDP peak RSS",
            ],
            mem_rows,
        )
        + "\n\nGoals: memory <= 1.2/p of DDP's; step time <= 1.3x rpcdist DDP's and "
        "<= 0.7x PyTorch FSDP's. Where p exceeds the cores, ranks share them."
        + ("\n\n" + " ".join(notes) if notes else "")
    )
    print(body)
    if not args.no_write:
        write_section(
            "fsdp",
            "Sharded data parallelism: rpcdist FSDP against DDP and PyTorch FSDP (Gloo)",
            body,
        )


if __name__ == "__main__":
    main()
