"""Fault-tolerant DDP under ``kill -9``: goodput, recovery time, fault-free overhead.

The same training in each configuration (``examples/ddp_fault_tolerant.py``:
the digits classifier, 4 ranks, 32 samples per rank and step), each for
``--duration`` seconds:

* the fault-tolerant mode without faults, and with ``kill -9`` of a random
  rank every ``--kill-every`` seconds (a spare process started ahead takes
  its place and pulls the live state);
* the ordinary DDP under the launcher (``--max-restarts``), checkpointing
  every 50 steps, without faults and with the same kills: the launcher
  restarts every rank, and they resume from the checkpoint;
* where torch is installed, the baseline: the same training with PyTorch's
  DDP over Gloo (``_torch_ddp_ckpt.py``) under torchrun (``--max-restarts``),
  checkpointing every 50 steps, without faults and with the same kills of
  a random worker; torchrun restarts the group, which resumes from the
  checkpoint. Without torch this part is skipped, saying so.

Goodput: committed steps per second over the same path's fault-free rate.
Recovery: the kill to the first step committed by all 4 ranks again.
Overhead: the fault-tolerant mode's fault-free step rate against the
ordinary DDP's (process group, shared-memory collectives), measured by
the ranks themselves over a fixed number of steps.

    python benchmarks/bench_fault_tolerance.py [--quick] [--no-write] [--duration S]
        [--kill-every S]

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
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import byte_compile, have_torch_distributed, median, table, write_section

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import ddp_fault_tolerant as ex

WORKERS = 4
HUGE = 10**9
#: Steps between checkpoints on both launcher paths (rpcdist's and torchrun's):
#: a kill redoes at most 49 steps, a fraction of a second of training here,
#: and saving this small model (9,610 parameters and their momentum) every
#: 50 steps is a small share of the step time.
CHECKPOINT_EVERY = 50
TORCH_WORKER = Path(__file__).resolve().parent / "_torch_ddp_ckpt.py"


#: The beacon (``--workdir``/beacon) rank 0 of both launcher paths rewrites
#: after each step: 6 float64.
BEACON = ("attempt", "step", "resumed", "first", "saved", "last")


def read_beacon(path: str) -> dict[str, float] | None:
    """The beacon's fields: the attempt (1 + the launcher's restarts), the
    last step finished, the step this attempt resumed from, when it finished
    its first step, the last step checkpointed, when the last step finished
    (``time.monotonic()``: one clock for all processes). ``None`` before the
    first step."""
    size = 8 * len(BEACON)
    try:
        with open(path, "rb") as f:
            raw = f.read(size)
    except OSError:
        return None
    return dict(zip(BEACON, struct.unpack("6d", raw), strict=True)) if len(raw) == size else None


def launcher_run(launcher: str, duration: float, kill_every: float) -> dict:
    """The ordinary DDP under a launcher that restarts the group
    (``--max-restarts``), checkpointing every ``CHECKPOINT_EVERY`` steps,
    for ``duration`` s from its first step; ``kill -9`` of a random worker
    (a child of the launcher) every ``kill_every`` s, once the job made a
    step again after the previous kill. ``launcher``: ``rpcdist`` (the
    example's plain mode under ``rpcdist.launch``) or ``torch`` (PyTorch's
    DDP, ``_torch_ddp_ckpt.py``, under torchrun)."""
    with tempfile.TemporaryDirectory(prefix="rpcdist-ft-bench-") as work:
        gone = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if k not in gone}
        env["RPCDIST_FT_BENCH_JOB"] = work  # finds the workers when stopping
        if launcher == "torch":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--local-addr", "127.0.0.1", str(TORCH_WORKER)]
            env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
            # A store per group: with the agent's shared one (the default), the
            # restarted group's Gloo mesh failed to connect here (torch 2.13:
            # "connectFullMesh failed ... Connection refused", the previous
            # group's addresses still in the store), and torchrun never got back.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        else:
            cmd = [sys.executable, "-m", "rpcdist.launch"]
            cmd += [str(EXAMPLES / "ddp_fault_tolerant.py"), "--mode", "plain"]
        cmd[3:3] = ["--nproc-per-node", str(WORKERS), "--max-restarts", "1000"]
        cmd += ["--workdir", work, "--steps", str(HUGE)]
        cmd += ["--checkpoint-every", str(CHECKPOINT_EVERY)]
        with open(os.path.join(work, "launcher.log"), "w+") as log:
            agent = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                return _drive(agent, os.path.join(work, "beacon"), duration, kill_every)
            except RuntimeError:
                log.seek(0)
                print(log.read()[-3000:], file=sys.stderr)
                raise
            finally:
                stop_job(agent, "RPCDIST_FT_BENCH_JOB=" + work)


def _drive(agent: subprocess.Popen, beacon: str, duration: float, kill_every: float) -> dict:
    """The clock, the kills and the figures of :func:`launcher_run`."""

    def alive() -> dict[str, float]:
        if agent.poll() is not None:
            raise RuntimeError(f"the launcher exited with {agent.returncode}")
        return read_beacon(beacon) or {"attempt": 0.0, "step": 0.0}

    start = time.monotonic()
    while (b0 := alive())["step"] < 1:  # the clock starts at the first step
        if time.monotonic() - start > 300:
            raise RuntimeError("the launcher's job made no step in 300 s")
        time.sleep(0.01)
    began = time.monotonic()
    next_kill = began + kill_every if kill_every else float("inf")
    pending: tuple[float, float, float] | None = None  # kill time, attempt, last step
    kills, recoveries, lost = 0, [], []
    while (now := time.monotonic()) - began < duration:
        b = alive()
        if pending and b["attempt"] > pending[1]:  # back: the next attempt made a step
            recoveries.append(b["first"] - pending[0])
            lost.append(pending[2] - b["resumed"])
            pending = None
        elif pending:
            pending = (*pending[:2], max(pending[2], b["step"]))  # steps ended after the kill
        elif now >= next_kill and len(ranks := worker_ranks(agent.pid)) == WORKERS:
            victim = random.choice(sorted(ranks))
            with contextlib.suppress(ProcessLookupError):
                os.kill(ranks[victim], signal.SIGKILL)
            pending, kills = (time.monotonic(), b["attempt"], b["step"]), kills + 1
            next_kill = now + kill_every
        time.sleep(0.01)
    b, end = alive(), time.monotonic()
    if not kills:  # rank 0's own clock, as the mode's rate is the ranks'
        rate = (b["step"] - b0["step"]) / (b["last"] - b0["last"])
    else:  # progress kept: back to the checkpoint if the last kill is not over
        rate = ((b["saved"] if pending else b["step"]) - b0["step"]) / (end - began)
    while pending and time.monotonic() - end < 300:  # the last recovery, out of the clock
        if (b := alive())["attempt"] > pending[1]:
            recoveries.append(b["first"] - pending[0])
            lost.append(pending[2] - b["resumed"])
            pending = None
        time.sleep(0.01)
    return {
        "rate": rate,
        "kills": kills,
        "recoveries": recoveries,
        "lost": lost,
    }


def worker_ranks(agent: int) -> dict[int, int]:
    """The launcher's workers now: their ``RANK`` to their pid."""
    out = {}
    for pid in _pids():
        with contextlib.suppress(OSError, KeyError, ValueError, IndexError):
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent == agent:
                out[int(_environ(pid)[b"RANK"])] = pid
    return out


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _environ(pid: int) -> dict[bytes, bytes]:
    """A process's environment (empty once it is gone or not ours)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(v.split(b"=", 1) for v in raw.split(b"\0") if b"=" in v)


def stop_job(agent: subprocess.Popen, marker: str) -> None:
    """Stop the launcher and every worker it started: torchrun's run in
    sessions of their own, so each carries ``marker`` in its environment and
    is found by it, including one the launcher spawned just before it stopped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGSTOP)  # spawns nothing more
    key, value = (v.encode() for v in marker.split("=", 1))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [p for p in _pids() if p != agent.pid and _environ(p).get(key) == value]
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not left:
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()


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
    ap.add_argument("--no-write", action="store_true", help="print, do not update the report")
    a = ap.parse_args()
    byte_compile()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups
    if a.fault_free:
        if a.quick:
            a.duration, a.rounds, a.plain_steps = 4.0, 1, 300
        return fault_free(a)
    if a.quick:
        a.duration, a.kill_every = 12.0, 4.0
    return with_kills(a)


