"""Helpers the in-process multi-agent tests share."""

from __future__ import annotations

import gc
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

from rpcdist.testing import as_current


def contexts_settled(agents: Sequence[Any], timeout: float = 10.0) -> bool:
    """Whether every agent's live autograd contexts reach 0 within ``timeout``
    (releases travel as control messages, so they land a little after ``with``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        gc.collect()
        if all(a.statistics()["autograd_contexts"] == 0 for a in agents):
            return True
        time.sleep(0.01)
    return False


def on_all(agents: Sequence[Any], fn: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """Run ``fn(rank)`` on every agent at once (one thread each); re-raise the first error."""
    out: list[Any] = [None] * len(agents)

    def run(i: int) -> None:
        with as_current(agents[i]):
            try:
                out[i] = fn(i)
            except BaseException as e:
                out[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def ok(results: list[Any]) -> list[Any]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether ``cond()`` became true within ``timeout`` seconds (polled)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def frames_in_cycles(fn: Callable[[], Any], n: int = 10) -> set[str]:
    """The functions whose frames ``n`` runs of ``fn`` left in reference cycles
    (found by a collection with everything it frees kept for a look)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(n):
            fn()
        gc.collect()
        return {o.f_code.co_name for o in gc.garbage if isinstance(o, types.FrameType)}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
