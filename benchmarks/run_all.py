"""Run every benchmark (``make bench``); each rewrites its section of docs/benchmarks.md.

Usage: ``python benchmarks/run_all.py [--quick] [names...]`` where names are
benchmark script stems without ``bench_`` (rpc, rref, tensor, collectives).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick", action="store_true", help="pass --quick to benchmarks that accept it"
    )
    ap.add_argument("names", nargs="*")
    a = ap.parse_args()
    scripts = sorted(HERE.glob("bench_*.py"))
    if a.names:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in a.names]
    failed = []
    for script in scripts:
        cmd = [sys.executable, str(script)]
        if a.quick and "--quick" in script.read_text():
            cmd.append("--quick")
        print(f"== {script.name}", flush=True)
        if subprocess.run(cmd, check=False).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"benchmarks failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
