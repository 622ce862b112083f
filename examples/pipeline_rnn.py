"""A pipeline-parallel character-level language model over RRefs (GPipe schedule).

Run it through the launcher (4 processes, one per stage)::

    python -m rpcdist.launch --nproc-per-node 4 examples/pipeline_rnn.py

or on its own, which launches itself the same way::

    python examples/pipeline_rnn.py [--steps 150] [--micro-batches 4]

The text is the source code of a few modules of Python's own standard library
(``argparse``, ``textwrap``, ``string``, ...), read from this interpreter's
installation: every machine with Python has it. 90 % is for training, the
last 10 % for the validation perplexity.

The model is split into S = 4 stages, one per worker::

    rank 0 "embed"    Embedding(vocab, 32)   + the driver: data, loss, schedule
    rank 1 "lstm1"    LSTM(32, 128)
    rank 2 "lstm2"    LSTM(128, 128)
    rank 3 "decoder"  Linear(128, vocab)

Each stage is a :class:`Stage` object made on its worker with
``rpcdist.remote`` and driven through its RRef. A batch is cut into M
micro-batches; for each, the driver chains the stages without waiting::

    r0 = stages[0].remote().forward(x)    # an RRef to the embedding's output
    r1 = stages[1].remote().forward(r0)   # lstm1 fetches r0 itself (to_here)
    r2 = stages[2].remote().forward(r1)
    f3 = stages[3].rpc_async().forward(r2)   # a Future of the logits

All M chains are issued at once, so while ``lstm2`` works on micro-batch 1,
``lstm1`` already works on micro-batch 2 (each stage takes one micro-batch at
a time, in the order they arrive). When all logits are back, the driver sums
the M losses and calls ``dist_autograd.backward`` once: gradients flow back
through every stage, again micro-batch by micro-batch, and a
``DistributedOptimizer`` (Adam) updates every stage's parameters where they
live. That is the GPipe schedule: all forwards, then all backwards.

Each stage times its own forward and backward work (the backward through two
identity functions around its module that note the time when the gradient
passes). The driver prints the measured bubble, ``1 - (mean busy time of a
stage) / (time of the forward and backward)``, beside the theoretical
``(S-1)/(M+S-1)`` of equal stages on their own cores, and at the end a sample
of generated text.

Measured with ``python benchmarks/bench_examples.py`` (2-core VM shared with
other jobs, load average 8; defaults: 150 steps, batch 32 x 48 characters,
M = 4): 45 s from start to exit, validation perplexity 7.1 (94 before
training), measured bubble 0.70 against 0.43 theoretical. With 40 steps and
M = 1, 2, 4, 8 the measured bubble was 0.77, 0.74, 0.71, 0.67 against 0.75,
0.60, 0.43, 0.27: right where a stage cannot overlap (M = 1), and falling
with M, but far above theory because the 4 processes share 2 cores and a
stage's work per micro-batch is a few milliseconds, so RPC latency and the
cores' time-sharing count as idle time too. See docs/benchmarks.md.
"""

from __future__ import annotations

import os

# One BLAS thread per process: 4 processes share the cores.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import importlib.util
import math
import sys
import threading
import time
from typing import Any

import numpy as np

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist import nn, optim
from rpcdist import tensor as rt
from rpcdist.nn import functional as F

NAMES = ("embed", "lstm1", "lstm2", "decoder")
MODULES = ("argparse", "textwrap", "string", "functools", "shlex", "fnmatch", "glob")
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # the vocabulary; others become "?"
EMB, HIDDEN = 32, 256


def load_text(limit: int) -> np.ndarray:
    """Python's own source of ``MODULES``, as character ids (at most ``limit``)."""
    parts = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            with open(spec.origin, encoding="utf-8") as f:
                parts.append(f.read())
    text = "\n".join(parts)[:limit]
    table = {c: i for i, c in enumerate(CHARS)}
    unknown = table["?"]
    return np.array([table.get(c, unknown) for c in text], dtype=np.int64)


# ------------------------------------------------------------------------- stages


