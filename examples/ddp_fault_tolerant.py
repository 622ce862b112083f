"""Fault-tolerant data parallelism: ranks killed with ``kill -9`` while the job goes on.

Run it on its own; it starts the coordinator and its ranks, and replaces
each rank it kills::

    python examples/ddp_fault_tolerant.py [--workers 3] [--steps 300] [--kill-every 40]

It trains the digits classifier twice with the same seed: once without
faults, then with ``kill -9`` of a random rank every ``--kill-every``
committed steps (once the previous replacement is back), the replacement a
spare process started ahead of time (imports and data loaded) that takes
the dead rank's ``RANK``. At the end it prints the goodput (committed
steps per second of the faulty run over the fault-free run's), each
recovery's time (the kill to the first step committed by the full
membership again: the survivors' redo, the spare's join and its pull of
the live state), and per epoch whether every training sample was in
a committed batch exactly once (the sampler's padding of a segment's last
round aside).

Each rank runs ``DistributedDataParallel(Net(), fault_tolerance=ft)`` with
``ft = FaultTolerance(sampler=..., batch_size=...)``; the loop is
``idx = ft.start_step()``, forward, backward, ``if ft.commit():
opt.step()`` (``docs/fault-tolerance.md``). A survivor whose step failed
redoes it at the smaller world; the replacement pulls the parameters,
momentum, step counter, RNG state and sampler position from a live rank.
No checkpoint is written or read.

``--mode plain`` runs one rank of the same training with the ordinary
``DistributedDataParallel`` over a process group (under the launcher), for
the benchmark's overhead figure (``benchmarks/bench_fault_tolerance.py``).
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import ps_common

from rpcdist import nn, optim
from rpcdist import tensor as rt
from rpcdist.data import DistributedSampler
from rpcdist.nn import functional as F
from rpcdist.parallel import DistributedDataParallel as DDP
from rpcdist.parallel import FaultTolerance, FaultToleranceCoordinator


class Net(nn.Module):
    """64 -> hidden -> 10."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(ps_common.NUM_FEATURES, hidden)
        self.fc2 = nn.Linear(hidden, ps_common.NUM_CLASSES)

    def forward(self, x: rt.Tensor) -> rt.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def rank_main(args: argparse.Namespace) -> int:
    """One rank (``RANK``, ``RPCDIST_FT_ADDR`` in the environment)."""
    x, y, x_test, y_test = ps_common.load_digits(args.seed)
    rt.manual_seed(args.seed)
    if args.mode == "plain":
        return plain_rank(args, x, y)
    if os.environ["RANK"] == "spare":  # started ahead, imports done: wait to replace a rank
        line = sys.stdin.readline().strip()
        if not line:
            return 0
        os.environ["RANK"] = line
    sampler = DistributedSampler(len(x), num_replicas=1, rank=0, seed=args.seed)
    ft = FaultTolerance(sampler=sampler, batch_size=args.batch_size, timeout=10.0)
    model = DDP(Net(args.hidden), fault_tolerance=ft)
    opt = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ft.register_state("optim", opt)
    trained = False
    while ft.step < args.steps:
        idx = ft.start_step()
        opt.zero_grad()
        loss = F.cross_entropy(model(rt.tensor(x[idx])), y[idx])
        loss.backward()
        if ft.commit():
            opt.step()
            trained = True
    if ft.rank == 0 and trained:
        acc = ps_common.accuracy(model.module, x_test, y_test)
        print(f"rank {ft.id}: {ft.step} steps, test accuracy {acc:.3f}", flush=True)
    ft.close()
    return 0


