"""Parameter-server training on scikit-learn's digits, in three modes.

Run it through the launcher (1 parameter server + 2 trainers)::

    python -m rpcdist.launch --nproc-per-node 3 --no-prefix examples/parameter_server.py --mode autograd

or on its own, which launches itself the same way (``--workers`` processes)::

    python examples/parameter_server.py --mode sync

Rank 0, named ``"ps"``, owns the model (:class:`ps_common.Net`, 64 -> 128 ->
10) and is the only process whose copy of the weights matters. Ranks 1..N-1,
``"trainer<rank>"``, each take an equal shard of the training set (the digits
ship inside scikit-learn; every process loads them itself) and report their
progress to rank 0, which draws one progress bar, prints a row per epoch and
writes ``summary.json`` and ``training.png`` to ``--out-dir``.

The modes differ in who computes gradients and when the server applies them:

``--mode sync`` (batch-updating server, ``@async_execution``)
    A trainer computes gradients locally on the current weights and calls
    ``push_gradients``. That function is decorated with
    ``@rpcdist.functions.async_execution``: it queues the gradients with a
    fresh ``rpcdist.Future`` and returns the Future, so the server's thread is
    free while the caller waits. The last trainer of a step triggers one
    optimizer step on the average of everyone's gradients and completes every
    queued Future with the new weights: one round trip per trainer per step,
    and all trainers always see the same weights (synchronous SGD).

``--mode hogwild`` (asynchronous)
    Same local gradients, but ``push_gradients_hogwild`` applies each
    trainer's gradients the moment they arrive and replies with whatever the
    weights are then. No trainer waits for another; gradients may be a step or
    two stale, which SGD tolerates (Hogwild!).

``--mode autograd`` (distributed autograd; this is ``make demo``)
    The trainers hold no weights at all. Each asks for an RRef to the server's
    model (``rpcdist.remote``) and RRefs to its parameters, and builds a
    ``DistributedOptimizer`` over them. A step is::

        with dist_autograd.context() as cid:
            logits = model_rref.rpc_sync().forward(x)     # runs on the server
            loss = F.cross_entropy(logits, y)             # runs here
            dist_autograd.backward(cid, [loss])           # through the server
            opt.step(cid)                                 # SGD on the server

    The gradients stay on the server, in the context ``cid``; the optimizer
    step runs there too. Trainers step asynchronously, as in Hogwild.

A trainer that dies (killed, hung, cut off) does not end the job: once the
server's agent declares it lost (``rpcdist.debug_info()["lost_workers"]``;
the server probes its trainers once a second so that it notices),
the server drops it from the synchronous step (its queued gradients too;
the others' step completes without it) and from the scoreboard, and the
other trainers finish; the server frees the lost trainer's distributed
autograd contexts itself. The summary lists the lost trainers.

``--rejoin`` lets a restarted trainer come back: the workers then form a
*dynamic group* (``init_rpc`` without a world size; ``WORLD_SIZE`` only says
how many trainers to expect and how to shard), so a trainer started again
with its old rank and environment joins the running job, asks the server
where training is (:func:`rejoin`) and trains from the epoch after the last
one any trainer reported; in sync mode it enters the synchronous step with
its first gradients for the current weights. In autograd mode it asks for
new RRefs and a new ``DistributedOptimizer`` (the server's optimizer of the
one before went with the RRefs the lost process held); the lost process's
contexts on the server are freed after their lease, since the restarted
process, asked, holds none of them, and its own context ids are new ones.
Each epoch's row in ``summary.json`` lists the trainers that reported it;
once every trainer left, the server prints what it still holds (``left on
the server``: distributed autograd contexts and RRefs, both 0).

Functions are sent by qualified name (``__main__:push_gradients``,
``ps_common:progress``). Every process runs this script, so the names resolve
everywhere; server state is found through ``ParameterServer.instance``.

Measured with ``python benchmarks/bench_examples.py`` (2-core VM shared with
other jobs, load average 9; defaults: 2 trainers, 8 epochs, batch 32; wall
time from start to exit, workers' start-up included; docs/benchmarks.md):

* ``--mode sync``: test accuracy 0.972, 14.5 s
* ``--mode hogwild``: test accuracy 0.981, 13.1 s
* ``--mode autograd``: test accuracy 0.969, 9.6 s
"""

