"""``make demo``: parameter-server training with distributed autograd, 3 local processes.

What it trains: a 64 -> 128 -> 10 perceptron that reads handwritten digits
(scikit-learn's digits data set: 1,797 images of 8x8 pixels, ten classes; it
ships inside scikit-learn, nothing is downloaded), 80 % for training, 20 %
held out for the test accuracy.

How: ``examples/parameter_server.py --mode autograd`` through the launcher.
Rank 0 (``"ps"``) holds the model; two trainers each hold half of the training
set. A trainer's forward pass calls the server's model through an RRef, its
``dist_autograd.backward`` sends the gradients back into the server, and a
``DistributedOptimizer`` steps the server's parameters. Rank 0 draws one
progress bar fed by both trainers, prints loss and test accuracy per epoch,
and writes ``summary.json`` and ``training.png`` to ``--out-dir``.

    make demo                  # sets up .venv on first use, then runs this
    python examples/demo.py [--epochs 15] [--out-dir build/demo]

The exit code is the job's: non-zero when a worker failed or the model did
not reach 90 % test accuracy. Measured with ``python
benchmarks/bench_examples.py`` on a 2-core VM shared with other jobs (load
average 9): 15 epochs, test accuracy 0.975, 10.3 s from start to exit
(docs/benchmarks.md); the first ``make demo`` adds about 40 s of set-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from rpcdist import launch

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Parameter-server training with distributed autograd on the digits."
    )
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--out-dir", default=os.path.join("build", "demo"))
    args = p.parse_args(argv)

    print(
        "rpcdist demo: a 64-128-10 perceptron learns to read handwritten digits\n"
        "  data:    scikit-learn's digits (1,797 8x8 images, 10 classes; 80% train, 20% test)\n"
        f"  workers: 1 parameter server ('ps', holds the model) + {args.trainers} trainers,"
        " local processes\n"
        "  method:  trainers call the server's model through an RRef; one"
        " dist_autograd.backward;\n"
        "           a DistributedOptimizer steps the server's parameters\n",
        flush=True,
    )
    start = time.perf_counter()
    # The launcher starts the workers with RANK, WORLD_SIZE, MASTER_ADDR,
    # MASTER_PORT and a fresh job token in their environment, waits for them
    # and returns the job's exit code. --no-prefix: the progress bar redraws
    # its own line, so the output is passed through as it is.
    code = launch.main(
        [
            "--nproc-per-node",
            str(args.trainers + 1),
            "--no-prefix",
            os.path.join(HERE, "parameter_server.py"),
            "--mode",
            "autograd",
            "--epochs",
            str(args.epochs),
            "--out-dir",
            args.out_dir,
        ]
    )
    wall = time.perf_counter() - start
    print(f"\nwall time: {wall:.1f} s (process start to exit)")
    png = os.path.join(os.path.abspath(args.out_dir), "training.png")
    if code == 0:
        print(f"result: OK; open {png}" if os.path.exists(png) else "result: OK")
    else:
        print(f"result: FAILED (exit code {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