def with_kills(a: argparse.Namespace) -> int:
    """Every path without and with kills; the table."""
    random.seed(0)
    argv = ["--workers", str(WORKERS), "--steps", str(HUGE)]
    args = ex.parse_args(argv)
    load = os.getloadavg()[0]
    free = ex.run_job(args, argv, 0, duration=a.duration)
    faulty = ex.run_job(args, argv, 0, kill_every_s=a.kill_every, duration=a.duration)
    plain_steps = 300 if a.quick else 3000
    out = plain_run(plain_steps)
    plain_rate = plain_figures(out)[0]
    paths = {"rpcdist launcher restart + checkpoint": "rpcdist"}
    if have_torch_distributed():
        paths[TORCH_PATH] = "torch"
    else:
        print("torchrun + PyTorch DDP skipped: torch.distributed is not installed")
    restarts = {
        name: (
            launcher_run(launcher, a.duration, 0.0),
            launcher_run(launcher, a.duration, a.kill_every),
        )
        for name, launcher in paths.items()
    }
    rec = faulty["recoveries"]
    nan = float("nan")
    rows: list[tuple[object, ...]] = [
        (
            "fault-tolerant mode",
            free["rate"],
            faulty["rate"],
            faulty["rate"] / free["rate"],
            faulty["rate"] / free["rate"],
            faulty["sample_rate"] / free["sample_rate"],
            faulty["kills"],
            faulty["redone"],
            median(rec) if rec else nan,
            max(rec, default=nan),
        )
    ]
    for name, (ok, hit) in restarts.items():
        rec = hit["recoveries"]
        rows.append(
            (
                name,
                ok["rate"],
                hit["rate"],
                hit["rate"] / ok["rate"],
                hit["rate"] / free["rate"],
                "n/a",
                hit["kills"],
                f"{sum(hit['lost']):.0f}",
                median(rec) if rec else nan,
                max(rec, default=nan),
            )
        )
    overhead = plain_rate / free["rate"] - 1  # step time over the ordinary DDP's
    coverage = all(
        c and least >= 1 and extra < WORKERS for c, extra, least in faulty["coverage"].values()
    )
    body = (
        f"{WORKERS} ranks of `examples/ddp_fault_tolerant.py` (digits, 64-128-10 MLP, "
        f"32 samples per rank and step), {a.duration:.0f} s per configuration, "
        f"`kill -9` of a random rank every {a.kill_every:.0f} s (the next once the job "
        f"is back from the last); load average {load:.1f} at the start (the other "
        "work on the 2 cores before the run). Goodput: steps per second with faults over "
        "the same path's fault-free rate; over the mode's: over the fault-tolerant mode's "
        "fault-free rate. Goodput (samples): samples trained per second, the same ratio (a "
        "step at 3 ranks trains fewer samples, and on 2 cores is also faster). Recovery: "
        "kill to the first step committed by all ranks again.\n\n"
        + table(
            [
                "path",
                "fault-free steps/s",
                "with faults steps/s",
                "goodput (steps)",
                "goodput over the mode's",
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
        f"(padding aside): {'yes' if coverage else 'NO'}.\n\n"
        + LAUNCHERS
        + torch_note((free, faulty), plain_rate, restarts)
    )
    print(body)
    if not a.quick and not a.no_write:
        write_section("fault-tolerance", "Fault-tolerant DDP under kill -9", body)
    return 0


LAUNCHERS = (
    "The launcher paths: rank 0 saves a checkpoint every "
    f"{CHECKPOINT_EVERY} steps and every rank resumes from it after the launcher "
    f"(`--nproc-per-node {WORKERS} --max-restarts 1000`) restarted the group; the kill is "
    "`SIGKILL` of a random worker (a child of the launcher). Steps/s: rank 0's steps "
    "less those redone (from its first step; the steps past the last checkpoint do not "
    "count if a kill is not over at the end); steps redone: past the checkpoint when the "
    "rank died; recovery: the kill to the restarted group's first step (all ranks; a kill "
    "near the end is waited for after the clock stopped). rpcdist's: the ordinary DDP "
    "(`--mode plain`) under `python -m rpcdist.launch`.\n"
)
TORCH_PATH = "torchrun + PyTorch DDP, checkpoint"


def torch_note(ft: tuple[dict, dict], plain_rate: float, runs: dict[str, tuple[dict, dict]]) -> str:
    """The torchrun row's ratios to the mode's and to rpcdist's launcher path's."""
    if TORCH_PATH not in runs:
        return "\ntorchrun + PyTorch DDP: not measured (torch.distributed is not installed).\n"
    (free, faulty), ft_rate = runs[TORCH_PATH], ft[0]["rate"]
    ours = next(hit for name, (_, hit) in runs.items() if name != TORCH_PATH)
    rec, ft_rec, our_rec = (_median_s(r["recoveries"]) for r in (faulty, ft[1], ours))
    return (
        "\ntorchrun + PyTorch DDP: the same model, data, batch and optimizer with "
        "`torch.nn.parallel.DistributedDataParallel` over Gloo on 127.0.0.1 "
        "(`benchmarks/_torch_ddp_ckpt.py`, 1 thread per rank) under `python -m "
        "torch.distributed.run --standalone` with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` "
        "(with the agent's shared store the restarted group's Gloo mesh failed to "
        "connect). Against the mode: fault-free, its step takes "
        f"{ft_rate / free['rate'] - 1:+.0%} against the mode's (and "
        f"{plain_rate / free['rate'] - 1:+.0%} against rpcdist's ordinary DDP's); with "
        f"faults it keeps {faulty['rate'] / ft_rate:.2f} of the mode's fault-free rate "
        f"(the mode: {ft[1]['rate'] / ft_rate:.2f}; rpcdist's launcher path: "
        f"{ours['rate'] / ft_rate:.2f}); median recovery {rec} against the mode's "
        f"{ft_rec} and rpcdist's launcher path's {our_rec}.\n"
    )


def _median_s(seconds: list[float]) -> str:
    return f"{median(seconds):.2f} s" if seconds else "n/a"


if __name__ == "__main__":
    sys.exit(main())
