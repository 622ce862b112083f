"""The examples at their default sizes: wall time and result of each (``make bench``).

Runs every script of ``examples/`` the way a user would (``python
examples/NAME.py``: each launches its own local workers), one after the other,
and writes the section "Examples" at the end of docs/benchmarks.md: wall time
from process start to exit, and the result the example prints (test
accuracy, validation perplexity and pipeline bubble, throughput). The load
average is recorded beside each run, because the examples share the machine's
cores with whatever else runs.

    python benchmarks/bench_examples.py [--quick] [names...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import byte_compile, table, write_section

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _first(pattern: str, out: str) -> str:
    m = re.search(pattern, out)
    return m.group(1) if m else "?"


def cases(out_dir: str, quick: bool) -> list[tuple[str, list[str], object]]:
    """``(name, arguments, result parser)`` per example run."""
    q = (lambda *a: list(a)) if quick else (lambda *a: [])

    def acc(out: str) -> str:
        return "test accuracy " + _first(r"final test accuracy ([0-9.]+)", out)

    def pipe(out: str) -> str:
        before = _first(r"step 0: validation perplexity ([0-9.]+)", out)
        after = _first(r"\] validation perplexity ([0-9.]+)", out)
        measured = _first(r"measured ([0-9.]+)", out)
        theory = _first(r"M\+S-1\) = \d+/\d+ = ([0-9.]+)", out)
        return f"perplexity {before} -> {after}; bubble measured {measured}, theory {theory}"

    def batching(out: str) -> str:
        plain = _first(r"unbatched: .*= ([0-9]+) req/s", out)
        batched = _first(r"batched:   .*= ([0-9]+) req/s", out)
        speedup = _first(r"speedup:\s+([0-9.]+x)", out)
        return f"unbatched {plain} req/s, batched {batched} req/s ({speedup})"

    def resumed(out: str) -> str:
        ok = "resumed from" in out
        return acc(out) + ("; resumed after the crash" if ok else "; DID NOT RESUME")

    ps = [*q("--epochs", "2", "--min-accuracy", "0.5")]
    return [
        ("demo.py", ["--out-dir", f"{out_dir}/demo", *q("--epochs", "2")], acc),
        *[
            (
                f"parameter_server.py --mode {mode}",
                ["--mode", mode, "--out-dir", f"{out_dir}/{mode}", *ps],
                acc,
            )
            for mode in ("sync", "hogwild", "autograd")
        ],
        ("pipeline_rnn.py", q("--steps", "5", "--max-perplexity", "200"), pipe),
        ("ddp.py", ["--checkpoint", f"{out_dir}/ddp.npz", *ps], acc),
        (
            "ddp.py --crash-at-epoch 3",
            [
                "--crash-at-epoch",
                "3",
                "--checkpoint",
                f"{out_dir}/ddp2.npz",
                *q("--epochs", "4", "--min-accuracy", "0.5"),
            ],
            resumed,
        ),
        ("ddp_rpc.py", ps, acc),
        ("batching_rpc.py", q("--requests", "200"), batching),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a check, not a measure)")
    ap.add_argument("names", nargs="*", help="run only examples whose name contains one of these")
    a = ap.parse_args()
    byte_compile()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    rows, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="rpcdist-examples-") as tmp:
        for name, args, parse in cases(tmp, a.quick):
            if a.names and not any(n in name for n in a.names):
                continue
            script = str(EXAMPLES / name.split()[0])
            load = os.getloadavg()[0]
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, script, *args], env=env, capture_output=True, text=True
            )
            wall = time.perf_counter() - start
            out = proc.stdout + proc.stderr
            result = parse(out) if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"  # type: ignore[operator]
            failed += proc.returncode != 0
            rows.append((f"`{name}`", wall, result, f"{load:.1f}"))
            print(f"{name}: {wall:.1f} s, {result}", flush=True)
    body = (
        "Each example once, at its default size, run as `python examples/NAME.py` "
        "(it launches its own local workers); wall time from process start to "
        "exit, including starting the workers. Load: the machine's 1-minute load "
        "average when the run started (above the core count, other work shared "
        "the cores and the times are longer than on an idle machine).\n\n"
        + table(["example", "wall s", "result", "load"], rows)
    )
    if not a.quick and not a.names:
        write_section("examples", "Examples", body)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
