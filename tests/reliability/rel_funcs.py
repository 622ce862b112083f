"""Functions the reliability tests call on workers (importable by name)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

#: Set to release a worker whose loop :func:`block_loop` holds.
RELEASE = threading.Event()
#: Set once :func:`block_loop` holds a loop.
BLOCKING = threading.Event()


def add(a: int, b: int) -> int:
    return a + b


def echo(x: object) -> object:
    return x


def pid() -> int:
    return os.getpid()


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


async def block_loop(limit: float) -> bool:
    """Hold the calling agent's event loop (as a hung process would) until
    :data:`RELEASE` is set or ``limit`` seconds pass."""
    BLOCKING.set()
    return RELEASE.wait(limit)


def ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.uint8)


def shell(command: str) -> int:
    """What an attacker would love to call: hidden behind an innocent module."""
    return os.system(command)


#: ``os`` reachable through this module: ``rel_funcs:os.system`` must be refused.
hidden_os = os


def apply(fn: object, arg: object) -> object:
    """Call a function that arrived as a value."""
    return fn(arg)  # type: ignore[operator]


def die_after(seconds: float) -> None:
    """Kill this worker's process (SIGKILL) after ``seconds``: mid-call."""
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)


#: Set by :func:`set_event`, so one process can tell another that it may go on.
EVENT = threading.Event()


def set_event() -> None:
    EVENT.set()


#: Released once per peer that called :func:`ready` (so after its init_rpc returned).
READY = threading.Semaphore(0)


def ready() -> None:
    READY.release()


def wait_ready(peers: int, timeout: float = 30.0) -> None:
    """Wait until ``peers`` workers called :func:`ready` here."""
    for _ in range(peers):
        if not READY.acquire(timeout=timeout):
            raise TimeoutError("a peer never finished init_rpc")


#: Released once per :func:`arrived` call (a second, one-way readiness step).
ARRIVED = threading.Semaphore(0)


def arrived() -> None:
    ARRIVED.release()


def die_after_stamp(seconds: float, path: str) -> None:
    """:func:`die_after`, writing the wall-clock time of death to ``path`` first."""
    time.sleep(seconds)
    with open(path, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
