"""``make demo``: parameter-server training on 3 local worker processes.

Runs ``examples/parameter_server.py`` through the launcher (``rpcdist.launch``)
with 1 parameter server and 2 trainers, then prints a short summary. The exit
code is the job's: non-zero when a worker failed or the model did not learn.

    python examples/demo.py [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from rpcdist import launch

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=3, help="1 parameter server + trainers")
    args = p.parse_args(argv)

    print(
        f"rpcdist demo: {args.workers} processes (1 parameter server, "
        f"{args.workers - 1} trainers), {args.epochs} epochs",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="rpcdist-demo-") as tmp:
        summary_path = os.path.join(tmp, "summary.json")
        start = time.perf_counter()
        # The launcher starts the workers with RANK, WORLD_SIZE, MASTER_ADDR,
        # MASTER_PORT and a fresh job token in their environment, waits for
        # them and returns the job's exit code.
        code = launch.main(
            [
                "--nproc-per-node",
                str(args.workers),
                os.path.join(HERE, "parameter_server.py"),
                "--epochs",
                str(args.epochs),
                "--summary-json",
                summary_path,
            ]
        )
        wall = time.perf_counter() - start
        summary = None
        if os.path.exists(summary_path):
            with open(summary_path) as f:
                summary = json.load(f)

    print("\n== rpcdist demo summary ==")
    if summary is not None:
        print(f"trainers:        {summary['trainers']}")
        for epoch in summary["epochs"]:
            print(
                f"epoch {epoch['epoch']}:         loss {epoch['train_loss']:.4f}, "
                f"test accuracy {epoch['test_accuracy']:.3f}"
            )
        print(f"test accuracy:   {summary['test_accuracy']:.4f}")
        print(
            f"throughput:      {summary['steps_per_s']:.1f} steps/s "
            f"({summary['steps']} synchronous steps)"
        )
    print(f"wall time:       {wall:.2f} s (process start to exit)")
    print(f"result:          {'OK' if code == 0 else f'FAILED (exit code {code})'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
