"""Module-level functions called over RPC by the tests (resolved by name)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np

import rpcdist
from rpcdist.functions import async_execution


def add(a, b):
    return a + b


def echo(x):
    return x


def thread_name():
    return threading.current_thread().name


_probe_lock = threading.Lock()
_probe = {"running": 0, "peak": 0}


def concurrency_probe(seconds):
    """Count the handlers running at once here (see ``probe_peak``)."""
    with _probe_lock:
        _probe["running"] += 1
        _probe["peak"] = max(_probe["peak"], _probe["running"])
    time.sleep(seconds)
    with _probe_lock:
        _probe["running"] -= 1
    return True


def probe_peak(reset=False):
    with _probe_lock:
        peak = _probe["peak"]
        if reset:
            _probe["peak"] = 0
        return peak


def echo_size(n):
    return b"y" * n


def no_args():
    return "ok"


def kw(a, *, b=2, c=3):
    return (a, b, c)


def raise_key_error(msg):
    raise KeyError(msg)


class CustomError(Exception):
    """Importable on both sides: comes back with its own type."""


def raise_custom():
    raise CustomError("custom failure")


class _Unbuildable(Exception):
    def __init__(self, a, b, c):
        super().__init__(f"{a}{b}{c}")


def raise_unbuildable():
    raise _Unbuildable(1, 2, 3)


def sleep_then(seconds, value=None):
    time.sleep(seconds)
    return value


def worker_name():
    return rpcdist.get_worker_info().name


def nested_add(to, a, b):
    """Call ``add`` on ``to`` from inside a handler."""
    return rpcdist.rpc_sync(to, add, args=(a, b))


def nested_remaining_timeout(to, seconds):
    """Nested call that takes ``seconds`` on ``to`` with no timeout of its own."""
    return rpcdist.rpc_sync(to, sleep_then, args=(seconds, "done"))


async def async_add(a, b):
    await asyncio.sleep(0)
    return a + b


async def async_nested(to, a, b):
    return await rpcdist.rpc_async(to, add, args=(a, b))


@async_execution
def async_exec_nested(to, a, b):
    return rpcdist.rpc_async(to, add, args=(a, b)).then(lambda f: f.value() * 10)


@async_execution
def async_exec_back(to, x):
    """Calls back to ``to`` (for A -> B -> A with one worker thread)."""
    return rpcdist.rpc_async(to, echo, args=(x,))


class Batcher:
    """Server-side batching with @async_execution: replies once N calls queued."""

    _lock = threading.Lock()
    _waiting: list = []
    size = 4

    @staticmethod
    @async_execution
    def submit(x):
        fut = rpcdist.Future()
        with Batcher._lock:
            Batcher._waiting.append((x, fut))
            if len(Batcher._waiting) < Batcher.size:
                return fut
            batch, Batcher._waiting = Batcher._waiting, []
        total = sum(v for v, _ in batch)
        for _, f in batch:
            f.set_result(total)
        return fut

    @classmethod
    @async_execution
    def cls_add(cls, a, b):
        fut = rpcdist.Future()
        fut.set_result((cls.__name__, a + b))
        return fut


def fire_and_forget_chain(hops, names, counter_to):
    """Each hop starts the next asynchronously and returns at once."""
    if hops:
        nxt = names[hops % len(names)]
        rpcdist.rpc_async(nxt, fire_and_forget_chain, args=(hops - 1, names, counter_to))
    else:
        rpcdist.rpc_async(counter_to, record, args=("chain-end",))
    return hops


_records: dict[int, list] = {}


def record(value):
    _records.setdefault(os.getpid(), []).append(value)
    return len(_records[os.getpid()])


_arrivals: list = []


async def arrive(value, padding=None):
    """Record arrival order (an async handler starts in arrival order)."""
    _arrivals.append(value)
    return value


def arrivals():
    return list(_arrivals)


def clear_arrivals():
    _arrivals.clear()


def records():
    return list(_records.get(os.getpid(), []))


def array_stats(a):
    return float(np.asarray(a).sum()), a.shape, str(a.dtype)


def pid():
    return os.getpid()


def crash():
    os._exit(3)


nested_probe_done = threading.Event()
#: The probe holds its reply until the test saw the caller time out (the
#: caller and the nested call share one deadline, so they would race).
nested_probe_release = threading.Event()
nested_probe_result: list = []


def nested_timeout_probe(to):
    """A nested call with no timeout of its own, to :func:`held` on ``to``;
    records how it ended."""
    start = time.monotonic()
    try:
        rpcdist.rpc_sync(to, held)
        nested_probe_result.append(("ok", time.monotonic() - start))
    except rpcdist.RpcTimeoutError:
        nested_probe_result.append(("timeout", time.monotonic() - start))
    finally:
        nested_probe_done.set()
        nested_probe_release.wait(10)


#: Holds :func:`held` until the test lets it go.
release = threading.Event()


def held(value=None):
    """Block a pool thread until ``release`` is set (at most 30 s)."""
    release.wait(30)
    return value