class Mark(rt.Function):
    """Identity whose backward notes the time (a stage's backward starts or ends)."""

    def forward(self, x: Any, *, log: list[tuple[str, int, float]], kind: str, key: int) -> Any:
        self.log, self.kind, self.key = log, kind, key
        return x

    def backward(self, g: Any) -> tuple[Any]:
        self.log.append((self.kind, self.key, time.perf_counter()))
        return (g,)


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class Stage:
    """One stage of the model on its worker: forwards one micro-batch at a time.

    Args:
        kind: ``"embed"``, ``"lstm"`` or ``"decoder"``.
        sizes: The module's constructor arguments.
        seed: Seed of the module's initial weights.
    """

    def __init__(self, kind: str, sizes: tuple[int, ...], seed: int) -> None:
        rt.manual_seed(seed)
        self.kind = kind
        self.module: nn.Module = {"embed": nn.Embedding, "lstm": nn.LSTM, "decoder": nn.Linear}[
            kind
        ](*sizes)
        self.lock = threading.Lock()  # a stage is one device: one micro-batch at a time
        self.forward_spans: list[tuple[float, float]] = []
        self.marks: list[tuple[str, int, float]] = []
        self.calls = 0

    def parameter_rrefs(self) -> list[rpcdist.RRef[Any]]:
        return [rpcdist.RRef(p) for p in self.module.parameters()]

    def _run(self, x: Any) -> Any:
        if self.kind == "lstm":
            return self.module(x)[0]
        if self.kind == "decoder":
            steps, batch, hidden = x.shape
            return self.module(x.reshape(steps * batch, hidden))
        return self.module(x)

    def forward(self, x: Any, train: bool = True) -> Any:
        """The stage's output for ``x`` (an RRef to the previous output, or token ids)."""
        if isinstance(x, rpcdist.RRef):
            x = x.to_here()  # waits until the previous stage has this micro-batch
        with self.lock:
            start = time.perf_counter()
            if not train:
                with rt.no_grad():
                    out = self._run(x)
            else:
                self.calls += 1
                key = self.calls
                if isinstance(x, rt.Tensor) and x.requires_grad:
                    x = Mark.call(x, log=self.marks, kind="end", key=key)
                out = Mark.call(self._run(x), log=self.marks, kind="start", key=key)
            self.forward_spans.append((start, time.perf_counter()))
        return out

    def step(self, x: Any, state: Any) -> tuple[Any, Any]:
        """One generation step (no autograd); the LSTM carries ``state``."""
        with rt.no_grad():
            if self.kind == "lstm":
                return self.module(x, state)
            return self._run(x), None

    def busy(self) -> float:
        """Seconds of forward and backward work since the last call (then reset)."""
        with self.lock:
            starts = {k: t for kind, k, t in self.marks if kind == "start"}
            ends = {k: t for kind, k, t in self.marks if kind == "end"}
            spans = self.forward_spans + [(starts[k], ends[k]) for k in starts if k in ends]
            if self.kind == "embed" or not ends:  # no gradient enters: backward not timed
                spans = self.forward_spans
            self.forward_spans, self.marks = [], []
        return _union(spans)


# ------------------------------------------------------------------------- driver


def pipeline_forward(
    stages: list[rpcdist.RRef[Stage]], chunks: list[np.ndarray], train: bool
) -> list[Any]:
    """Issue every micro-batch's chain of stages at once; the logits of each."""
    futures = []
    for x in chunks:
        ref = stages[0].remote().forward(x, train)
        for stage in stages[1:-1]:
            ref = stage.remote().forward(ref, train)
        futures.append(stages[-1].rpc_async().forward(ref, train))
    return rpcdist.futures.wait_all(futures)


