"""``torch.distributed.optim`` over rpcdist: ``from rpcdist.torch.optim import DistributedOptimizer``."""

from __future__ import annotations

from .._publish import publish
from ._install import install
from ._optim import DistributedOptimizer

__all__ = ["DistributedOptimizer"]

publish(__name__, __all__, globals())
install()  # (codec hooks: see rpcdist.torch._install)
