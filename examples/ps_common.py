"""What the parameter-server examples share: the digits data, the model, the scoreboard.

Imported by ``parameter_server.py`` (and so by ``make demo``). Every worker
process runs a script from this folder, so Python finds this module on every
worker and functions defined here can be sent by name (``ps_common:progress``).

* :func:`load_digits` -- scikit-learn's handwritten digits (1,797 images of
  8x8 pixels, 10 classes). The data ships inside scikit-learn: nothing is
  downloaded. Every process loads and splits it the same way, so trainers only
  take their own shard and no data crosses the network.
* :class:`Net` -- a two-layer perceptron, 64 -> 128 -> 10.
* :class:`Scoreboard` -- lives on rank 0. Trainers report to it over RPC
  (:func:`progress` after every step, :func:`end_epoch` after each epoch); it
  moves one progress bar for all trainers, evaluates the model at the end of
  each epoch, prints a table row, and at the end writes a JSON summary and a
  PNG plot (optional extras: ``pip install rpcdist[examples]``; without them
  the bar becomes plain lines and the plot is skipped, saying so).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from rpcdist import nn
from rpcdist import tensor as rt
from rpcdist.nn import functional as F

NUM_FEATURES, HIDDEN, NUM_CLASSES = 64, 128, 10
TEST_FRACTION = 0.2
DATASET = "scikit-learn's handwritten digits (1,797 8x8 images, 10 classes; ships offline)"


def load_digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits, scaled to [0, 1], split 80/20 into train and test (same on every process).

    Returns:
        ``x_train, y_train, x_test, y_test`` (float32 features, int64 labels).
    """
    pixels, labels = _digits_table()
    x = (pixels / 16.0).astype(np.float32)
    y = labels.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    test = int(len(x) * TEST_FRACTION)
    return x[order[test:]], y[order[test:]], x[order[:test]], y[order[:test]]


def _digits_table() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: pixels (0-16) and labels.

    Read from the file scikit-learn ships (what its ``load_digits`` reads)
    without importing scikit-learn, which takes 1.5 s of CPU in each process
    of each example; through ``load_digits`` where the file is not found.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        sys.exit("this example needs scikit-learn: pip install 'rpcdist[examples]' (or: make demo)")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if os.path.isfile(path):
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1], table[:, -1]
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    return data.data, data.target


