"""Distributed autograd benchmark: rpcdist beside PyTorch's, same run.

One iteration = open a context + forward across workers + backward + a
DistributedOptimizer step (SGD), on three processes of this machine
(``trainer``, ``ps1``, ``ps2``), one compute thread each:

* ``ps-tiny``: the trainer calls a Linear(16, 16) held by a parameter server
  through a RemoteModule, batch 4;
* ``ps-mlp``: a 784-256-256-10 MLP whose first Linear lives on the server,
  batch 128, cross-entropy;
* ``rnn``: an embedding table (1000 x 64) on ps1, a 2-layer LSTM (128) on the
  trainer, the decoder Linear(128, 1000) on ps2; sequence 35, batch 20.

"alone" is the same model and step in one process (each framework's own
local engine); "per crossing" is (distributed - alone) / the remote calls
the forward makes (1, 1 and 2).

Run: ``.venv/bin/python benchmarks/bench_dist_autograd.py [--quick] [--repeats N] [--no-write]``
"""

from __future__ import annotations

import os

# One compute thread per process, for both frameworks, set before NumPy and
# torch load their BLAS (an oversubscribed OpenBLAS spins: measured 100x slower
# steps when this was set after the import).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse
import multiprocessing as mp
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ad_workloads as wl
from _report import free_port, median, table, time_steps, write_section

CROSSINGS = {"ps-tiny": 1, "ps-mlp": 1, "rnn": 2}
GOALS = {"ps-tiny": 0.4, "ps-mlp": 0.7, "rnn": 1.0}


def _run_job(
    target: Any, make_arg: Any, plan: list[tuple[str, int, int]]
) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    arg = make_arg()
    procs = [ctx.Process(target=target, args=(r, 3, arg, plan, q), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        out: dict[str, list[float]] = q.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return out


def _alone(fn: Any, plan: list[tuple[str, int, int]]) -> dict[str, list[float]]:
    return {name: time_steps(fn(name, False), warmup, iters) for name, iters, warmup in plan}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--leak-iters",
        type=int,
        default=10_000,
        help="ps-tiny iterations of the memory check (0: skip)",
    )
    a = ap.parse_args()
    wl.single_thread_env()
    iters = (
        {"ps-tiny": 300, "ps-mlp": 100, "rnn": 20}
        if not a.quick
        else {"ps-tiny": 60, "ps-mlp": 20, "rnn": 5}
    )
    plan = [(n, iters[n], max(3, iters[n] // 10)) for n in wl.WORKLOADS]
    try:
        import torch

        torch.set_num_threads(1)
        have_torch = True
    except ImportError:
        have_torch = False
    runs: dict[str, dict[str, list[float]]] = {}

    def add(kind: str, got: dict[str, list[float]]) -> None:
        for name, xs in got.items():
            runs.setdefault(kind, {}).setdefault(name, []).append(median(xs))

    def rpcdist_rep(rep: int) -> None:
        init = f"file://{tmp}/rdv{rep}"
        add("rpcdist", _run_job(wl.rd_worker, lambda: init, plan))
        add("rpcdist alone", _alone(wl.rd_iteration_fn, plan))

    def torch_rep(rep: int) -> None:
        if have_torch:
            add("PyTorch", _run_job(wl.th_worker, free_port, plan))
            add("PyTorch alone", _alone(wl.th_iteration_fn, plan))

    leak: Any = None
    with tempfile.TemporaryDirectory() as tmp:
        # The frameworks take turns going first; the long memory check comes
        # last (run first, it measurably slowed the timed run after it).
        for rep in range(a.repeats):
            for run in (rpcdist_rep, torch_rep) if rep % 2 == 0 else (torch_rep, rpcdist_rep):
                run(rep)
        if a.leak_iters:
            got = _run_job(
                wl.rd_worker, lambda: f"file://{tmp}/leak", [("leak", a.leak_iters, 1000)]
            )
            leak = got["leak"]
    rows = []
    for name in wl.WORKLOADS:
        rd = median(runs["rpcdist"][name]) * 1e3
        rd_alone = median(runs["rpcdist alone"][name]) * 1e3
        th = median(runs["PyTorch"][name]) * 1e3 if have_torch else float("nan")
        th_alone = median(runs["PyTorch alone"][name]) * 1e3 if have_torch else float("nan")
        ratio = rd / th if have_torch else float("nan")
        rows.append(
            [
                name,
                rd,
                th,
                ratio,
                f"<= {GOALS[name]}",
                rd_alone,
                th_alone,
                (rd - rd_alone) / CROSSINGS[name] * 1e3,
                (th - th_alone) / CROSSINGS[name] * 1e3,
            ]
        )
    headers = [
        "workload",
        "rpcdist ms/iter",
        "PyTorch ms/iter",
        "ratio",
        "goal",
        "rpcdist alone",
        "PyTorch alone",
        "rpcdist us/crossing",
        "PyTorch us/crossing",
    ]
    body = table(headers, rows)
    if leak is not None:
        names = ["trainer", "ps1", "ps2"]
        leak_rows = [[n, b[0], e[0], e[0] - b[0], e[1]] for n, b, e in zip(names, *leak)]
        body += (
            f"\n\nMemory after {a.leak_iters:,} more ps-tiny iterations (each opening and "
            "releasing a context on every worker), after 1,000 to warm up:\n\n"
            + table(
                [
                    "worker",
                    "RSS before (MB)",
                    "RSS after (MB)",
                    "growth (MB)",
                    "live contexts after",
                ],
                leak_rows,
            )
        )
    print(body)
    if not a.no_write:
        intro = (__doc__ or "").split("\n\n", 1)[1].rsplit("\n\nRun:", 1)[0]
        write_section(
            "dist_autograd",
            "Distributed autograd: one training iteration across workers",
            f"{intro}\n\n{body}\n\nMedians of {a.repeats} runs (each a median over its "
            "iterations); times in ms, per-crossing overheads in us.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