def plain_rank(args: argparse.Namespace, x: np.ndarray, y: np.ndarray) -> int:
    """The same training with the ordinary DDP, checkpointing every
    ``--checkpoint-every`` steps into ``--workdir`` and resuming from it after
    the launcher restarted the job (``--max-restarts``)."""
    import rpcdist
    from rpcdist import collectives as dist

    dist.init_process_group()
    rank = dist.get_rank()
    sampler = DistributedSampler(len(x), seed=args.seed)
    model = DDP(Net(args.hidden))
    opt = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step, start, cpu = 0, 0.0, 0.0
    work = args.workdir
    ckpt = os.path.join(work, "checkpoint.npz") if work else ""
    if work and os.path.exists(ckpt):
        saved = rpcdist.load(ckpt)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        sampler.load_state_dict(saved["sampler"])
        step = int(saved["step"])
    # The benchmark's beacon, 6 float64 rank 0 rewrites after each step: the
    # attempt (1 + restarts), the step, the step it resumed from, its first
    # step's time, the last step checkpointed, the last step's time.
    beacon = -1
    if work and rank == 0:
        beacon = os.open(os.path.join(work, "beacon"), os.O_RDWR | os.O_CREAT)
    attempt, resumed, first = 1 + int(os.environ.get("RPCDIST_RESTART_COUNT", "0")), step, 0.0
    checkpointed = step
    it = iter(sampler)
    while step < args.steps:
        idx = np.fromiter((i for _, i in zip(range(args.batch_size), it, strict=False)), int)
        if not len(idx):
            sampler.set_epoch(sampler.epoch + 1)
            it = iter(sampler)
            continue
        opt.zero_grad()
        F.cross_entropy(model(rt.tensor(x[idx])), y[idx]).backward()
        opt.step()
        step += 1
        if step == 1:
            start, cpu = time.perf_counter(), time.process_time()
        if work and rank == 0 and args.checkpoint_every and step % args.checkpoint_every == 0:
            state = {
                "model": model.module.state_dict(),
                "optim": opt.state_dict(),
                "sampler": sampler.state_dict(),
                "step": step,
            }
            rpcdist.save(state, ckpt)
            checkpointed = step
        if beacon >= 0:
            now = time.monotonic()
            first = first or now
            mark = (attempt, step, resumed, first, checkpointed, now)
            os.pwrite(beacon, struct.pack("6d", *mark), 0)
    if rank == 0 and step > 1:
        rate = (step - 1) / (time.perf_counter() - start)
        per = (time.process_time() - cpu) / (step - 1) * 1e3
        print(f"plain DDP: {rate:.1f} steps/s, {per:.3f} ms CPU per step (rank 0)", flush=True)
    dist.destroy_process_group()
    return 0


