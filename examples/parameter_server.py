"""Parameter-server training with rpcdist: one server, several trainers, batched updates.

Run it through the launcher (1 parameter server + 2 trainers)::

    python -m rpcdist.launch --nproc-per-node 3 examples/parameter_server.py --epochs 3

or on its own, which launches itself the same way (``--workers`` processes)::

    python examples/parameter_server.py

The job
-------
* Rank 0, named ``"ps"``, is the parameter server. It owns the model (a small
  :mod:`rpcdist.nn` MLP) and its optimizer, and is the only process that ever
  changes the weights.
* Ranks 1..N-1, named ``"trainer<rank>"``, each own a shard of a synthetic
  classification data set. They never keep weights of their own between steps.

One synchronous training step::

    trainer k                                   parameter server
    ---------                                   ----------------
    forward + backward on its batch
    with the current weights  -> gradients
    rpc_sync("ps", push_gradients, grads) ---->  @async_execution: queue the
                                                 gradients and a Future, return
                                                 the Future (no thread held)
         ... every trainer does the same ...
                                                 last trainer of the step:
                                                 average the gradients, one
                                                 optimizer step, complete all
    new weights  <------------------------------ the Futures with the new weights

The reply to ``push_gradients`` carries the updated weights, so a step costs a
trainer one round trip; ``get_params`` fetches them explicitly (used once, at
the start). This is the "batch-updating parameter server" pattern: the server
batches the calls of all trainers into one update, and ``@async_execution``
lets the early callers wait without occupying the server's thread pool.

How functions are found remotely
--------------------------------
rpcdist sends a function by its qualified name (``__main__:ParameterServer.
push_gradients`` here) and the callee imports it. Every process runs this same
script, so the name resolves to the same code everywhere. The server object
itself lives only in the rank-0 process; the static methods find it through
``ParameterServer.instance``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

import rpcdist
from rpcdist import nn, optim
from rpcdist import tensor as rt
from rpcdist.nn import functional as F

PS_NAME = "ps"
NUM_FEATURES = 20
NUM_CLASSES = 10
TRAIN_SIZE = 8000
TEST_SIZE = 2000

Params = dict[str, np.ndarray]  # name -> weights, as nn.Module.state_dict() returns


# ----------------------------------------------------------------------------- data


def make_dataset(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Gaussian blobs: 10 classes in 20 dimensions, learnable to about 98 % accuracy.

    Every process calls this with the same seed and gets the same arrays, so
    no data has to be sent around: a trainer just takes its own shard.

    Returns:
        ``x_train, y_train, x_test, y_test`` (float32 features, int64 labels).
    """
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 1.0, size=(NUM_CLASSES, NUM_FEATURES))
    n = TRAIN_SIZE + TEST_SIZE
    y = rng.integers(0, NUM_CLASSES, size=n)
    x = centers[y] + rng.normal(size=(n, NUM_FEATURES))
    x, y = x.astype(np.float32), y.astype(np.int64)
    return x[:TRAIN_SIZE], y[:TRAIN_SIZE], x[TRAIN_SIZE:], y[TRAIN_SIZE:]


