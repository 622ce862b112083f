"""PyTorch interop benchmark: PyTorch's RPC programs under PyTorch RPC and
under rpcdist.torch, in the same run, with the imports the only difference.

* ``rnn program``: PyTorch's distributed RNN example as a whole (two
  processes started with ``torch.multiprocessing.spawn``, rendezvous, 50
  training iterations, shutdown): the wall time of the program, from its
  launch to its exit, as a user sees it.
* ``ps iteration``: one step of a parameter server (a 784-256-10 MLP on the
  server; the trainer's context, forward through RPC, distributed backward
  and DistributedOptimizer step; batch 64), median over ``--iters`` steps
  after a warm-up, one compute thread per process.

Runs alternate between the two flavors so that load on the machine hits
both alike; the ps iteration runs twice per repeat (a fresh pair of
processes each time), since it is cheap and varies most between runs. Run:
``.venv/bin/python benchmarks/bench_torch_interop.py [--repeats N] [--iters N]
[--no-write]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import (
    byte_compile,
    free_port,
    have_torch_distributed,
    invocation,
    median,
    percentile,
    table,
    write_section,
)

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "_interop_programs.py")
ROOT = os.path.dirname(HERE)
GOAL = 0.7


def _run(program: str, flavor: str, *extra: str) -> float:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["INTEROP_FLAVOR"] = flavor
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, PROGRAM, program, flavor, *extra],
        env=env,
        check=True,
        timeout=600,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t


def _ps(flavor: str, iters: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        _run("ps", flavor, "--iters", str(iters), "--out", out)
        with open(out) as f:
            times: list[float] = json.load(f)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    byte_compile()
    if not have_torch_distributed():
        print("torch with torch.distributed is not installed: nothing to compare")
        return 0
    rnn: dict[str, list[float]] = {"rpcdist": [], "torch": []}
    ps: dict[str, list[float]] = {"rpcdist": [], "torch": []}
    for rep in range(a.repeats):
        order = ("rpcdist", "torch") if rep % 2 == 0 else ("torch", "rpcdist")
        for flavor in order:
            rnn[flavor].append(_run("rnn", flavor))
            for _ in range(2):
                times = _ps(flavor, a.iters)
                ps[flavor].append(median(times))
                print(
                    f"rep {rep} {flavor}: rnn {rnn[flavor][-1]:.2f} s, ps step "
                    f"{ps[flavor][-1] * 1e3:.2f} ms (p90 {percentile(times, 90) * 1e3:.2f})",
                    file=sys.stderr,
                )
    rows = []
    for name, got, unit, scale in (("rnn program", rnn, "s", 1.0), ("ps iteration", ps, "ms", 1e3)):
        ours, theirs = median(got["rpcdist"]) * scale, median(got["torch"]) * scale
        rows.append(
            [
                name,
                unit,
                ours,
                theirs,
                ours / theirs,
                f"<= {GOAL}",
                "yes" if ours / theirs <= GOAL else "no",
                f"{min(got['rpcdist']) * scale:.2f}-{max(got['rpcdist']) * scale:.2f}",
                f"{min(got['torch']) * scale:.2f}-{max(got['torch']) * scale:.2f}",
            ]
        )
    body = table(
        [
            "workload",
            "unit",
            "rpcdist.torch",
            "PyTorch RPC",
            "ratio",
            "goal",
            "met",
            "rpcdist range",
            "PyTorch range",
        ],
        rows,
    )
    body += (
        f"\n\nMedians over {a.repeats} runs of each (the ps iteration: {2 * a.repeats}), "
        "alternating. The RNN program is "
        "PyTorch's example as a whole (process start, `import torch`, rendezvous, 50 "
        "iterations, shutdown); the ps iteration is the median of "
        f"{a.iters} steps after a warm-up. Other sessions share this machine's cores, so "
        "single runs vary by 2x; compare the ranges as well as the medians."
    )
    print(body)
    if not a.no_write:
        write_section(
            "torch_interop",
            "PyTorch interop (rpcdist.torch vs PyTorch RPC)",
            body,
            invocation(".venv/bin/python"),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
