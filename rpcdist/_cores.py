"""Whether the host has a core to spare: for a thread that busy-polls, or
one that shares a large copy.

A thread that polls a socket instead of sleeping holds a core. Where every
core is wanted (a peer's parallel kernel, other processes), that core is
taken from work that needs it, and a parallel kernel whose threads wait for
each other is slowed by far more than the core's share. So a thread does
not start polling while more threads are runnable on this host than it has
cores (``/proc/loadavg``'s fourth field counts them, the poller included),
and a polling thread stops once they have been for :data:`CROWDED_FOR`: a
thread that runs for a moment (a timer, another process's loop) does not
end a poll.

"Its cores" are the CPUs this process may use (:func:`cpu_allowance`), not
the host's: a container limited to 2 CPUs on a 64-core host is crowded by
its third runnable thread.
"""

from __future__ import annotations

import math
import os

__all__ = ["CROWDED_FOR", "allowance", "cpu_allowance", "crowded", "spare_core"]

#: How long (seconds) the host must stay crowded before a poller gives way.
CROWDED_FOR = 50e-6

_FD: int | None = None
_CORES: int | None = None


def allowance(
    affinity: int,
    cpu_max: str | None = None,
    cfs_quota_us: str | None = None,
    cfs_period_us: str | None = None,
) -> int:
    """CPUs a process may use: the fewest of its ``affinity`` (CPUs it may
    run on) and its cgroup's quota, rounded up (1.5 CPUs let 2 threads run).

    ``cpu_max`` is cgroup v2's ``cpu.max`` ("quota period", quota "max" for
    none); ``cfs_quota_us`` and ``cfs_period_us`` are cgroup v1's files (a
    quota of -1 for none), read where there is no ``cpu.max``. Each is the
    file's text, or None where it could not be read; text that does not
    parse counts as no quota.
    """
    cpus = max(1, affinity)
    quota: str | None = None
    period: str | None = None
    if cpu_max is not None:
        fields = cpu_max.split()
        if len(fields) == 2:
            quota, period = fields
    elif cfs_quota_us is not None and cfs_period_us is not None:
        quota, period = cfs_quota_us.strip(), cfs_period_us.strip()
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return cpus
    if q > 0 and p > 0:
        cpus = min(cpus, max(1, math.ceil(q / p)))
    return cpus


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, ValueError):
        return None


def cpu_allowance() -> int:
    """This process's CPU allowance (:func:`allowance` of its affinity and
    cgroup files), read once and kept."""
    global _CORES
    if _CORES is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = os.cpu_count() or 1
        _CORES = allowance(
            affinity,
            _read("/sys/fs/cgroup/cpu.max"),
            _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
            _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
        )
    return _CORES


def _runnable() -> int | None:
    """Threads runnable on this host now (``/proc/loadavg``), or None where
    that cannot be read."""
    global _FD
    if _FD is None:
        try:
            _FD = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            _FD = -1
    if _FD < 0:
        return None
    try:
        return int(os.pread(_FD, 64, 0).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


def crowded() -> bool:
    """More threads are runnable on this host now than this process has
    CPUs (:func:`cpu_allowance`); False where that cannot be read."""
    running = _runnable()
    return running is not None and running > (_CORES or cpu_allowance())


def spare_core() -> bool:
    """One more thread of this process would find a CPU idle now (fewer
    threads are runnable than it has CPUs, the caller counted); False
    where that cannot be read."""
    running = _runnable()
    return running is not None and running < (_CORES or cpu_allowance())
