"""Whether the host has a core to spare for a thread that busy-polls.

A thread that polls a socket instead of sleeping holds a core. Where every
core is wanted (a peer's parallel kernel, other processes), that core is
taken from work that needs it, and a parallel kernel whose threads wait for
each other is slowed by far more than the core's share. So a polling
thread stops as soon as more threads are runnable on this host than it has
cores (``/proc/loadavg``'s fourth field counts them, the poller included)
for :data:`CROWDED_FOR`: a thread that runs for a moment (a timer, another
process's loop) does not count.
"""

from __future__ import annotations

import os

__all__ = ["CROWDED_FOR", "crowded"]

#: How long (seconds) the host must stay crowded before a poller gives way.
CROWDED_FOR = 50e-6

_FD: int | None = None
_CORES = os.cpu_count() or 1


def crowded() -> bool:
    """More threads are runnable on this host now than it has cores (False
    where that cannot be read)."""
    global _FD
    if _FD is None:
        try:
            _FD = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            _FD = -1
    if _FD < 0:
        return False
    try:
        running = int(os.pread(_FD, 64, 0).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return False
    return running > _CORES
