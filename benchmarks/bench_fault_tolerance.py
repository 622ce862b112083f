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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a check, not a measure)")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds per configuration")
    ap.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
    a = ap.parse_args()
    if a.quick:
        a.duration, a.kill_every = 12.0, 4.0
    byte_compile()
    random.seed(0)
    argv = ["--workers", str(WORKERS), "--steps", str(HUGE)]
    args = ex.parse_args(argv)
    load = os.getloadavg()[0]
    free = ex.run_job(args, argv, 0, duration=a.duration)
    faulty = ex.run_job(args, argv, 0, kill_every_s=a.kill_every, duration=a.duration)
    plain_steps = 300 if a.quick else 3000
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rpcdist.launch",
            "--nproc-per-node",
            str(WORKERS),
            str(EXAMPLES / "ddp_fault_tolerant.py"),
            "--mode",
            "plain",
            "--steps",
            str(plain_steps),
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    m = re.search(r"plain DDP: ([0-9.]+) steps/s", out)
    plain_rate = float(m.group(1)) if m else float("nan")
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
