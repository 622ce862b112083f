"""``torch.distributed.nn`` over rpcdist: ``from rpcdist.torch.nn import RemoteModule``."""

from __future__ import annotations

from .._publish import publish
from ._install import install
from ._remote_module import RemoteModule

__all__ = ["RemoteModule"]

publish(__name__, __all__, globals())
install()  # (codec hooks: see rpcdist.torch._install)
