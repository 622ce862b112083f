"""Local engine speed: an MLP training step and an LSTM forward+backward.

Run as ``.venv/bin/python benchmarks/bench_tensor.py``; it rewrites the
"tensor" section of docs/benchmarks.md. PyTorch (CPU) is measured in the same
run when installed, with ``torch.set_num_threads(os.cpu_count())``; NumPy's
BLAS threads are left at their default.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import median, table, write_section

import rpcdist.tensor as rt
from rpcdist import nn
from rpcdist.nn import functional as F
from rpcdist.optim import SGD
from rpcdist.tensor import AccumulateGrad, compute_dependencies

BATCH, SIZES = 128, (784, 256, 256, 10)
LSTM_LAYERS, LSTM_HIDDEN, LSTM_SEQ, LSTM_BATCH = 2, 256, 35, 20


def interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, rounds: int = 5, pause: float = 0.5
) -> dict[str, list[float]]:
    """Seconds per call of each function, measured in alternating blocks.

    Alternating blocks spread background load evenly over the contenders. Each
    block starts after a pause and two untimed calls, so that the previous
    contender's BLAS/OpenMP worker threads have stopped spinning and do not
    compete for the cores.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    per_round = max(1, repeats // rounds)
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(pause)
            fn()
            fn()
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return times


def summary(times: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """(median, best) per contender, in milliseconds."""
    return {k: (median(v) * 1e3, min(v) * 1e3) for k, v in times.items()}


def mlp_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], size=BATCH)
    return x, y


def build_mlp() -> nn.Module:
    gen = rt.Generator(0)
    return nn.Sequential(
        nn.Linear(SIZES[0], SIZES[1], generator=gen),
        nn.ReLU(),
        nn.Linear(SIZES[1], SIZES[2], generator=gen),
        nn.ReLU(),
        nn.Linear(SIZES[2], SIZES[3], generator=gen),
    )


def rpcdist_mlp_step() -> tuple[Callable[[], None], int]:
    """The step, and how many operations its graph records."""
    x_np, y = mlp_data()
    model = build_mlp()
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = rt.tensor(x_np)

    def step() -> None:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    loss = F.cross_entropy(model(x), y)
    assert loss.grad_fn is not None
    deps = compute_dependencies([loss.grad_fn])
    n_ops = sum(1 for n in deps if not isinstance(n, AccumulateGrad))
    return step, n_ops


def numpy_mlp_step() -> Callable[[], None]:
    """The same step as raw NumPy operations: the floor the engine adds to."""
    x, y = mlp_data()
    model = build_mlp()
    params = [p.data.copy() for p in model.parameters()]
    bufs: list[np.ndarray | None] = [None] * len(params)
    rows = np.arange(BATCH)

    def step() -> None:
        w1, b1, w2, b2, w3, b3 = params
        z1 = x @ w1.T
        z1 += b1
        a1 = np.maximum(z1, 0)
        z2 = a1 @ w2.T
        z2 += b2
        a2 = np.maximum(z2, 0)
        z3 = a2 @ w3.T
        z3 += b3
        logp = z3 - z3.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        _ = -logp[rows, y].sum() / BATCH
        g3 = np.exp(logp)
        g3[rows, y] -= 1
        g3 *= np.float32(1.0 / BATCH)
        grads = [None] * 6
        grads[5] = g3.sum(axis=0)
        grads[4] = g3.T @ a2
        ga2 = g3 @ w3
        gz2 = ga2 * (a2 > 0)
        grads[3] = gz2.sum(axis=0)
        grads[2] = gz2.T @ a1
        ga1 = gz2 @ w2
        gz1 = ga1 * (a1 > 0)
        grads[1] = gz1.sum(axis=0)
        grads[0] = gz1.T @ x
        for i, (p, g) in enumerate(zip(params, grads)):
            buf = bufs[i]
            if buf is None:
                buf = bufs[i] = g.copy()
            else:
                buf *= 0.9
                buf += g
            p -= 0.01 * buf

    return step


def torch_mlp_step(torch: Any) -> Callable[[], None]:
    x_np, y_np = mlp_data()
    model = build_mlp()
    theirs = torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]),
        torch.nn.ReLU(),
        torch.nn.Linear(SIZES[1], SIZES[2]),
        torch.nn.ReLU(),
        torch.nn.Linear(SIZES[2], SIZES[3]),
    )
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    opt = torch.optim.SGD(theirs.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)

    def step() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(theirs(x), y)
        loss.backward()
        opt.step()

    return step


def lstm_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(LSTM_SEQ, LSTM_BATCH, LSTM_HIDDEN)).astype(np.float32)
    w = rng.normal(size=(LSTM_SEQ, LSTM_BATCH, LSTM_HIDDEN)).astype(np.float32)
    return x, w


