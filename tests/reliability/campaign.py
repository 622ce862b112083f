"""A fault campaign: random faults injected from outside into small jobs.

Each trial starts a job of three processes (ranks from the environment, as
the launcher sets them) running one of :data:`KINDS` of work in a loop, all
ranks taking part. Once every rank is mid-work (each writes a marker after
a few iterations), the campaign injects one of :data:`FAULTS` into a random
rank other than the observer (rank 0):

* ``SIGKILL``: the process dies; its sockets close.
* ``SIGSTOP``: the process stops, sockets open, nothing more from it.
* ``linkdrop``: the process keeps running but every message it sends is
  dropped from then on (the campaign sends it SIGUSR1, which turns on a
  drop-everything rule of its ``RpcOptions.faults`` injector): to the
  others its links go silent, as in a partition, while its sockets stay up.
  (Only these jobs run with an injector: it keeps calls off the
  thread-driven fast path, which the other faults should meet.)

Each survivor records when its work raised (wall clock, to compare with the
moment of the fault) and what; a survivor that has not reported within
``cap`` seconds of the fault (:data:`CAP` by default) is a **hang**, even if
some timeout of its own would end it later; then every process is killed.
An error that is not an ``rpcdist.RpcdistError`` is **untyped**. Nothing is
hidden: a trial the job itself failed (before the fault) is counted too.

``run(n, seed)`` runs ``n`` trials and returns them; ``summarize`` turns them
into counts and detection-time distributions.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import rpcdist

KINDS = ("rpc", "rref", "autograd", "ddp", "fsdp")
FAULTS = ("SIGKILL", "SIGSTOP", "linkdrop")
WORLD = 3
OBSERVER = 0
#: Seconds a survivor has after the fault before it counts as hung (the
#: detector's default verdict comes after 3-4 s).
CAP = 10.0
#: Seconds a job may take to be mid-work, and its own hard limit.
START = 30.0
LIMIT = 120.0
#: Iterations every rank completes before it says it is mid-work.
WARM = 3


# ------------------------------------------------------- remote functions


def add(a: Any, b: Any) -> Any:
    return a + b


def ones(n: int) -> np.ndarray:
    return np.ones(n)


def scale(x: Any) -> Any:
    return x * 2.0


# ------------------------------------------------------------- the workers


def _mlp(seed: int) -> Any:
    import rpcdist.tensor as rt
    from rpcdist import nn

    g = rt.Generator().manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16, generator=g), nn.Tanh(), nn.Linear(16, 3, generator=g))


def _step_fn(kind: str, rank: int) -> Any:
    """One iteration of ``kind`` on ``rank`` (after init_rpc)."""
    peers = [r for r in range(WORLD) if r != rank]
    if kind == "rpc":

        def step(i: int) -> None:
            assert rpcdist.rpc_sync(peers[i % 2], add, args=(i, 1), timeout=None) == i + 1

    elif kind == "rref":

        def step(i: int) -> None:
            rref = rpcdist.remote(peers[i % 2], ones, args=(8,), timeout=None)
            assert rref.to_here(timeout=None).sum() == 8
            assert rref.rpc_sync(timeout=None).sum() == 8

    elif kind == "autograd":
        import rpcdist.autograd as dist_autograd
        from rpcdist.tensor import Tensor

        x = Tensor(np.ones(4), requires_grad=True)

        def step(i: int) -> None:
            with dist_autograd.context() as cid:
                y = rpcdist.rpc_sync(peers[i % 2], scale, args=(x,), timeout=None)
                dist_autograd.backward(cid, [y.sum()])

    else:
        import rpcdist.tensor as rt
        from rpcdist import collectives as dist
        from rpcdist import optim
        from rpcdist.nn import functional as F
        from rpcdist.parallel import DistributedDataParallel, FullyShardedDataParallel

        dist.init_process_group(timeout=LIMIT)  # (no end of its own before the cap)
        wrap = DistributedDataParallel if kind == "ddp" else FullyShardedDataParallel
        model = wrap(_mlp(rank + 1))
        opt = optim.SGD(list(model.parameters()), lr=0.01)
        rng = np.random.default_rng(rank)

        def step(i: int) -> None:
            opt.zero_grad()
            x = rt.tensor(rng.standard_normal((4, 6)).astype(np.float32))
            y = rt.tensor(rng.integers(0, 3, 4))
            F.cross_entropy(model(x), y).backward()
            opt.step()

    return step


def job(rank: int, world_size: int, init: str, kind: str, fault: str, marks: str) -> dict[str, Any]:
    """One rank of a trial: work until the work raises (or :data:`LIMIT`
    seconds pass), then report (and write a ``done`` marker)."""
    from rpcdist.testing import FaultInjector

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    faults = None
    if fault == "linkdrop":  # (only then: an injector keeps calls off the fast paths)
        injector = faults = FaultInjector()
        # SIGUSR1: every message this rank sends is dropped from now on. (A
        # thread adds the rule: the handler may interrupt one holding its lock.)
        signal.signal(
            signal.SIGUSR1,
            lambda *_: threading.Thread(
                target=injector.add, args=("*", "drop"), kwargs={"times": None}
            ).start(),
        )
    Path(marks, f"pid{rank}").write_text(str(os.getpid()))
    opts = rpcdist.RpcOptions(faults=faults, shutdown_timeout=5)
    rpcdist.init_rpc(f"w{rank}", init_method=init, rpc_timeout=None, options=opts)
    out: dict[str, Any] = {"iters": 0}
    try:
        step = _step_fn(kind, rank)
        end = time.monotonic() + LIMIT
        i = 0
        while time.monotonic() < end:
            step(i)
            i += 1
            out["iters"] = i
            if i == WARM:
                Path(marks, f"busy{rank}").write_text("")
        out["outcome"] = "completed"
    except rpcdist.RpcdistError as e:
        out.update(outcome="error", error=type(e).__name__, message=str(e)[:300])
    except Exception as e:
        out.update(outcome="error", error=type(e).__name__, message=str(e)[:300], untyped=True)
    out["at"] = time.time()
    Path(marks, f"done{rank}").write_text("")
    try:
        rpcdist.shutdown(graceful=False)
    except Exception:
        pass
    return out


# ----------------------------------------------------------- the campaign


@dataclass
class Trial:
    kind: str
    fault: str
    victim: int
    injected: bool = False
    #: Per survivor: ``(outcome, error type, seconds from the fault)``.
    survivors: dict[int, tuple[str, str, float]] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)
    untyped: list[int] = field(default_factory=list)
    failed: str = ""
    seconds: float = 0.0


def _wait_for(path: Path, names: list[str], until: float) -> bool:
    while time.monotonic() < until:
        if all((path / n).exists() for n in names):
            return True
        time.sleep(0.005)  # (the campaign's own polling; the job never waits on it)
    return False


def _kill_all(marks: Path) -> None:
    for r in range(WORLD):
        try:
            os.kill(int((marks / f"pid{r}").read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # (never started, or gone)


def trial(kind: str, fault: str, victim: int, cap: float = CAP) -> Trial:
    """One job of :data:`WORLD` ranks doing ``kind``; ``fault`` hits ``victim``."""
    import harness

    t = Trial(kind, fault, victim)
    started = time.monotonic()
    survivors = sorted(set(range(WORLD)) - {victim})
    with tempfile.TemporaryDirectory(prefix="rpcdist-camp-") as tmp:
        marks = Path(tmp)
        box: dict[str, Any] = {}

        def run() -> None:
            box["res"] = harness.run_job(
                job, WORLD, (kind, fault, tmp), timeout=LIMIT, expect=set(survivors)
            )

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        fault_at = 0.0
        ready = [f"busy{r}" for r in range(WORLD)] + [f"pid{r}" for r in range(WORLD)]
        try:
            if _wait_for(marks, ready, started + START):
                pid = int((marks / f"pid{victim}").read_text())
                sig = {"SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP}.get(
                    fault, signal.SIGUSR1
                )
                fault_at = time.time()
                os.kill(pid, sig)
                t.injected = True
                done = [f"done{r}" for r in survivors]
                if not _wait_for(marks, done, time.monotonic() + cap):
                    t.hung = [r for r in survivors if not (marks / f"done{r}").exists()]
        finally:
            if t.hung or not t.injected:
                _kill_all(marks)
            runner.join()
    res = box["res"]
    t.hung = sorted(set(t.hung) | set(res.hung))
    for r in survivors:
        v = res.values.get(r)
        if v is None:
            if r not in t.hung:
                t.failed += f"rank {r}: {res.errors.get(r, 'no report')[:300]} "
            continue
        took = v["at"] - fault_at if t.injected else float("nan")
        t.survivors[r] = (v["outcome"], v.get("error", ""), took)
        if v.get("untyped"):
            t.untyped.append(r)
    if not t.injected:
        t.failed += "never mid-work: no fault injected"
    t.seconds = time.monotonic() - started
    return t


def plan(n: int, seed: int) -> list[tuple[str, str, int]]:
    """``n`` trials, seeded: kinds and faults in turn (so that every pair
    comes up), victims at random among the ranks other than the observer."""
    rnd = random.Random(seed)
    pairs = [(k, f) for f in FAULTS for k in KINDS]
    rnd.shuffle(pairs)
    victims = [r for r in range(WORLD) if r != OBSERVER]
    return [(*pairs[i % len(pairs)], rnd.choice(victims)) for i in range(n)]


def run(n: int, seed: int = 38, log: Any = None, cap: float = CAP) -> list[Trial]:
    """Run the campaign's ``n`` trials one after another."""
    out = []
    for i, (kind, fault, victim) in enumerate(plan(n, seed)):
        t = trial(kind, fault, victim, cap)
        out.append(t)
        if log is not None:
            log(
                f"trial {i + 1}/{n} {kind} {fault} -> rank {victim}: {t.survivors} "
                f"hung={t.hung} {t.failed} ({t.seconds:.1f} s)"
            )
    return out


def summarize(trials: list[Trial]) -> dict[str, Any]:
    """Counts per job kind, and detection times per fault kind (seconds)."""
    kinds: dict[str, dict[str, int]] = {}
    times: dict[str, list[float]] = {f: [] for f in FAULTS}
    for t in trials:
        k = kinds.setdefault(
            t.kind, {"trials": 0, "hangs": 0, "untyped": 0, "failed": 0, "completed": 0}
        )
        k["trials"] += 1
        k["hangs"] += bool(t.hung)
        k["untyped"] += bool(t.untyped)
        k["failed"] += bool(t.failed)
        for outcome, _, took in t.survivors.values():
            if outcome == "completed":
                k["completed"] += 1
            elif took == took:
                times[t.fault].append(took)
    return {"kinds": kinds, "times": times}
