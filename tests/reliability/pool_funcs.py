"""Handlers that block on nested calls, for the handler-pool tests."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import rpcdist

#: Set by ``chains_job`` once every chain has been started.
STARTED = threading.Event()


def bounce(depth: int, me: str, other: str) -> int:
    """``depth`` nested blocking calls back and forth between ``me`` and
    ``other``, each holding a handler thread of its worker while it waits."""
    if depth == 0:
        return 0
    return 1 + rpcdist.rpc_sync(other, bounce, args=(depth - 1, other, me))


def bounce_async(depth: int, me: str, other: str) -> int:
    """:func:`bounce`, waiting with ``rpc_async(...).wait()`` (a Future)."""
    if depth == 0:
        return 0
    return 1 + rpcdist.rpc_async(other, bounce_async, args=(depth - 1, other, me)).wait()


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def chains_job(
    rank: int, world_size: int, init: str, chains: int, depth: int, timeout: float
) -> dict[str, Any]:
    """Ranks from the launcher's environment; pools of 2 threads. Rank 0
    starts ``chains`` :func:`bounce` chains of ``depth`` at once; it reports
    their outcomes and the warnings each rank logged (rank 1 sends them
    back when rank 0 asks)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    keep = _Keep()
    logging.getLogger("rpcdist").addHandler(keep)
    rpcdist.init_rpc(f"w{rank}", init_method=init, rpc_timeout=timeout, num_worker_threads=2)
    out: dict[str, Any] = {"warnings": keep.lines}
    if rank == 0:
        futs = [rpcdist.rpc_async("w1", bounce, args=(depth, "w1", "w0")) for _ in range(chains)]
        out["results"] = []
        for f in futs:
            try:
                out["results"].append(f.wait())
            except rpcdist.RpcdistError as e:
                out["results"].append(f"{type(e).__name__}: {e}")
        out["peer_warnings"] = rpcdist.rpc_sync("w1", warnings_logged, timeout=30)
    rpcdist.shutdown()
    return out


def warnings_logged() -> list[str]:
    """The warnings this worker logged (``chains_job``'s record)."""
    for h in logging.getLogger("rpcdist").handlers:
        if isinstance(h, _Keep):
            return h.lines
    return []