def shard(x: np.ndarray, y: np.ndarray, index: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``index``-th of ``count`` equal, disjoint slices of ``(x, y)``."""
    size = len(x) // count
    return x[index * size : (index + 1) * size], y[index * size : (index + 1) * size]


class Net(nn.Module):
    """A two-layer perceptron for the digits, 64 -> 128 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(NUM_FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, NUM_CLASSES)

    def forward(self, x: rt.Tensor) -> rt.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """The share of ``x`` that ``model`` labels correctly."""
    with rt.no_grad():
        logits = model(rt.tensor(x))
    return float((logits.data.argmax(axis=1) == y).mean())


# ----------------------------------------------------------------- the scoreboard


def _progress_bar(total: int, title: str) -> Any:
    """A tqdm bar on a terminal; elsewhere (a log, a pipe) or without tqdm,
    ``None``: a plain line at every tenth of the way."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"{title}: {total} steps (pip install tqdm for a progress bar)", flush=True)
        return None
    if not sys.stderr.isatty():
        print(f"{title}: {total} steps", flush=True)
        return None
    return tqdm(total=total, desc=title, unit="step", dynamic_ncols=True)


class Scoreboard:
    """Progress, per-epoch results and the final files, on rank 0.

    Args:
        trainers: Trainers that report (their ranks, or how many: ranks 1..N).
        epochs: Epochs each trainer runs.
        steps_per_epoch: Steps of one trainer in one epoch.
        evaluate: Returns the current test accuracy (called once per epoch).
        title: Label of the progress bar.
    """

    #: The scoreboard of this process (rank 0), found by the RPC entry points.
    instance: Scoreboard | None = None

    def __init__(
        self,
        trainers: int | list[int],
        epochs: int,
        steps_per_epoch: int,
        evaluate: Callable[[], float],
        title: str,
    ) -> None:
        ranks = list(range(1, trainers + 1)) if isinstance(trainers, int) else list(trainers)
        self.live, self.epochs, self.evaluate = set(ranks), epochs, evaluate
        #: The first epoch each trainer that came back reports (a rejoined one).
        self.first: dict[int, int] = {}
        self.lock = threading.Lock()
        self.pending: dict[int, dict[int, tuple[float, int, int]]] = {}
        self.history: list[dict[str, Any]] = []
        self.done = threading.Event()
        total = len(ranks) * epochs * steps_per_epoch
        self.total, self.steps, self.title = total, 0, title
        self.bar: Any = _progress_bar(total, title)

    def write(self, line: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def advance(self, steps: int, loss: float) -> None:
        """Move the bar by ``steps`` (without a bar: a line at every tenth of the way)."""
        with self.lock:
            before, self.steps = self.steps, self.steps + steps
            if self.bar is not None:
                self.bar.update(steps)
                self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            elif self.steps * 10 // self.total > before * 10 // self.total:
                print(f"{self.title}: {self.steps}/{self.total} steps, loss {loss:.3f}", flush=True)

    def finish_epoch(
        self, epoch: int, loss_sum: float, correct: int, count: int, rank: int = 1
    ) -> None:
        """Trainer ``rank``'s epoch totals; the last live trainer's closes the epoch."""
        with self.lock:
            self.pending.setdefault(epoch, {})[rank] = (loss_sum, correct, count)
            closed = self._closed_epochs()
        for e, parts in closed:
            self._close(e, parts)

    def drop(self, rank: int) -> None:
        """Trainer ``rank`` is gone: epochs close without it (its reported epochs count)."""
        with self.lock:
            self.live.discard(rank)
            closed = self._closed_epochs()
            if not self.live and not closed:  # nobody left to close an epoch
                self.done.set()
        for e, parts in closed:
            self._close(e, parts)

    def rejoin(self, rank: int) -> int:
        """Trainer ``rank`` is back (restarted): the epoch it starts from, the
        one after the last any trainer reported (0: training is over)."""
        with self.lock:
            if self.done.is_set():
                return 0
            reported = [e for e, parts in self.pending.items() if parts]
            reported += [int(r["epoch"]) for r in self.history]
            first = max(reported, default=0) + 1
            if first > self.epochs:
                return 0
            self.first[rank] = first
            self.live.add(rank)
            return first

    def _closed_epochs(self) -> list[tuple[int, dict[int, tuple[float, int, int]]]]:
        out = []
        for e in sorted(self.pending):
            due = {r for r in self.live if self.first.get(r, 1) <= e}
            if self.pending[e] and due <= set(self.pending[e]):
                out.append((e, self.pending.pop(e)))
        return out

    def _close(self, epoch: int, reports: dict[int, tuple[float, int, int]]) -> None:
        parts = list(reports.values())
        loss_sum, correct, count = (sum(p[i] for p in parts) for i in range(3))
        row: dict[str, Any] = {
            "epoch": epoch,
            "trainers": sorted(reports),
            "train_loss": loss_sum / count,
            "train_accuracy": correct / count,
            "test_accuracy": self.evaluate(),
        }
        with self.lock:
            if not self.history:
                self.write(f"{'epoch':>5}  {'train loss':>10}  {'train acc':>9}  {'test acc':>8}")
            self.history.append(row)
            self.history.sort(key=lambda r: r["epoch"])
            self.write(
                f"{epoch:>5}  {row['train_loss']:>10.4f}  {row['train_accuracy']:>9.3f}  "
                f"{row['test_accuracy']:>8.3f}"
            )
            if len(self.history) == self.epochs:
                if self.bar is not None:
                    self.bar.close()
                self.done.set()

    def save(self, out_dir: str, summary: dict[str, Any]) -> list[str]:
        """Write ``summary.json`` and ``training.png`` (if matplotlib is there); their paths."""
        os.makedirs(out_dir, exist_ok=True)
        summary = {**summary, "epochs": self.history}
        path = os.path.join(out_dir, "summary.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
        written = [path]
        png = plot(self.history, os.path.join(out_dir, "training.png"), summary.get("title", ""))
        if png:
            written.append(png)
        return written


def plot(history: list[dict[str, Any]], path: str, title: str) -> str | None:
    """Loss and test accuracy per epoch as a PNG (headless); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(plot skipped: pip install matplotlib, or 'rpcdist[examples]')", flush=True)
        return None
    epochs = [r["epoch"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(epochs, [r["train_loss"] for r in history], marker="o")
    ax1.set(xlabel="epoch", ylabel="training loss", title="loss")
    ax2.plot(epochs, [r["test_accuracy"] for r in history], marker="o", color="tab:green")
    ax2.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy", ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----------------------------------------------- RPC entry points (run on rank 0)


def progress(steps: int, loss: float) -> None:
    """A trainer did ``steps`` more steps; ``loss`` is its latest batch loss."""
    board = Scoreboard.instance
    assert board is not None, "progress() runs on rank 0 only"
    board.advance(steps, loss)


def end_epoch(epoch: int, loss_sum: float, correct: int, count: int, rank: int = 1) -> None:
    """Trainer ``rank`` finished ``epoch`` with these totals (summed over its batches)."""
    board = Scoreboard.instance
    assert board is not None, "end_epoch() runs on rank 0 only"
    board.finish_epoch(epoch, loss_sum, correct, count, rank)