def shard(x: np.ndarray, y: np.ndarray, index: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``index``-th of ``count`` equal, disjoint slices of the training set."""
    size = len(x) // count
    return x[index * size : (index + 1) * size], y[index * size : (index + 1) * size]


# ---------------------------------------------------------------------------- model


class Net(nn.Module):
    """A two-layer perceptron, 20 -> 64 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(NUM_FEATURES, 64)
        self.fc2 = nn.Linear(64, NUM_CLASSES)

    def forward(self, x: rt.Tensor) -> rt.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


# ------------------------------------------------------------------ parameter server


class ParameterServer:
    """The model, its optimizer and the gradients of the current step (rank 0 only).

    Args:
        num_trainers: Gradients to wait for before each update.
        steps_per_epoch: Updates per epoch (for the per-epoch report).
        epochs: Epochs to train; ``done`` is set after the last update.
        lr: Learning rate of SGD with momentum.
        test_set: Held-out ``(x, y)`` evaluated at the end of every epoch.
    """

    #: The one server of this process, found by the static RPC entry points.
    instance: ParameterServer | None = None

    def __init__(
        self,
        num_trainers: int,
        steps_per_epoch: int,
        epochs: int,
        lr: float,
        test_set: tuple[np.ndarray, np.ndarray],
    ) -> None:
        self.model = Net()
        self.names = [name for name, _ in self.model.named_parameters()]
        self.opt = optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.num_trainers = num_trainers
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = steps_per_epoch * epochs
        self.test_set = test_set
        self.version = 0  # updates applied so far
        self.lock = threading.Lock()  # handlers run concurrently in the pool
        self.pending: list[tuple[Params, rpcdist.Future[Any]]] = []
        self.epoch_stats = np.zeros(3)  # loss * samples, correct, samples
        self.history: list[dict[str, float]] = []
        self.started: float | None = None
        self.finished: float | None = None
        self.done = threading.Event()

    # -- RPC entry points: module-level (static) so that they can be sent by name.

    @staticmethod
    def get_params() -> tuple[int, Params]:
        """The current weights and their version (runs in the server's thread pool)."""
        server = ParameterServer.instance
        assert server is not None, "get_params() runs on the parameter server only"
        with server.lock:
            return server.version, server.model.state_dict()

    @staticmethod
    @rpcdist.functions.async_execution
    def push_gradients(
        version: int, grads: Params, loss: float, correct: int, count: int
    ) -> rpcdist.Future[tuple[int, Params]]:
        """Queue one trainer's gradients; the Future completes with the next weights.

        ``@async_execution``: rpcdist runs this, takes the returned Future and
        sends the reply when it completes. The thread is free meanwhile, so
        all trainers can wait here at once.
        """
        server = ParameterServer.instance
        assert server is not None, "push_gradients() runs on the parameter server only"
        return server.add_gradients(version, grads, loss, correct, count)

    # -- the batching itself.

    def add_gradients(
        self, version: int, grads: Params, loss: float, correct: int, count: int
    ) -> rpcdist.Future[tuple[int, Params]]:
        """Queue gradients; on the last trainer's, update and complete every Future."""
        fut: rpcdist.Future[tuple[int, Params]] = rpcdist.Future()
        with self.lock:
            if version != self.version:  # synchronous SGD: everyone is on one step
                fut.set_exception(
                    RuntimeError(f"gradients for version {version}, server is at {self.version}")
                )
                return fut
            if self.started is None:
                self.started = time.perf_counter()
            self.pending.append((grads, fut))
            self.epoch_stats += (loss * count, correct, count)
            if len(self.pending) < self.num_trainers:
                return fut  # not the last one: the reply waits for the update
            batch, self.pending = self.pending, []
            # Average the trainers' gradients and apply them in one step. The
            # optimizer takes explicit arrays aligned with its parameters.
            mean = [np.mean([g[name] for g, _ in batch], axis=0) for name in self.names]
            self.opt.step(grads=mean)
            self.version += 1
            reply = (self.version, self.model.state_dict())
            if self.version % self.steps_per_epoch == 0:
                self.end_epoch()
            if self.version == self.total_steps:
                self.finished = time.perf_counter()
                self.done.set()
        # Complete the Futures outside the lock: each completion sends a reply.
        for _, waiting in batch:
            waiting.set_result(reply)
        return fut

    def evaluate(self) -> float:
        """Accuracy of the current weights on the held-out test set."""
        x, y = self.test_set
        with rt.no_grad():
            logits = self.model(rt.tensor(x))
        return float((logits.data.argmax(axis=1) == y).mean())

    def end_epoch(self) -> None:
        """Report the epoch's training loss/accuracy and the test accuracy."""
        loss_sum, correct, count = self.epoch_stats
        self.epoch_stats[:] = 0
        stats = {
            "epoch": self.version // self.steps_per_epoch,
            "train_loss": loss_sum / count,
            "train_accuracy": correct / count,
            "test_accuracy": self.evaluate(),
        }
        self.history.append(stats)
        print(
            f"[ps] epoch {stats['epoch']}: train loss {stats['train_loss']:.4f}, "
            f"train accuracy {stats['train_accuracy']:.3f}, "
            f"test accuracy {stats['test_accuracy']:.3f}",
            flush=True,
        )


# -------------------------------------------------------------------------- workers


def run_trainer(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Train on this rank's shard: local forward/backward, gradients to the server."""
    x_train, y_train, _, _ = make_dataset(args.seed)
    x, y = shard(x_train, y_train, rank - 1, world_size - 1)
    steps_per_epoch = len(x) // args.batch_size
    rng = np.random.default_rng([args.seed, rank])  # this trainer's shuffling
    model = Net()  # its initial weights are replaced by the server's below
    version, params = rpcdist.rpc_sync(PS_NAME, ParameterServer.get_params)
    for _epoch in range(args.epochs):
        order = rng.permutation(len(x))
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            model.load_state_dict(params)
            logits = model(rt.tensor(x[idx]))
            loss = F.cross_entropy(logits, y[idx])
            model.zero_grad()
            loss.backward()
            grads = {name: p.grad.data for name, p in model.named_parameters()}
            correct = int((logits.data.argmax(axis=1) == y[idx]).sum())
            # Blocks until every trainer has sent this step's gradients and the
            # server has applied them; the reply is the next step's weights.
            version, params = rpcdist.rpc_sync(
                PS_NAME,
                ParameterServer.push_gradients,
                args=(version, grads, float(loss.item()), correct, len(idx)),
            )


def run_server(world_size: int, args: argparse.Namespace) -> ParameterServer:
    """Create the server (before ``init_rpc``, so it exists when trainers call) and serve."""
    rt.manual_seed(args.seed)  # the server's initial weights are the model's
    _, _, x_test, y_test = make_dataset(args.seed)
    trainers = world_size - 1
    steps_per_epoch = (TRAIN_SIZE // trainers) // args.batch_size
    server = ParameterServer(trainers, steps_per_epoch, args.epochs, args.lr, (x_test, y_test))
    ParameterServer.instance = server
    print(
        f"[ps] {trainers} trainers, {args.epochs} epochs x {steps_per_epoch} steps, "
        f"batch {args.batch_size} per trainer, lr {args.lr}",
        flush=True,
    )
    return server


def worker_main(args: argparse.Namespace) -> int:
    """One process of the job: rank and world size come from the launcher's environment."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size < 2:
        print("parameter_server.py needs at least 2 processes (1 server, 1 trainer)")
        return 2
    start = time.perf_counter()
    server = run_server(world_size, args) if rank == 0 else None
    # env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and the job
    # token all come from the launcher, so a name is all init_rpc needs.
    rpcdist.init_rpc(PS_NAME if rank == 0 else f"trainer{rank}")
    if server is None:
        run_trainer(rank, world_size, args)
    else:
        server.done.wait()  # until the last update (trainers' calls drive it)
    rpcdist.shutdown()  # collective: returns once every worker is done
    if server is None:
        return 0
    return report(server, time.perf_counter() - start, args)


def report(server: ParameterServer, wall: float, args: argparse.Namespace) -> int:
    """Print the summary; non-zero when the model did not learn."""
    accuracy = server.evaluate()
    assert server.started is not None and server.finished is not None
    seconds = server.finished - server.started
    steps_per_s = server.total_steps / seconds
    print(
        f"[ps] final test accuracy {accuracy:.4f}; {server.total_steps} steps in "
        f"{seconds:.2f} s = {steps_per_s:.1f} steps/s "
        f"({steps_per_s * server.num_trainers * args.batch_size:.0f} samples/s); "
        f"wall {wall:.2f} s",
        flush=True,
    )
    if args.summary_json:
        summary = {
            "test_accuracy": accuracy,
            "steps": server.total_steps,
            "train_seconds": seconds,
            "steps_per_s": steps_per_s,
            "wall_seconds": wall,
            "trainers": server.num_trainers,
            "epochs": server.history,
        }
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    if accuracy < args.min_accuracy:
        print(f"[ps] FAILED: accuracy {accuracy:.4f} is below {args.min_accuracy}", flush=True)
        return 1
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per trainer and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this")
    p.add_argument("--summary-json", help="also write the results to this file (rank 0)")
    p.add_argument(
        "--workers", type=int, default=3, help="processes when run standalone (1 ps + trainers)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        # Started by hand: become the launcher of a local job running this script.
        from rpcdist import launch

        return launch.main(["--nproc-per-node", str(args.workers), __file__, *argv])
    return worker_main(args)


if __name__ == "__main__":
    sys.exit(main())
