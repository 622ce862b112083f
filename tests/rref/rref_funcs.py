"""Module-level functions and classes the RRef tests call over RPC (resolved by name).

In-process agents share this module, so per-worker state is keyed by the
current worker's name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import time
import weakref

import numpy as np

import rpcdist
from rpcdist.functions import async_execution


def me():
    return rpcdist.get_worker_info().name


@rpcdist.register_type
@dataclasses.dataclass
class Counter:
    """A stateful value for proxy tests: instance, static, class and async methods."""

    n: int = 0

    def incr(self, k=1):
        self.n += k
        return self.n

    def get(self):
        return self.n

    def fail(self):
        raise KeyError("counter failure")

    def slow(self, seconds):
        time.sleep(seconds)
        return self.n

    async def aincr(self, k=1):
        await asyncio.sleep(0)
        self.n += k
        return self.n

    @staticmethod
    def twice(x):
        return 2 * x

    @classmethod
    def name(cls):
        return cls.__name__

    @staticmethod
    @async_execution
    def later(x):
        fut = rpcdist.Future()
        threading.Timer(0.01, fut.set_result, args=(x + 1,)).start()
        return fut


def make_counter(n=0):
    return Counter(n)


def add(a, b):
    return a + b


def echo(x):
    return x


def sleep_then(seconds, value=None):
    time.sleep(seconds)
    return value


def raise_value_error(msg):
    raise ValueError(msg)


def to_here(rref):
    return rref.to_here()


def owner_and_value(rref):
    """On the owner: the value itself, through local_value()."""
    return rref.is_owner(), rref.local_value()


async def async_to_here(rref):
    """An async handler: RRef use without blocking the loop."""
    value = await rref.to_here_async()
    bumped = await rref.rpc_async().incr(1) if isinstance(value, Counter) else None
    return value, bumped


def forward(rref, to):
    """Send ``rref`` on to ``to`` and return what to_here gives there."""
    return rpcdist.rpc_sync(to, to_here, args=(rref,))


def forward_async(rref, to):
    """Send ``rref`` on to ``to`` without waiting; return at once."""
    rpcdist.rpc_async(to, keep, args=(rref,))
    return "sent"


def hop(rref, names):
    """remote() to the next name, passing ``rref`` along; the last one fetches it."""
    if not names:
        return rref.to_here()
    return rpcdist.remote(names[0], hop, args=(rref, names[1:])).to_here()


def make_remote(to, fn, *args):
    """Create an RRef owned by ``to`` from here, and return it."""
    return rpcdist.remote(to, fn, args=args)


def make_local(value):
    return rpcdist.RRef(value)


def nested_rrefs(other):
    """An RRef to a list of RRefs: one owned here, one owned by ``other``."""
    return rpcdist.RRef([rpcdist.RRef("mine"), rpcdist.remote(other, echo, args=("theirs",))])


def fetch_nested(outer):
    """``outer`` is an RRef to an RRef to a list of RRefs."""
    return [r.to_here() for r in outer.to_here().to_here()]


def return_twice(rref):
    return {"a": rref, "b": [rref, (rref,)]}


# ------------------------------------------------------------- per-worker stash

STASH: dict[tuple[str, int], object] = {}
_ids = iter(range(1, 1 << 62))


def keep(obj):
    """Keep ``obj`` on this worker; return its handle."""
    h = next(_ids)
    STASH[(me(), h)] = obj
    return h


def take(h):
    return STASH[(me(), h)]


def drop(h):
    STASH.pop((me(), h), None)
    gc.collect()
    return True


def stash_to_here(h):
    return STASH[(me(), h)].to_here()


def pass_on(h, to):
    """Send the stashed RRef ``h`` to ``to``, which keeps it; its handle there."""
    return rpcdist.rpc_sync(to, keep, args=(STASH[(me(), h)],))


def keep_remote(owner, token):
    return keep(rpcdist.remote(owner, Tracked, args=(token,)))


def keep_local(token):
    return keep(rpcdist.RRef(Tracked(token)))


def clear():
    STASH.clear()
    gc.collect()


# ------------------------------------------------------- liveness of owned values

LIVE: dict[int, weakref.ref] = {}


class Tracked:
    """A value whose liveness the property test observes (weakly)."""

    def __init__(self, token):
        self.token = token
        LIVE[token] = weakref.ref(self)

    def get_token(self):
        return self.token


def stash_token(h):
    """The token of the Tracked value behind the stashed RRef ``h`` (a proxy call)."""
    return STASH[(me(), h)].rpc_sync().get_token()


def alive(token):
    ref = LIVE.get(token)
    return ref is not None and ref() is not None


def wait_for_forks(count, timeout=10.0):
    """On an owner: wait until it knows exactly ``count`` forks; return the reading."""
    agent = rpcdist._rpc._context.current_agent()
    end = time.monotonic() + timeout
    while True:
        n = agent.statistics().get("rref_forks", 0)
        if n == count or time.monotonic() > end:
            return n
        gc.collect()
        time.sleep(0.005)


def raise_value_error_with(rref, msg):
    raise ValueError(msg)


def forks_then_token(rref, wait=0.3):
    """On the owner: the forks it knows once they are gone or ``wait``
    seconds have passed, and the token of the Tracked value ``rref`` names."""
    return wait_for_forks(0, timeout=wait), rref.local_value().token


def take_and_drop(h):
    """Return the stashed object and forget it here (only the reply holds it now)."""
    return STASH.pop((me(), h))


def relay_and_report(src, h, to, owner):
    """Get an RRef from ``src`` in a reply (not gated, so unconfirmed here), pass it
    to ``to``, which drops it; report what the owner and this worker see meanwhile."""
    rref = rpcdist.rpc_sync(src, take_and_drop, args=(h,))
    pending_here = rpcdist._rpc._context.current_agent().statistics()["rref_pending_users"]
    hz = rpcdist.rpc_sync(to, keep, args=(rref,))
    rpcdist.rpc_sync(to, drop, args=(hz,))
    forks = rpcdist.rpc_sync(owner, wait_for_forks, args=(1,))
    return pending_here, forks, rref.confirmed_by_owner()


def make_tracked(token, seconds=0.0):
    time.sleep(seconds)
    return Tracked(token)


def stats():
    return rpcdist._rpc._context.current_agent().statistics()


def forward_async_and_drop(h, to):
    """Send the stashed RRef ``h`` to ``to`` (which keeps it), forget it here, return."""
    rpcdist.rpc_async(to, keep, args=(STASH.pop((me(), h)),))
    gc.collect()
    return "sent"


def crash():
    import os

    os._exit(3)


def lose(rref):
    """Drop ``rref`` without telling its owner (a stand-in for a lost delete)."""
    rref._state = 2  # FAILED: its finaliser sends nothing
    return True


async def async_make_counter(n):
    await asyncio.sleep(0.01)
    return Counter(n)


@async_execution
def later_counter(n):
    fut = rpcdist.Future()
    threading.Timer(0.01, fut.set_result, args=(Counter(n),)).start()
    return fut


def big_array(n, seconds=0.0):
    time.sleep(seconds)
    return np.arange(n, dtype=np.float64)


def of_a_local_class():
    """A value whose class has no name another worker could find."""

    class Here:
        pass

    return Here()
