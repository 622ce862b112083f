"""A second opinion on a silent peer: its process, seen through ``/proc``.

Silence on a link does not tell a peer that is paused (a full garbage
collection, a native call holding the GIL: its heartbeats wait for the GIL)
from one that is hung. When the peer runs on this host, in the same pid
namespace, the kernel can tell: a stopped process (``T``, ``t``: SIGSTOP,
a debugger) or one that is gone is not coming back, while one that runs or
sleeps (``R``, ``S``, ``D``) is only slow.

Two processes see each other this way only when they share the kernel (boot
id), the pid namespace (the pid means the same process) and the network
namespace (otherwise a partition between them is possible, and a running
process says nothing about the link): :func:`seat` names all three.
"""

from __future__ import annotations

import os

__all__ = ["GONE", "RUNNING", "STOPPED", "boot_id", "namespace", "process_state", "seat"]

#: The process has exited (or is a zombie).
GONE = "gone"
#: It is stopped (SIGSTOP, a tracer): it will not answer.
STOPPED = "stopped"
#: It runs, sleeps or waits for I/O: it may be only slow.
RUNNING = "running"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def boot_id() -> str:
    """The kernel's boot id (``""`` where it cannot be read)."""
    return _read("/proc/sys/kernel/random/boot_id")


def namespace(kind: str) -> str:
    """This process's ``kind`` namespace (``"pid:[4026531836]"``; ``""``
    where it cannot be read)."""
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def seat() -> str:
    """Where this process can be seen from: boot id, pid and network
    namespaces (``""`` without ``/proc``: no second opinion then)."""
    boot = boot_id()
    pid_ns, net_ns = namespace("pid"), namespace("net")
    if not (boot and pid_ns and net_ns):
        return ""
    return f"{boot}/{pid_ns}/{net_ns}"


def process_state(pid: int) -> str | None:
    """What ``/proc`` says of process ``pid``: :data:`GONE`, :data:`STOPPED`,
    :data:`RUNNING`, or ``None`` when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return GONE
    except OSError:
        return None
    end = stat.rfind(b")")
    state = stat[end + 2 : end + 3]
    if state in (b"Z", b"X", b"x"):
        return GONE
    if state in (b"T", b"t"):
        return STOPPED
    return RUNNING if state else None
