"""Functions the benchmarks call remotely (importable in every process)."""

from __future__ import annotations


def noop():
    return None


def echo(x):
    return x


def ipc_used():
    """Whether this worker has both sent and received an array by CUDA IPC
    (the first large arrays to a peer take the host path while it is probed)."""
    import rpcdist

    s = rpcdist.statistics()
    return bool(s["cuda_ipc_sent"] and s["cuda_ipc_received"])
