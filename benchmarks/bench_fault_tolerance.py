"""Fault-tolerant DDP under ``kill -9``: goodput, recovery time, fault-free overhead.

Four configurations of the same training (``examples/ddp_fault_tolerant.py``:
the digits classifier, 4 ranks, 32 samples per rank and step), each for
``--duration`` seconds:

* the fault-tolerant mode without faults, and with ``kill -9`` of a random
  rank every ``--kill-every`` seconds (a spare process started ahead takes
  its place and pulls the live state);
* the ordinary DDP under the launcher (``--max-restarts``), checkpointing
  every 50 steps, without faults and with the same kills: the launcher
  restarts every rank, and they resume from the checkpoint.

Goodput: committed steps per second over the same path's fault-free rate.
Recovery: the kill to the first step committed by all 4 ranks again.
Overhead: the fault-tolerant mode's fault-free step rate against the
ordinary DDP's (process group, shared-memory collectives), measured by
the ranks themselves over a fixed number of steps.

    python benchmarks/bench_fault_tolerance.py [--quick] [--duration S] [--kill-every S]

``--fault-free`` measures only the overhead: ``--rounds`` alternating pairs
of the mode's fault-free run (``--duration`` s) and the ordinary DDP's
(``--plain-steps``), each with its wall-clock rate and its ranks' CPU time
per step (on a shared machine the CPU figure moves less than the rate).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import byte_compile, median, table, write_section

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import ddp_fault_tolerant as ex

WORKERS = 4
HUGE = 10**9


def launcher_run(duration: float, kill_every: float, steps: int = HUGE) -> tuple[float, str]:
    """The ordinary DDP under the launcher; kill a random rank every ``kill_every`` s.
    Returns (checkpointed steps per second over the run, the output)."""
    with tempfile.TemporaryDirectory(prefix="rpcdist-ft-bench-") as work:
        cmd = [
            sys.executable,
            "-m",
            "rpcdist.launch",
            "--nproc-per-node",
            str(WORKERS),
            "--max-restarts",
            "1000",
            str(EXAMPLES / "ddp_fault_tolerant.py"),
            "--mode",
            "plain",
            "--workdir",
            work,
            "--checkpoint-every",
            "50",
            "--steps",
            str(steps),
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        progress = Path(work, "progress")
        try:
            while proc.poll() is None and not progress.exists():
                time.sleep(0.01)  # the clock starts at the first checkpoint
            first = int(progress.read_text().split()[0])
            began = time.monotonic()
            next_kill = began + kill_every if kill_every else float("inf")
            while proc.poll() is None and time.monotonic() - began < duration:
                if time.monotonic() >= next_kill:
                    victim = random.randrange(WORKERS)
                    with contextlib.suppress(OSError, ValueError):
                        pid = int(Path(work, f"pid{victim}").read_text())
                        os.kill(pid, signal.SIGKILL)
                    next_kill += kill_every
                time.sleep(0.01)
            step = int(progress.read_text().split()[0]) - first
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    return step / duration, out


def plain_run(steps: int) -> str:
    """The ordinary DDP for ``steps`` steps under the launcher; its output."""
    cmd = [sys.executable, "-m", "rpcdist.launch", "--nproc-per-node", str(WORKERS)]
    cmd += [str(EXAMPLES / "ddp_fault_tolerant.py"), "--mode", "plain", "--steps", str(steps)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout


def plain_figures(out: str) -> tuple[float, float]:
    """Steps per second and rank 0's CPU ms per step from :func:`plain_run`'s output."""
    m = re.search(r"plain DDP: ([0-9.]+) steps/s, ([0-9.]+) ms CPU", out)
    return (float(m.group(1)), float(m.group(2))) if m else (float("nan"), float("nan"))


def fault_free(a: argparse.Namespace) -> int:
    """Alternating pairs of the mode's and the ordinary DDP's fault-free runs."""
    argv = ["--workers", str(WORKERS), "--steps", str(HUGE)]
    args = ex.parse_args(argv)
    rows, ratios, cpu_ratios = [], [], []
    for i in range(a.rounds):
        load = os.getloadavg()[0]
        pair: dict[str, tuple[float, float]] = {}
        for which in ("ft", "plain") if i % 2 == 0 else ("plain", "ft"):
            if which == "ft":
                free = ex.run_job(args, argv, 0, duration=a.duration)
                pair[which] = (free["rate"], free["cpu_ms"])
            else:
                pair[which] = plain_figures(plain_run(a.plain_steps))
        (ft_rate, ft_cpu), (pl_rate, pl_cpu) = pair["ft"], pair["plain"]
        ratios.append(pl_rate / ft_rate - 1)
        cpu_ratios.append(ft_cpu / pl_cpu - 1)
        wall, cpu = f"{ratios[-1]:+.0%}", f"{cpu_ratios[-1]:+.0%}"
        rows.append((i + 1, f"{load:.1f}", ft_rate, pl_rate, wall, ft_cpu, pl_cpu, cpu))
    body = (
        f"{WORKERS} ranks of `examples/ddp_fault_tolerant.py`, no faults; {a.rounds} "
        f"alternating pairs: the fault-tolerant mode for {a.duration:.0f} s, the ordinary "
        f"DDP (process group, shared-memory collectives) for {a.plain_steps} steps. "
        "Overhead: the mode's step time over the ordinary DDP's (wall clock), and its "
        "ranks' CPU time per step over the ordinary DDP's rank 0's.\n\n"
        + table(
            [
                "round",
                "load",
                "FT steps/s",
                "DDP steps/s",
                "step time overhead",
                "FT CPU ms/step",
                "DDP CPU ms/step",
                "CPU overhead",
            ],
            rows,
        )
        + f"\n\nMedian overhead: {median(ratios):+.0%} (wall clock, spread "
        f"{min(ratios):+.0%} to {max(ratios):+.0%}), {median(cpu_ratios):+.0%} (CPU per step, "
        f"spread {min(cpu_ratios):+.0%} to {max(cpu_ratios):+.0%}).\n"
    )
    print(body)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a check, not a measure)")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds per configuration")
    ap.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
    ap.add_argument("--fault-free", action="store_true", help="only the fault-free overhead")
    ap.add_argument("--rounds", type=int, default=3, help="--fault-free: pairs of runs")
    ap.add_argument("--plain-steps", type=int, default=1500, help="--fault-free: DDP steps")
    a = ap.parse_args()
    byte_compile()
    if a.fault_free:
        if a.quick:
            a.duration, a.rounds, a.plain_steps = 4.0, 1, 300
        return fault_free(a)
    if a.quick:
        a.duration, a.kill_every = 12.0, 4.0
    random.seed(0)
    argv = ["--workers", str(WORKERS), "--steps", str(HUGE)]
    args = ex.parse_args(argv)
    load = os.getloadavg()[0]
    free = ex.run_job(args, argv, 0, duration=a.duration)
    faulty = ex.run_job(args, argv, 0, kill_every_s=a.kill_every, duration=a.duration)
    plain_steps = 300 if a.quick else 3000
    out = plain_run(plain_steps)
    plain_rate = plain_figures(out)[0]
    ckpt_free, _ = launcher_run(a.duration, 0.0)
    ckpt_faulty, log = launcher_run(a.duration, a.kill_every)
    restarts = log.count("restarting the worker group")
    rec = faulty["recoveries"]
    nan = float("nan")
    rows = [
        (
            "fault-tolerant mode",
            free["rate"],
            faulty["rate"],
            faulty["rate"] / free["rate"],
            faulty["sample_rate"] / free["sample_rate"],
            faulty["kills"],
            faulty["redone"],
            median(rec) if rec else nan,
            max(rec, default=nan),
        ),
        (
            "launcher restart + checkpoint",
            ckpt_free,
            ckpt_faulty,
            ckpt_faulty / ckpt_free if ckpt_free else nan,
            "n/a",
            f"{restarts} restarts",
            "since checkpoint",
            "n/a",
            "n/a",
        ),
    ]
    overhead = plain_rate / free["rate"] - 1  # step time over the ordinary DDP's
    coverage = all(
        c and least >= 1 and extra < WORKERS for c, extra, least in faulty["coverage"].values()
    )
    body = (
        f"{WORKERS} ranks of `examples/ddp_fault_tolerant.py` (digits, 64-128-10 MLP, "
        f"32 samples per rank and step), {a.duration:.0f} s per configuration, "
        f"`kill -9` of a random rank every {a.kill_every:.0f} s; load average "
        f"{load:.1f} at the start (on 2 cores shared with other jobs, so rates are "
        "noisy). Goodput: steps per second with faults over the same path's "
        "fault-free rate (the launcher path counts only checkpointed steps). "
        "Goodput (samples): samples trained per second, the same ratio (a step at "
        "3 ranks trains fewer samples, and on 2 cores is also faster). "
        "Recovery: kill to the first step committed by all ranks again.\n\n"
        + table(
            [
                "path",
                "fault-free steps/s",
                "with faults steps/s",
                "goodput (steps)",
                "goodput (samples)",
                "kills",
                "steps redone",
                "recovery median s",
                "recovery max s",
            ],
            rows,
        )
        + f"\n\nFault-free overhead of the mode: {free['rate']:.1f} steps/s against "
        f"{plain_rate:.1f} for the ordinary DDP over a process group ({plain_steps} "
        f"steps, the ranks' own timing): the step takes {overhead:+.0%} against the "
        "ordinary DDP's (negative: faster). "
        f"Every sample of each finished epoch in exactly one committed batch "
        f"(padding aside): {'yes' if coverage else 'NO'}.\n"
    )
    print(body)
    if not a.quick:
        write_section("fault-tolerance", "Fault-tolerant DDP under kill -9", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
