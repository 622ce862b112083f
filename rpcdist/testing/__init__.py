"""Helpers to run several workers for tests, examples and benchmarks.

* :func:`local_agents` starts N agents inside this process (each with its own
  event-loop thread), linked over loopback sockets.
* :func:`run_workers` runs a function on N worker processes (``spawn``), with
  a hard timeout; every process is killed on exit, even on failure.

Everything listens on 127.0.0.1 on ports the OS picks.
"""

from .._publish import publish
from .._transport._faulty import Fault, FaultInjector
from ._local import as_current, local_agents
from ._workers import WorkerFailed, run_workers

__all__ = [
    "Fault",
    "FaultInjector",
    "WorkerFailed",
    "as_current",
    "local_agents",
    "run_workers",
]

publish(__name__, __all__, globals())
