"""Data-parallel least squares through the launcher, resuming from its own checkpoint.

``train.py DIR --steps S [--crash RANK:STEP] [--hold RANK:STEP]``

Rank ``r`` of ``W`` takes rows ``r::W`` of a fixed data set; every step sums
its rows' gradient, all-reduces the sums and takes a gradient step, so the
trajectory does not depend on ``W`` (up to the order of float additions).
After every step rank 0 saves ``{"step", "w"}`` to ``DIR/ckpt`` (atomically);
every run starts from it when it exists. Each rank appends
``restart world rank first_step`` to ``DIR/starts.log`` when it starts; rank
0 saves the final weights to ``DIR/final``.

On the first attempt only (``RPCDIST_RESTART_COUNT == 0``):

* ``--crash RANK:STEP``: rank RANK exits with code 1 when it reaches STEP;
* ``--hold RANK:STEP``: rank RANK writes ``DIR/holding.json`` (its pid, its
  launcher's pid) when it reaches STEP, then waits until it is stopped.

:func:`reference` computes the same trajectory in NumPy alone.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

ROWS, COLS, LR = 48, 4, 0.01


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, COLS))
    y = x @ np.arange(1.0, COLS + 1) + 0.1 * rng.standard_normal(ROWS)
    return x, y


def shard_gradient(w: np.ndarray, rank: int, world: int) -> np.ndarray:
    x, y = data()
    xs, ys = x[rank::world], y[rank::world]
    return xs.T @ (xs @ w - ys)


def step(w: np.ndarray, total: np.ndarray) -> np.ndarray:
    return w - LR * total / ROWS


def reference(steps: int, world: int) -> np.ndarray:
    """The weights after ``steps`` uninterrupted steps on ``world`` ranks (ranks summed in order)."""
    w = np.zeros(COLS)
    for _ in range(steps):
        total = shard_gradient(w, 0, world)
        for r in range(1, world):
            total = total + shard_gradient(w, r, world)
        w = step(w, total)
    return w


def _rank_step(spec: str | None) -> tuple[int, int] | None:
    if spec is None:
        return None
    rank, at = spec.split(":")
    return int(rank), int(at)


def hold_here(directory: str, world: int) -> None:
    """Write ``holding.json`` (this worker's and its launcher's pids, the world
    size) atomically, then wait until the launcher stops this worker."""
    record = {"pid": os.getpid(), "launcher": os.getppid(), "world": world}
    with open(os.path.join(directory, "holding.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(directory, "holding.tmp"), os.path.join(directory, "holding.json"))
    while True:
        time.sleep(1)


def main() -> int:
    import rpcdist
    from rpcdist import collectives as dist

    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--crash")
    p.add_argument("--hold")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ["RPCDIST_RESTART_COUNT"])
    crash = _rank_step(args.crash) if restart == 0 else None
    hold = _rank_step(args.hold) if restart == 0 else None
    ckpt = os.path.join(args.dir, "ckpt")

    w, first = np.zeros(COLS), 0
    if os.path.exists(ckpt):
        saved = rpcdist.load(ckpt)
        w, first = np.asarray(saved["w"]), int(saved["step"])
    with open(os.path.join(args.dir, "starts.log"), "a") as f:
        f.write(f"{restart} {world} {rank} {first}\n")

    dist.init_process_group()
    for i in range(first, args.steps):
        if crash == (rank, i):
            return 1
        if hold == (rank, i):
            hold_here(args.dir, world)
        total = shard_gradient(w, rank, world)
        dist.all_reduce(total)
        w = step(w, total)
        if rank == 0:
            rpcdist.save({"step": i + 1, "w": w}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    if rank == 0:
        rpcdist.save({"w": w, "world": world, "restart": restart}, os.path.join(args.dir, "final"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