def batch(
    ids: np.ndarray, rng: np.random.Generator, size: int, steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """``size`` random windows: inputs and next-character targets, time-major (T, B)."""
    starts = rng.integers(0, len(ids) - steps - 1, size)
    windows = np.stack([ids[s : s + steps + 1] for s in starts], axis=1)
    return windows[:-1], windows[1:]


def perplexity(
    stages: list[rpcdist.RRef[Stage]], ids: np.ndarray, args: argparse.Namespace
) -> float:
    """exp(mean cross entropy) on ``ids`` (fixed windows, no autograd)."""
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(4):
        x, y = batch(ids, rng, args.batch_size, args.seq_len)
        chunks = np.array_split(x, args.micro_batches, axis=1)
        targets = np.array_split(y, args.micro_batches, axis=1)
        for logits, t in zip(pipeline_forward(stages, chunks, False), targets):
            losses.append(float(F.cross_entropy(logits, t.reshape(-1)).item()))
    return math.exp(float(np.mean(losses)))


def generate(stages: list[rpcdist.RRef[Stage]], prompt: str, length: int, seed: int) -> str:
    """Sample ``length`` characters after ``prompt``, one at a time through the stages."""
    rng = np.random.default_rng(seed)
    table = {c: i for i, c in enumerate(CHARS)}
    states: list[Any] = [None] * len(stages)
    out = list(prompt)
    ids = [table.get(c, table["?"]) for c in prompt]
    for i in range(len(prompt) + length - 1):
        x: Any = np.array([[ids[min(i, len(ids) - 1)]]])  # (T=1, B=1)
        for s, stage in enumerate(stages):
            x, states[s] = stage.rpc_sync().step(x, states[s])
        if i + 1 < len(ids):
            continue  # still feeding the prompt
        logits = x.data[0].astype(np.float64) / 0.7  # temperature 0.7
        p = np.exp(logits - logits.max())
        nxt = int(rng.choice(len(CHARS), p=p / p.sum()))
        ids.append(nxt)
        out.append(CHARS[nxt])
    return "".join(out)


def train(args: argparse.Namespace) -> int:
    ids = load_text(args.text_chars)
    split = int(len(ids) * 0.9)
    train_ids, val_ids = ids[:split], ids[split:]
    vocab = len(CHARS)
    layout = [
        ("embed", (vocab, EMB)),
        ("lstm", (EMB, HIDDEN)),
        ("lstm", (HIDDEN, HIDDEN)),
        ("decoder", (HIDDEN, vocab)),
    ]
    stages = [
        rpcdist.remote(NAMES[i], Stage, args=(kind, sizes, args.seed + i))
        for i, (kind, sizes) in enumerate(layout)
    ]
    params = [p for s in stages for p in s.rpc_sync().parameter_rrefs()]
    opt = optim.DistributedOptimizer(optim.Adam, params, lr=args.lr)
    S, M = len(stages), args.micro_batches
    print(f"text: {len(ids):,} characters of Python's standard library ({', '.join(MODULES)})")
    print(
        f"stages: {' -> '.join(NAMES)} (S={S}); batch {args.batch_size} x {args.seq_len} "
        f"characters in M={M} micro-batches; {args.steps} steps",
        flush=True,
    )
    print(f"step 0: validation perplexity {perplexity(stages, val_ids, args):.2f}", flush=True)
    rng = np.random.default_rng(args.seed)
    bubbles, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = batch(train_ids, rng, args.batch_size, args.seq_len)
        chunks = np.array_split(x, M, axis=1)
        targets = np.array_split(y, M, axis=1)
        for s in stages:  # start the step's timing afresh on every stage
            s.rpc_sync().busy()
        with dist_autograd.context() as cid:
            t0 = time.perf_counter()
            logits = pipeline_forward(stages, chunks, True)
            loss = (
                sum(
                    (F.cross_entropy(lg, t.reshape(-1)) for lg, t in zip(logits, targets)),
                    start=rt.tensor(0.0),
                )
                / M
            )
            dist_autograd.backward(cid, [loss])
            elapsed = time.perf_counter() - t0
            opt.clip_grad_norm_(cid, 1.0)
            opt.step(cid)
        busy = [s.rpc_sync().busy() for s in stages]
        bubbles.append(1.0 - float(np.mean(busy)) / elapsed)
        if step % args.log_every == 0 or step == args.steps:
            print(
                f"step {step}: training loss {loss.item():.3f}, "
                f"{time.perf_counter() - start:.1f} s",
                flush=True,
            )
    ppl = perplexity(stages, val_ids, args)
    measured = float(np.median(bubbles[len(bubbles) // 5 :]))  # past the warm-up
    theory = (S - 1) / (M + S - 1)
    print(f"validation perplexity {ppl:.2f}")
    print(
        f"pipeline bubble: measured {measured:.2f} (median over steps), "
        f"theoretical (S-1)/(M+S-1) = {S - 1}/{M + S - 1} = {theory:.2f}"
    )
    print("generated text (temperature 0.7):")
    print("-" * 60)
    print(generate(stages, "def ", args.sample_chars, args.seed))
    print("-" * 60, flush=True)
    if ppl > args.max_perplexity:
        print(f"FAILED: perplexity {ppl:.2f} is above {args.max_perplexity}")
        return 1
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Pipeline-parallel character LSTM on Python's stdlib source (4 stages).",
        epilog="Run: python -m rpcdist.launch --nproc-per-node 4 examples/pipeline_rnn.py",
    )
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--micro-batches", type=int, default=4, help="M")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=48, help="characters per sequence")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--text-chars", type=int, default=400_000)
    p.add_argument("--sample-chars", type=int, default=200)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-perplexity", type=float, default=30.0, help="exit 1 above this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        from rpcdist import launch

        return launch.main(["--nproc-per-node", str(len(NAMES)), __file__, *argv])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != len(NAMES):
        print(f"pipeline_rnn.py runs on {len(NAMES)} processes, one per stage")
        return 2
    rpcdist.init_rpc(NAMES[rank])
    # A stage has nothing to do but serve: its shutdown() keeps serving the
    # driver's calls until the driver shuts down too.
    code = train(args) if rank == 0 else 0
    rpcdist.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
