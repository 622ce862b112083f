"""RRef benchmark: remote()+to_here() and proxy latency beside rpc_sync, and
10,000 RRefs shared user -> user and dropped.

* Latency (2 processes on 127.0.0.1, caller and owner): ``rpc_sync`` of a
  function returning 1, ``remote(...).to_here()`` of the same function (its
  RRef dropped at once, so the deletes are part of its cost), a proxy call
  ``rref.rpc_sync().incr()``, and the same through a function the RRef is
  passed to (``rpc_sync(owner, f, args=(rref,))``, the idiom of PyTorch's
  examples, which forks the RRef back to its owner each call); p50/p99 over
  alternating blocks of calls, in
  the same run. PyTorch RPC (TensorPipe, two spawned processes) does the same
  when torch imports.
* Sharing (3 processes: creator, owner, second user): 10,000 ``remote()``
  RRefs are created, sent user -> user in batches of 500, and dropped by both
  users; wall time until the owner holds nothing, and the protocol's control
  messages per RRef (fork requests, child accepts, user deletes, each batched
  per destination) beside the unbatched count (one message per item).

Run: ``.venv/bin/python benchmarks/bench_rref.py [--quick] [--no-write]``
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _rref_funcs as rb
from _report import free_port, median, percentile, table, write_section

from rpcdist.testing import WorkerFailed, run_workers

SHARED = 10_000
CHUNK = 500
MSGS, ITEMS = "rref_control_messages", "rref_control_items"


def _interleaved(
    calls: dict[str, Callable[[], Any]], n: int, block: int = 50
) -> dict[str, list[float]]:
    """Time ``n`` calls of each kind, in alternating blocks of ``block`` calls.

    Blocks (rather than one call of each kind in turn) keep each kind's
    background work, such as the deletes of dropped RRefs, in its own timings;
    alternating them spreads drift over every kind alike.
    """
    for call in calls.values():
        for _ in range(min(200, n)):
            call()
    out: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(0, n, block):
        for k, call in calls.items():
            for _ in range(block):
                t = time.perf_counter()
                call()
                out[k].append(time.perf_counter() - t)
    return out


# ---------------------------------------------------------------- rpcdist


def _rpcdist_latency(rank: int, world_size: int, init: str, n: int) -> Any:
    import rpcdist

    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init, rpc_timeout=120)
    try:
        if rank != 0:
            return None
        counter = rpcdist.remote("w1", rb.Counter)
        return _interleaved(
            {
                "rpc_sync": lambda: rpcdist.rpc_sync("w1", rb.one),
                "remote + to_here": lambda: rpcdist.remote("w1", rb.one).to_here(),
                "proxy rpc_sync": lambda: counter.rpc_sync().incr(),
                "rpc_sync(owner, f, args=(rref,))": lambda: rpcdist.rpc_sync(
                    "w1", rb.incr_local, args=(counter,)
                ),
            },
            n,
        )
    finally:
        rpcdist.shutdown()


def _rpcdist_sharing(rank: int, world_size: int, init: str, n: int) -> Any:
    import rpcdist

    rpcdist.init_rpc(f"w{rank}", rank, world_size, init_method=init, rpc_timeout=120)
    try:
        if rank != 0:
            return None
        before = [rpcdist.rpc_sync(f"w{r}", rb.rref_stats) for r in range(3)]
        t0 = time.perf_counter()
        refs = [rpcdist.remote("w1", rb.one) for _ in range(n)]
        for i in range(0, n, CHUNK):  # user (w0) -> user (w2)
            rpcdist.rpc_sync("w2", rb.keep_all, args=(refs[i : i + CHUNK],))
        t1 = time.perf_counter()
        del refs
        gc.collect()
        rpcdist.rpc_sync("w2", rb.drop_all)
        while rpcdist.rpc_sync("w1", rb.rref_stats)["rref_owners"]:
            time.sleep(0.002)
        t2 = time.perf_counter()
        # Let the last acknowledgements land before counting.
        while any(rpcdist.rpc_sync(f"w{r}", rb.rref_stats).get("rref_outbox") for r in range(3)):
            time.sleep(0.002)
        after = [rpcdist.rpc_sync(f"w{r}", rb.rref_stats) for r in range(3)]
        msgs = sum(a[MSGS] - b.get(MSGS, 0) for a, b in zip(after, before))
        items = sum(a[ITEMS] - b.get(ITEMS, 0) for a, b in zip(after, before))
        return {"create_share_s": t1 - t0, "drop_s": t2 - t1, "messages": msgs, "items": items}
    finally:
        rpcdist.shutdown()


# ---------------------------------------------------------------- PyTorch RPC


def _torch_latency(rank: int, world_size: int, init: str, port: int, n: int) -> Any:
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16, rpc_timeout=120
    )
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    try:
        if rank != 0:
            return None
        counter = rpc.remote("w1", rb.Counter)
        return _interleaved(
            {
                "rpc_sync": lambda: rpc.rpc_sync("w1", rb.one),
                "remote + to_here": lambda: rpc.remote("w1", rb.one).to_here(),
                "proxy rpc_sync": lambda: counter.rpc_sync().incr(),
                "rpc_sync(owner, f, args=(rref,))": lambda: rpc.rpc_sync(
                    "w1", rb.incr_local, args=(counter,)
                ),
            },
            n,
        )
    finally:
        rpc.shutdown()


def _torch(n: int) -> dict[str, list[float]] | None:
    try:
        import torch.distributed.rpc  # noqa: F401
    except Exception as e:  # torch missing or built without RPC
        print(f"PyTorch RPC unavailable ({type(e).__name__}: {e}); skipped", file=sys.stderr)
        return None
    try:
        return run_workers(_torch_latency, 2, args=(free_port(), n), timeout=300)[0]  # type: ignore[no-any-return]
    except WorkerFailed as e:
        print(f"PyTorch RPC failed; skipped:\n{e}", file=sys.stderr)
        return None


# ----------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    n = 500 if a.quick else 2000
    shared = 2000 if a.quick else SHARED

    ours = run_workers(_rpcdist_latency, 2, args=(n,), timeout=600)[0]
    theirs = _torch(n)
    base = median(ours["rpc_sync"])
    rows = []
    for k, v in ours.items():
        row: list[object] = [k, median(v) * 1e6, percentile(v, 99) * 1e6, median(v) / base]
        if theirs is not None:
            row += [median(theirs[k]) * 1e6, percentile(theirs[k], 99) * 1e6]
        rows.append(row)
    headers = ["call", "rpcdist p50 µs", "p99 µs", "× rpc_sync"]
    if theirs is not None:
        headers += ["PyTorch p50 µs", "p99 µs"]
    else:
        headers = [*headers[:3], "× rpc_sync"]

    share = run_workers(_rpcdist_sharing, 3, args=(shared,), timeout=600)[0]
    naive = 4  # fork request + child accept + 2 user deletes, one message each
    share_rows = [
        [
            f"{shared:,}",
            share["create_share_s"],
            share["drop_s"],
            f"{share['messages']} ({share['messages'] / shared:.4f})",
            share["items"] / shared,
            naive,
        ]
    ]
    body = (
        f"Latency: {n} calls of each kind in alternating blocks of 50, 2 processes, small values.\n\n"
        + table(headers, rows)
        + "\n\nSharing: RRefs created by w0 on owner w1, sent user -> user to w2 in "
        f"batches of {CHUNK}, then dropped by both users (3 processes).\n\n"
        + table(
            [
                "RRefs",
                "create + share s",
                "drop until freed s",
                "control msgs (per RRef)",
                "control items / RRef",
                "unbatched msgs / RRef",
            ],
            share_rows,
        )
    )
    if a.no_write:
        print(body)
    else:
        write_section(
            "rref",
            "RRefs: remote/to_here, proxies, sharing",
            body,
        )


if __name__ == "__main__":
    main()
