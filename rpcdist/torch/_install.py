"""What ``rpcdist.torch`` teaches the codec's type tables, run when any of
its public modules is imported: torch's modules, shapes, dtypes, devices and
sparse tensors, and rpcdist Futures for ``torch.futures``. What an *agent*
does with torch tensors (autograd edges, ``RRef.backward`` from a torch
loss) is registered on each agent when it is made, by ``_extension``."""

from __future__ import annotations

from . import _futures, _modules, _profile, _remote_module, _values

__all__ = ["install"]


def install() -> None:
    """Teach the codec torch's modules, shapes, dtypes and devices,
    ``torch.futures.wait_all`` and ``collect_all`` rpcdist Futures, and
    torch's legacy profiler remote events (idempotent)."""
    _modules.install()
    _remote_module.install()
    _values.install()
    _futures.install()
    _profile.install()