def rpcdist_lstm() -> tuple[nn.LSTM, Callable[[], None]]:
    x_np, w_np = lstm_data()
    lstm = nn.LSTM(LSTM_HIDDEN, LSTM_HIDDEN, num_layers=LSTM_LAYERS, generator=rt.Generator(0))
    x, w = rt.tensor(x_np, requires_grad=True), rt.tensor(w_np)

    def run() -> None:
        lstm.zero_grad()
        out, (h, c) = lstm(x)
        ((out * w).sum() + h.sum() + c.sum()).backward()

    return lstm, run


def torch_lstm(torch: Any, ours: nn.LSTM) -> Callable[[], None]:
    x_np, w_np = lstm_data()
    lstm = torch.nn.LSTM(LSTM_HIDDEN, LSTM_HIDDEN, num_layers=LSTM_LAYERS)
    lstm.load_state_dict({k: torch.from_numpy(v) for k, v in ours.state_dict().items()})
    x = torch.from_numpy(x_np).requires_grad_(True)
    w = torch.from_numpy(w_np)

    def run() -> None:
        lstm.zero_grad()
        out, (h, c) = lstm(x)
        ((out * w).sum() + h.sum() + c.sum()).backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=200, help="timed MLP steps")
    parser.add_argument("--lstm-repeats", type=int, default=48, help="timed LSTM passes")
    args = parser.parse_args()
    torch: Any
    try:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
    except ImportError:
        torch = None

    step, n_ops = rpcdist_mlp_step()
    contenders = {"rpcdist": step, "numpy": numpy_mlp_step()}
    if torch is not None:
        contenders["torch"] = torch_mlp_step(torch)
    mlp = summary(interleaved(contenders, args.repeats))
    (t_ours, b_ours), (t_raw, b_raw) = mlp["rpcdist"], mlp["numpy"]
    t_torch, b_torch = mlp.get("torch", (float("nan"), float("nan")))
    overhead_us = (t_ours - t_raw) * 1e3 / n_ops
    overhead_best_us = (b_ours - b_raw) * 1e3 / n_ops
    rows: list[list[object]] = [
        ["rpcdist", t_ours, b_ours, t_ours / t_torch],
        ["raw NumPy (same arithmetic, no engine)", t_raw, b_raw, t_raw / t_torch],
    ]
    if torch is not None:
        rows.append(["PyTorch CPU", t_torch, b_torch, 1.0])
    mlp_table = table(
        ["implementation", "median step (ms)", "best (ms)", "median vs PyTorch"], rows
    )

    lstm, run = rpcdist_lstm()
    contenders = {"rpcdist": run}
    if torch is not None:
        contenders["torch"] = torch_lstm(torch, lstm)
    lstm_ms = summary(interleaved(contenders, args.lstm_repeats, rounds=8))
    l_ours, lb_ours = lstm_ms["rpcdist"]
    l_torch, lb_torch = lstm_ms.get("torch", (float("nan"), float("nan")))
    lstm_rows: list[list[object]] = [["rpcdist", l_ours, lb_ours, l_ours / l_torch]]
    if torch is not None:
        lstm_rows.append(["PyTorch CPU", l_torch, lb_torch, 1.0])
    lstm_table = table(
        ["implementation", "median fwd+bwd (ms)", "best (ms)", "median vs PyTorch"], lstm_rows
    )

    threads = f"torch threads {torch.get_num_threads()}" if torch else "PyTorch not installed"
    body = f"""
### MLP training step

784-256-256-10 MLP (ReLU), batch {BATCH}, float32, cross-entropy, SGD with
momentum 0.9: zero_grad + forward + backward + step; {args.repeats} steps per
contender in alternating blocks ({threads}). "best" is the fastest step, a
guide when the machine is shared and medians wander.

{mlp_table}

Engine overhead per recorded operation (its forward, its backward node and
the optimizer's share), over the {n_ops} operations the step records:
({t_ours:.3f} - {t_raw:.3f}) ms / {n_ops} = **{overhead_us:.1f} µs** from the
medians, ({b_ours:.3f} - {b_raw:.3f}) ms / {n_ops} = **{overhead_best_us:.1f} µs**
from the best steps (less sensitive to other load on the machine).

### LSTM forward + backward

{LSTM_LAYERS}-layer LSTM, input and hidden size {LSTM_HIDDEN}, sequence
{LSTM_SEQ}, batch {LSTM_BATCH}, float32; loss over the whole output and the
final state; {args.lstm_repeats} passes per contender in alternating blocks.
Each layer is one matmul of the whole sequence with `weight_ih` plus one
fused `h @ weight_hh.T` per step (all four gates), with BPTT in one node.

{lstm_table}
"""
    write_section("tensor", "Local tensor engine", body, "python benchmarks/bench_tensor.py")


if __name__ == "__main__":
    main()
