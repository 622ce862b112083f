"""Futures: :class:`Future`, :func:`collect_all`, :func:`wait_all`."""

from ._futures import Future, collect_all, wait_all

__all__ = ["Future", "collect_all", "wait_all"]
