"""Functions and classes the RRef benchmark calls remotely (importable in every process)."""

from __future__ import annotations

import gc
from typing import Any

_kept: list[Any] = []


def one() -> int:
    return 1


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def incr(self) -> int:
        self.n += 1
        return self.n


def incr_local(rref: Any) -> int:
    """On the owner: the idiom of PyTorch's examples, ``rpc_sync(rref.owner(),
    f, args=(rref,))`` with ``f`` calling a method of ``rref.local_value()``."""
    return int(rref.local_value().incr())


def keep_all(refs: list[Any]) -> int:
    """Hold ``refs`` here (a user -> user share when they are user RRefs)."""
    _kept.extend(refs)
    return len(_kept)


def drop_all() -> int:
    n = len(_kept)
    _kept.clear()
    gc.collect()
    return n


def rref_stats() -> dict[str, int]:
    import rpcdist._rpc._context as c

    stats = c.current_agent().statistics()
    return {k: v for k, v in stats.items() if k.startswith("rref_")}