from __future__ import annotations

import os

# One BLAS thread per process: 3 processes share 2 cores.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import contextlib
import sys
import threading
import time
from typing import Any

import numpy as np
import ps_common
from ps_common import Net, Scoreboard

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist import optim
from rpcdist import tensor as rt
from rpcdist.nn import functional as F

PS_NAME = "ps"
MODES = ("sync", "hogwild", "autograd")

Params = dict[str, np.ndarray]  # name -> weights, as nn.Module.state_dict() returns


# ------------------------------------------------------------------ parameter server


class ParameterServer:
    """The model, its optimizer and (sync mode) the gradients of the current step.

    Args:
        num_trainers: Gradients to wait for before each synchronous update.
        lr: Learning rate of SGD with momentum (sync and hogwild modes).
    """

    #: The one server of this process (rank 0), found by the RPC entry points.
    instance: ParameterServer | None = None

    def __init__(self, num_trainers: int, lr: float) -> None:
        self.model = Net()
        self.names = [name for name, _ in self.model.named_parameters()]
        self.opt = optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.live = set(range(1, num_trainers + 1))  # trainer ranks still training
        self.version = 0  # updates applied so far
        self.lock = threading.Lock()  # handlers run concurrently in the pool
        self.pending: dict[int, tuple[Params, rpcdist.Future[Any]]] = {}
        #: Ranks lost at some point, and the restarted ones on their way back in.
        self.was_lost: set[int] = set()
        self.back: set[int] = set()
        self.returned: list[tuple[int, int]] = []  # (rank, first epoch), for the log

    def add_gradients(
        self, rank: int, version: int, grads: Params
    ) -> rpcdist.Future[tuple[int, Params]]:
        """Queue trainer ``rank``'s gradients; on the last live trainer's, update and
        complete every Future."""
        fut: rpcdist.Future[tuple[int, Params]] = rpcdist.Future()
        with self.lock:
            if rank in self.back:  # a restarted trainer: in at its first push on time
                if version != self.version:  # it caught up meanwhile: the latest weights
                    fut.set_result((self.version, self.model.state_dict()))
                    return fut
                self.back.discard(rank)
                self.live.add(rank)
            if version != self.version:  # synchronous SGD: everyone is on one step
                fut.set_exception(
                    RuntimeError(f"gradients for version {version}, server is at {self.version}")
                )
                return fut
            self.pending[rank] = (grads, fut)
            done = self._update_if_complete()
        self._reply(done)
        return fut

    def drop_trainer(self, rank: int) -> None:
        """Trainer ``rank`` was lost: its queued gradients are dropped and the step
        goes on with the others (if they all pushed, it is taken now)."""
        with self.lock:
            self.live.discard(rank)
            self.back.discard(rank)
            self.was_lost.add(rank)
            self.pending.pop(rank, None)
            done = self._update_if_complete()
        self._reply(done)

    def rejoin(self, rank: int, board: Scoreboard) -> int:
        """Trainer ``rank`` started: the epoch it trains from (0: nothing left)."""
        with self.lock:
            if rank not in self.was_lost:
                return 1  # a first start
            first = board.rejoin(rank)
            if first:
                self.back.add(rank)
                self.returned.append((rank, first))
            return first

    def _update_if_complete(self) -> tuple[list[rpcdist.Future[Any]], Any] | None:
        """Under the lock: once every live trainer pushed, one step on their mean."""
        if not self.pending or not self.live <= set(self.pending):
            return None  # not the last one: the replies wait for the update
        batch = [self.pending[r] for r in sorted(self.pending)]
        self.pending = {}
        mean = [np.mean([g[name] for g, _ in batch], axis=0) for name in self.names]
        self.opt.step(grads=mean)
        self.version += 1
        return [f for _, f in batch], (self.version, self.model.state_dict())

    @staticmethod
    def _reply(done: tuple[list[rpcdist.Future[Any]], Any] | None) -> None:
        # Complete the Futures outside the lock: each completion sends a reply.
        if done is not None:
            for waiting in done[0]:
                waiting.set_result(done[1])

    def apply_now(self, grads: Params) -> tuple[int, Params]:
        """Hogwild: apply one trainer's gradients at once; the weights after it."""
        with self.lock:  # guards the optimizer's momentum, not a barrier
            self.opt.step(grads=[grads[name] for name in self.names])
            self.version += 1
            return self.version, self.model.state_dict()

    def test_accuracy(self, test_set: tuple[np.ndarray, np.ndarray]) -> float:
        with self.lock:
            return ps_common.accuracy(self.model, *test_set)


