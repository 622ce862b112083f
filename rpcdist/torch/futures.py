"""``torch.futures`` for programs ported to rpcdist: ``import rpcdist.torch.futures``.

:class:`Future` is rpcdist's own (``wait``, ``value``, ``then``,
``add_done_callback``, ``set_result``, ``set_exception``, and awaitable);
:func:`wait_all` and :func:`collect_all` accept torch's futures as well.
"""

from __future__ import annotations

from .._futures import Future
from .._publish import publish
from ._futures import collect_all, wait_all
from ._install import install

__all__ = ["Future", "collect_all", "wait_all"]

publish(__name__, __all__, globals())
install()  # (codec hooks: see rpcdist.torch._install)
