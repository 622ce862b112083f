"""Functions the benchmarks call remotely (importable in every process)."""

from __future__ import annotations


def noop():
    return None


def echo(x):
    return x