def _server() -> ParameterServer:
    server = ParameterServer.instance
    assert server is not None, "this function runs on the parameter server (rank 0) only"
    return server


# -------------------------------------------- RPC entry points (run on the server)


def get_params() -> tuple[int, Params]:
    """The current weights and their version."""
    server = _server()
    with server.lock:
        return server.version, server.model.state_dict()


@rpcdist.functions.async_execution
def push_gradients(rank: int, version: int, grads: Params) -> rpcdist.Future[tuple[int, Params]]:
    """Sync mode: the Future completes with the next weights once all trainers pushed.

    ``@async_execution``: rpcdist takes the returned Future and replies when it
    completes, so waiting callers hold no server thread.
    """
    return _server().add_gradients(rank, version, grads)


def push_gradients_hogwild(grads: Params) -> tuple[int, Params]:
    """Hogwild mode: apply these gradients now and reply with the weights after."""
    return _server().apply_now(grads)


def server_model() -> Net:
    """The server's model itself (``rpcdist.remote`` keeps it there behind an RRef)."""
    return _server().model


def finished(rank: int) -> None:
    """``--rejoin``: trainer ``rank`` trained its last epoch; the synchronous step
    goes on without it (a trainer that came back started later, so its count of
    steps differs from the others')."""
    server = _server()
    with server.lock:
        server.live.discard(rank)
        server.back.discard(rank)
        done = server._update_if_complete()
    server._reply(done)


def rejoin(rank: int) -> int:
    """``--rejoin``: trainer ``rank`` started (again?); the epoch it trains from."""
    board = Scoreboard.instance
    assert board is not None
    return _server().rejoin(rank, board)


def parameter_rrefs() -> list[rpcdist.RRef[Any]]:
    """RRefs to the server model's parameters, for a ``DistributedOptimizer``."""
    return [rpcdist.RRef(p) for p in _server().model.parameters()]


# -------------------------------------------------------------------------- trainers


def local_step_fn(mode: str, rank: int) -> Any:
    """A step computing gradients here and pushing them (sync and hogwild modes)."""
    model = Net()  # its weights are replaced by the server's before every step
    version, params = rpcdist.rpc_sync(PS_NAME, get_params)

    def step(x: np.ndarray, y: np.ndarray) -> tuple[float, rt.Tensor]:
        nonlocal version, params
        model.load_state_dict(params)
        logits = model(rt.tensor(x))
        loss = F.cross_entropy(logits, y)
        model.zero_grad()
        loss.backward()
        grads = {name: p.grad.data for name, p in model.named_parameters()}
        if mode == "sync":
            # Returns once every trainer pushed this step and the server applied it.
            version, params = rpcdist.rpc_sync(PS_NAME, push_gradients, args=(rank, version, grads))
        else:
            version, params = rpcdist.rpc_sync(PS_NAME, push_gradients_hogwild, args=(grads,))
        return float(loss.item()), logits

    return step


def autograd_step_fn(lr: float) -> Any:
    """A step whose forward, backward and optimizer step all reach into the server."""
    model_rref = rpcdist.remote(PS_NAME, server_model)
    opt = optim.DistributedOptimizer(
        optim.SGD, rpcdist.rpc_sync(PS_NAME, parameter_rrefs), lr=lr, momentum=0.9
    )

    def step(x: np.ndarray, y: np.ndarray) -> tuple[float, rt.Tensor]:
        with dist_autograd.context() as cid:
            logits = model_rref.rpc_sync().forward(rt.tensor(x))  # on the server
            loss = F.cross_entropy(logits, y)  # here
            dist_autograd.backward(cid, [loss])  # gradients land on the server
            opt.step(cid)  # the server's SGD applies them
        return float(loss.item()), logits

    return step


