"""Launcher benchmark: wall time of small jobs through ``rpcdist-run`` and ``torchrun``.

Every job runs a worker script that does nothing but exit (so the time is
the launcher's: starting, watching and reaping the workers, and for several
nodes the rendezvous), on 127.0.0.1:

* ``one node``: one launcher, ``--nproc-per-node N``, the job succeeds;
* ``restart``: the same with ``--max-restarts 1``, where rank 0 fails on the
  first attempt; the difference from ``one node`` is the price of a restart;
* ``two nodes``: two launchers on one host (``--nnodes 2``, rendezvous on a
  port the OS picked: rpcdist's launchers' store, torchrun's c10d backend).

rpcdist and torchrun alternate, run by run, in the same process; the table
gives medians. torchrun's figures include importing torch (about a second
here), which is what a user of it waits for too. Without torch only rpcdist
is measured.

Run: ``.venv/bin/python benchmarks/bench_launch.py [--quick] [--no-write]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import byte_compile, median, table, write_section

from rpcdist.launch import free_port

WORKER = """\
import os, sys
restart = os.environ.get("RPCDIST_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT")
fail = sys.argv[1] == "fail" and restart == "0" and os.environ["RANK"] == "0"
sys.exit(1 if fail else 0)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCDIST_")}
    env["OMP_NUM_THREADS"] = "1"  # torchrun warns otherwise
    return env


def _run_all(commands: list[list[str]]) -> float:
    """Start every command at once, wait for all; seconds until the last exits."""
    start = time.perf_counter()
    procs = [
        subprocess.Popen(c, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for c in commands
    ]
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            if p.returncode != 0:
                raise RuntimeError(f"{commands[0][:4]} exited {p.returncode}: {err[-2000:]!r}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return time.perf_counter() - start


def rpcdist_job(script: str, nproc: int, kind: str) -> list[list[str]]:
    base = [sys.executable, "-m", "rpcdist.launch", "--nproc-per-node", str(nproc)]
    if kind == "one node":
        return [[*base, script, "ok"]]
    if kind == "restart":
        return [[*base, "--max-restarts", "1", script, "fail"]]
    port = str(free_port())
    common = ["--nnodes", "2", "--master-port", port, "--token", "bench"]
    return [[*base, *common, "--node-rank", str(k), script, "ok"] for k in (0, 1)]


def torchrun_job(script: str, nproc: int, kind: str) -> list[list[str]]:
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if kind == "one node":
        return [[*base, "--standalone", script, "ok"]]
    if kind == "restart":
        return [[*base, "--standalone", "--max-restarts", "1", script, "fail"]]
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    return [[*base, *common, "--rdzv-id", "bench", script, "ok"]] * 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="3 runs per row instead of 7")
    ap.add_argument("--no-write", action="store_true", help="print, do not update the report")
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    byte_compile()
    runs = 3 if args.quick else 7
    try:
        import torch  # noqa: F401

        launchers: dict[str, Callable[[str, int, str], list[list[str]]]] = {
            "rpcdist-run": rpcdist_job,
            "torchrun": torchrun_job,
        }
    except ImportError:
        launchers = {"rpcdist-run": rpcdist_job}
    rows = []
    with tempfile.TemporaryDirectory(prefix="rpcdist-bench-launch-") as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        for kind in ("one node", "restart", "two nodes"):
            times: dict[str, list[float]] = {name: [] for name in launchers}
            for _ in range(runs):  # alternate, so that drift hits both alike
                for name, job in launchers.items():
                    times[name].append(_run_all(job(script, args.nproc, kind)))
            ours = median(times["rpcdist-run"])
            theirs = median(times["torchrun"]) if "torchrun" in times else float("nan")
            rows.append([kind, args.nproc, ours, theirs, theirs / ours])
            print(f"{kind}: rpcdist-run {ours:.3f} s, torchrun {theirs:.3f} s", flush=True)
    body = table(
        ["job", "workers per node", "rpcdist-run (s)", "torchrun (s)", "torchrun / rpcdist"],
        rows,
    )
    body += (
        f"\n\nMedians of {runs} runs; every worker exits at once, so this is the "
        "launchers' own time (torchrun's includes importing torch)."
    )
    if args.no_write:
        print(body)
    else:
        write_section("launch", "Launcher: small jobs, rpcdist-run vs torchrun", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