def run_job(
    args: argparse.Namespace,
    argv: list[str],
    kill_every: int,
    kill_every_s: float = 0.0,
    duration: float = 0.0,
) -> dict:
    """Start the coordinator and ``--workers`` ranks; kill and replace one every
    ``kill_every`` committed steps (or ``kill_every_s`` seconds); with
    ``duration``, stop the job after that many seconds. Returns the measurements."""
    coord = FaultToleranceCoordinator(args.workers, timeout=10.0)
    rng = np.random.default_rng(args.seed)
    procs: dict[int, subprocess.Popen] = {}
    spares: list[subprocess.Popen] = []
    others: list[subprocess.Popen] = []

    def start(rank: str) -> subprocess.Popen:
        env = dict(os.environ, RANK=rank, RPCDIST_FT_ADDR=coord.address)
        pipe = subprocess.PIPE if rank == "spare" else None
        return subprocess.Popen([sys.executable, __file__, *argv], env=env, stdin=pipe, text=True)

    kills: list[float] = []
    full = args.workers
    try:
        for r in range(args.workers):
            procs[r] = start(str(r))
        if kill_every or kill_every_s:
            spares.append(start("spare"))
        while coord.step == 0 and all(p.poll() is None for p in procs.values()):
            time.sleep(0.01)  # the clock starts at the first committed step
        next_kill, began = kill_every, time.monotonic()
        next_time = began + kill_every_s
        cpu0, step0 = {r: cpu_seconds(p.pid) for r, p in procs.items()}, coord.step
        while any(p.poll() is None for p in procs.values()):
            now = time.monotonic()
            if duration and now - began > duration:
                break
            back = len(coord.members()) == full  # kill again only once the last one is back
            due = (now >= next_time) if kill_every_s else (coord.step >= next_kill)
            if (kill_every or kill_every_s) and back and due and coord.step < args.steps - 5:
                victim = int(rng.integers(args.workers))
                procs[victim].send_signal(signal.SIGKILL)
                kills.append(time.monotonic())
                print(f"kill -9 rank {victim} at step {coord.step}", flush=True)
                others.append(procs[victim])
                procs[victim] = spare = spares.pop()  # the replacement: same RANK
                assert spare.stdin is not None
                spare.stdin.write(f"{victim}\n")
                spare.stdin.flush()
                spares.append(start("spare"))  # the next one, started ahead
                next_kill, next_time = coord.step + kill_every, now + kill_every_s
            time.sleep(0.005)
        cpu = [cpu_seconds(procs[r].pid) - c for r, c in cpu0.items() if not kills]
        cpu_steps = coord.step - step0
        codes = [p.returncode for p in procs.values()]
    finally:
        for p in [*procs.values(), *others]:
            if p.poll() is None:
                p.kill()
        for p in spares:
            assert p.stdin is not None
            p.stdin.close()  # an unused spare exits
        for p in [*procs.values(), *others, *spares]:
            p.wait()
        coord.close()
    # The i-th "commit" event is when coord.commits[i] (each member's batch) was decided.
    times = [t for t, kind, _ in coord.events if kind == "commit"]
    commits = list(zip(times, coord.commits, strict=True))
    span = commits[-1][0] - commits[0][0]
    samples = sum(len(idx) for _, (_, batches) in commits[1:] for _, idx in batches)
    recoveries = []
    for k in kills:
        noticed = min((t for t, kind, _ in coord.events if kind == "lost" and t > k), default=k)
        full = [t for t, (_, b) in commits if t > noticed and len(b) == args.workers]
        if full:
            recoveries.append(full[0] - k)
    epochs = sorted({e for e, _ in coord.commits})
    coverage = {}
    n = coord.commits and len(ps_common.load_digits(args.seed)[0])
    for e in epochs[:-1]:  # the last epoch is unfinished
        seen = coord.seen(e)
        coverage[e] = (len(seen) == n, sum(seen.values()) - n, min(seen.values()))
    return {
        "codes": codes,
        "rate": (len(commits) - 1) / span,
        "sample_rate": samples / span,
        "recoveries": recoveries,
        "coverage": coverage,
        "steps": coord.step,
        "kills": len(kills),
        "redone": sum(kind == "redo" for _, kind, _ in coord.events),
        # Without kills: the ranks' CPU per committed step (median rank), in ms.
        "cpu_ms": float(np.median(cpu)) / max(cpu_steps, 1) * 1e3 if cpu else float("nan"),
    }


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a running process so far (NaN once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-every", type=int, default=40, help="committed steps between kills")
    p.add_argument("--batch-size", type=int, default=32, help="per rank and step")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=["ft", "plain"], default="ft")
    p.add_argument("--no-baseline", action="store_true", help="skip the fault-free run")
    p.add_argument("--workdir", default="", help="plain mode: checkpoint, beacon")
    p.add_argument("--checkpoint-every", type=int, default=0, help="plain mode: steps")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" in os.environ:
        return rank_main(args)
    free = None if args.no_baseline else run_job(args, argv, 0)
    faulty = run_job(args, argv, args.kill_every)
    ok = all(c == 0 for c in faulty["codes"]) and faulty["steps"] >= args.steps
    if free is not None:
        print(f"fault-free: {free['rate']:.1f} steps/s")
        print(
            f"with faults: {faulty['rate']:.1f} steps/s; goodput {faulty['rate'] / free['rate']:.2f}"
        )
    rec = faulty["recoveries"]
    print(f"{faulty['kills']} kill(s), {len(rec)} back to full membership before the end")
    print(
        f"recoveries (kill -> full membership again): {[round(r, 2) for r in rec]} s"
        + (f", median {float(np.median(rec)):.2f} s" if rec else "")
    )
    for e, (complete, extra, least) in faulty["coverage"].items():
        exact = complete and least >= 1 and extra < args.workers
        ok &= exact
        print(
            f"epoch {e}: every sample seen {'exactly once' if exact else 'NOT exactly once'} "
            f"(padding repeats: {extra})"
        )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