def run_trainer(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Train on this rank's shard and report progress and epoch totals to rank 0."""
    x_train, y_train, _, _ = ps_common.load_digits(args.seed)
    x, y = ps_common.shard(x_train, y_train, rank - 1, world_size - 1)
    steps = len(x) // args.batch_size
    rng = np.random.default_rng([args.seed, rank])  # this trainer's shuffling
    first = rpcdist.rpc_sync(PS_NAME, rejoin, args=(rank,)) if args.rejoin else 1
    if not first:
        return  # restarted after the last epoch began: nothing left to train
    step = autograd_step_fn(args.lr) if args.mode == "autograd" else local_step_fn(args.mode, rank)
    for epoch in range(first, args.epochs + 1):
        order = rng.permutation(len(x))
        loss_sum, correct, count = 0.0, 0, 0
        reports = []
        for i in range(steps):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            loss, logits = step(x[idx], y[idx])
            loss_sum += loss * len(idx)
            correct += int((logits.data.argmax(axis=1) == y[idx]).sum())
            count += len(idx)
            # Fire and forget (collected below): one tick of rank 0's progress bar.
            reports.append(rpcdist.rpc_async(PS_NAME, ps_common.progress, args=(1, loss)))
        rpcdist.futures.wait_all(reports)
        rpcdist.rpc_sync(PS_NAME, ps_common.end_epoch, args=(epoch, loss_sum, correct, count, rank))
    if args.rejoin:
        rpcdist.rpc_sync(PS_NAME, finished, args=(rank,))


# --------------------------------------------------------------------------- the job


def worker_main(args: argparse.Namespace) -> int:
    """One process of the job: rank and world size come from the launcher's environment."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size < 2:
        print("parameter_server.py needs at least 2 processes (1 server, 1 trainer)")
        return 2
    if args.rejoin:
        # No world size: a dynamic group, which a restarted trainer can join again.
        del os.environ["WORLD_SIZE"]
    start = time.perf_counter()
    trainers = world_size - 1
    board = None
    if rank == 0:
        # Server and scoreboard exist before init_rpc, so trainers' calls find them.
        rt.manual_seed(args.seed)
        server = ParameterServer.instance = ParameterServer(trainers, args.lr)
        x_train, _, x_test, y_test = ps_common.load_digits(args.seed)
        steps = (len(x_train) // trainers) // args.batch_size
        board = Scoreboard.instance = Scoreboard(
            trainers,
            args.epochs,
            steps,
            lambda: server.test_accuracy((x_test, y_test)),
            f"{args.mode} ({trainers} trainers)",
        )
    # env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and the job
    # token all come from the launcher, so a name is all init_rpc needs.
    rpcdist.init_rpc(PS_NAME if rank == 0 else f"trainer{rank}")
    if board is None:
        run_trainer(rank, world_size, args)
    else:
        lost = watch_trainers(server, board)  # until every live trainer reported its last epoch
        if args.rejoin:
            board.write(f"[ps] left on the server: {leftovers()}")
    # Collective (--rejoin: the trainers leave, the server waits until they have).
    rpcdist.shutdown()
    if board is None:
        return 0
    return report(board, time.perf_counter() - start, trainers, args, lost)


def leftovers(timeout: float = 30.0) -> str:
    """``--rejoin``: once every trainer left the group (or ``timeout`` passed),
    what the server still holds for them; ``0 autograd contexts, 0 RRefs``
    when nothing leaked (a lost trainer's contexts go after their lease)."""
    end = time.monotonic() + timeout
    while True:
        stats = rpcdist.statistics()
        held = stats["autograd_contexts"], stats["rref_owners"]
        if (stats["members"] <= 1 and held == (0, 0)) or time.monotonic() >= end:
            return f"{held[0]} autograd contexts, {held[1]} RRefs"
        time.sleep(0.1)


def alive() -> bool:
    """Answered by a trainer: the server's liveness probe."""
    return True


def watch_trainers(server: ParameterServer, board: Scoreboard) -> list[str]:
    """Wait for the end of training; a trainer declared lost (killed, hung, cut off) is
    dropped from the synchronous step and the scoreboard, and the others go on.

    A trainer that dies while the server has nothing to send it (it finished its
    epochs first, or in the asynchronous modes) leaves no call to fail, so the server
    also probes each live trainer once a second (:func:`alive`); a probe that fails
    has the agent declare the trainer lost. The autograd mode needs nothing more:
    the server frees a lost trainer's distributed autograd contexts itself (after a
    lease of seconds; a restarted trainer of that rank holds none of them, and makes
    other context ids), and its ``DistributedOptimizer`` steps only the contexts that
    trainers still alive send.
    """
    lost: list[str] = []  # every loss, in order
    gone: set[str] = set()  # lost and not back
    probes: dict[int, rpcdist.Future[Any]] = {}
    next_probe = time.monotonic()
    while not board.done.wait(0.2):
        if time.monotonic() >= next_probe:
            next_probe = time.monotonic() + 1.0
            for rank in sorted(server.live):
                if rank not in probes or probes[rank].done():
                    with contextlib.suppress(rpcdist.RpcdistError):  # lost: noticed below
                        probes[rank] = rpcdist.rpc_async(f"trainer{rank}", alive, timeout=5.0)
        with server.lock:
            returned, server.returned = server.returned, []
        for rank, first in returned:  # (--rejoin)
            gone.discard(f"trainer{rank}")
            board.write(f"[ps] trainer{rank} rejoined; it trains from epoch {first}")
        for name, why in rpcdist.debug_info()["lost_workers"].items():
            if name.startswith("trainer") and name not in gone:
                gone.add(name)
                lost.append(name)
                rank = int(name.removeprefix("trainer"))
                board.write(f"[ps] {name} lost ({why}); going on with {len(server.live) - 1}")
                server.drop_trainer(rank)
                board.drop(rank)
    for fut in probes.values():  # answered before the trainers shut down, or lost
        with contextlib.suppress(rpcdist.RpcdistError):
            fut.wait()
    return lost


def report(
    board: Scoreboard, wall: float, trainers: int, args: argparse.Namespace, lost: list[str]
) -> int:
    """Print the result and where the files are; non-zero when the model did not learn."""
    if len(board.history) < args.epochs:
        print(f"[ps] FAILED: every trainer was lost ({', '.join(lost)})", flush=True)
        return 1
    final = board.history[-1]["test_accuracy"]
    summary = {
        "title": f"parameter server, mode {args.mode}, {trainers} trainers, digits",
        "mode": args.mode,
        "dataset": ps_common.DATASET,
        "trainers": trainers,
        "batch_size": args.batch_size,
        "test_accuracy": final,
        "wall_seconds": wall,
        "lost_trainers": lost,
    }
    files = board.save(args.out_dir, summary)
    print(f"[ps] final test accuracy {final:.4f} ({args.mode} mode); worker wall {wall:.1f} s")
    for path in files:
        print(f"[ps] wrote {os.path.abspath(path)}")
    if final < args.min_accuracy:
        print(f"[ps] FAILED: accuracy {final:.4f} is below {args.min_accuracy}", flush=True)
        return 1
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Parameter-server training on scikit-learn's digits (1 server + trainers).",
        epilog="Run: python -m rpcdist.launch --nproc-per-node 3 --no-prefix "
        "examples/parameter_server.py --mode autograd",
    )
    p.add_argument("--mode", choices=MODES, default="sync", help="see the module docstring")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per trainer and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this")
    p.add_argument("--out-dir", default="build/parameter_server", help="summary.json, training.png")
    p.add_argument(
        "--workers", type=int, default=3, help="processes when run standalone (1 ps + trainers)"
    )
    p.add_argument(
        "--rejoin",
        action="store_true",
        help="a dynamic group: a restarted trainer joins again",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        # Started by hand: become the launcher of a local job running this script.
        from rpcdist import launch

        return launch.main(["--nproc-per-node", str(args.workers), "--no-prefix", __file__, *argv])
    return worker_main(args)


if __name__ == "__main__":
    sys.exit(main())
