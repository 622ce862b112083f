"""A worker for the launcher tests: ``child.py MODE DIR``; what it does depends on MODE.

* ``env``: write the launcher's variables and argv to ``DIR/rank<RANK>.json``.
* ``fail``: rank 0 records its pid and sleeps; rank 1 waits for that, then exits 3.
* ``stubborn``: like ``fail``, but rank 0 ignores SIGTERM (the launcher must SIGKILL it).
* ``flaky``: rank 0 fails the first attempt (no ``DIR/marker`` yet), then succeeds.
* ``sleep``: record the pid, then sleep (for signals sent to the launcher).
* ``deaf``: like ``sleep``, ignoring SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RPCDIST_TOKEN",
    "RPCDIST_RESTART_COUNT",
)


def write_pid(directory: str, rank: str) -> None:
    path = os.path.join(directory, f"pid{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # readers never see a partial file


def wait_for(path: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            sys.exit(f"{path} never appeared")
        time.sleep(0.01)


def main() -> int:
    mode, directory = sys.argv[1], sys.argv[2]
    rank = os.environ["RANK"]
    if mode == "env":
        record = {k: os.environ.get(k) for k in KEYS}
        record["argv"] = sys.argv[3:]
        record["pid"] = os.getpid()
        with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
        return 0
    if mode in ("fail", "stubborn"):
        if rank == "0":
            if mode == "stubborn":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            write_pid(directory, rank)
            time.sleep(60)
            return 0
        wait_for(os.path.join(directory, "pid0"))
        return 3
    if mode == "flaky":
        with open(os.path.join(directory, "attempts.log"), "a") as f:
            f.write(f"{rank} {os.environ['RPCDIST_RESTART_COUNT']} {os.environ['MASTER_PORT']}\n")
        marker = os.path.join(directory, "marker")
        if rank == "0" and not os.path.exists(marker):
            open(marker, "w").close()
            return 1
        return 0
    if mode in ("sleep", "deaf"):
        if mode == "deaf":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        write_pid(directory, rank)
        time.sleep(60)
        return 0
    sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
