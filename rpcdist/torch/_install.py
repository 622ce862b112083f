"""What ``rpcdist.torch`` teaches the rest of rpcdist, run when any of its
public modules is imported: a program that uses rpcdist's own ``init_rpc``
with ``rpcdist.torch.autograd`` (and never imports ``rpcdist.torch.rpc``)
still records autograd edges for the torch tensors its calls carry."""

from __future__ import annotations

from . import _backward, _edges, _futures, _modules, _profile, _remote_module, _values

__all__ = ["install"]


def install() -> None:
    """Teach the codec torch's autograd edges, modules, shapes, dtypes and
    devices, ``RRef.backward`` torch losses, and ``torch.futures.wait_all``
    and ``collect_all`` rpcdist Futures, and torch's legacy profiler remote
    events (idempotent)."""
    _edges.install()
    _backward.install()
    _modules.install()
    _remote_module.install()
    _values.install()
    _futures.install()
    _profile.install()
